"""The changes ``Run.measure`` can try, checked before anything runs, and each finding's change in those terms.

A change is a dict; several keys together are measured as one combination. The keys:

``autocast``: ``"bfloat16"`` or ``"float16"``
    The forward pass and the loss run under ``torch.autocast(device, dtype)``; float16 also gets a
    ``torch.amp.GradScaler`` (scaled loss, unscaled gradients, skipped steps on overflow).
``tf32``: bool
    TF32 for float32 matmuls and cuDNN convolutions (``torch.backends.cuda.matmul.fp32_precision``
    and ``torch.backends.cudnn.conv/rnn.fp32_precision`` set to ``"tf32"``, or ``"ieee"`` for False),
    switched on only while the changed step runs. It changes CUDA's math only: on the CPU it is
    measured and changes nothing.
``compile``: True or a mode (``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"``,
    ``"max-autotune-no-cudagraphs"``)
    A copy of the model is compiled with ``torch.compile`` (a LightningModule: its ``training_step``);
    the compilation's time is reported and its steps are not timed.
``channels_last``: bool
    The model's copy and its 4-d inputs in ``torch.channels_last`` memory format (convolutions).
``fused_optimizer``: bool
    The optimizer rebuilt with ``fused=True`` (its state carried over); where the optimizer or the
    device has no fused kernel, with ``foreach=True``; the measurement's notes say which.
``batch_size``: a positive int
    Batches of that size, built from the observed batch's own rows. A smaller batch accumulates
    gradients over ``observed // batch_size`` micro-batches per optimizer step, keeping the effective
    batch; a larger one takes one optimizer step per batch (scale the learning rate with it). Throughput
    is samples per second either way.
``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``
    The DataLoader settings the tuner measures (gpuwidget.measure.tuner): a new loader with them over
    the user's dataset feeds the step (or, without a trained model, is timed on its own).

Unknown keys and bad values raise ``ValueError`` (:func:`check_change`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

from gpuwidget.facts import LoaderChange

if TYPE_CHECKING:
    from gpuwidget.advice.finding import FindingChange

AUTOCAST_DTYPES = ("bfloat16", "float16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
MODEL_KEYS = ("autocast", "tf32", "compile", "channels_last", "fused_optimizer", "batch_size")
KEYS = MODEL_KEYS + LOADER_KEYS


class TrialChange(LoaderChange, total=False):
    """A change ``Run.measure`` takes (the module docstring says what each key does); the loader's keys are
    :class:`~gpuwidget.facts.LoaderChange`'s, ``batch_size`` here the training step's batch."""

    autocast: Literal["bfloat16", "float16"]
    tf32: bool
    compile: bool | str  # True or one of COMPILE_MODES
    channels_last: bool
    fused_optimizer: bool


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_value(key: str, value: Any) -> str | None:
    """Why ``value`` is not one ``key`` takes, or None when it is."""
    if key == "autocast":
        return None if value in AUTOCAST_DTYPES else f"one of {', '.join(map(repr, AUTOCAST_DTYPES))}"
    if key in ("tf32", "channels_last", "fused_optimizer", "pin_memory", "persistent_workers"):
        return None if isinstance(value, bool) else "True or False"
    if key == "compile":
        return None if value is True or value in COMPILE_MODES else (
            f"True or a mode: {', '.join(map(repr, COMPILE_MODES))}")
    if key in ("batch_size", "prefetch_factor"):
        return None if _positive_int(value) else "a positive integer"
    if key == "num_workers":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else "an integer >= 0"
    return "a known key"


def check_change(change: object) -> TrialChange:
    """The change as a plain dict, or ``ValueError`` naming the first unknown key or bad value."""
    if not isinstance(change, Mapping):
        raise ValueError(f"a change is a dict such as {{'autocast': 'bfloat16'}}, not {type(change).__name__}")
    if not change:
        raise ValueError(f"the change is empty: give at least one of {', '.join(KEYS)}")
    checked: dict[str, object] = {}
    for key, value in change.items():
        if key not in KEYS:
            raise ValueError(f"unknown change key {key!r}: the keys are {', '.join(KEYS)}")
        wanted = _check_value(key, value)
        if wanted is not None:
            raise ValueError(f"{key} must be {wanted}, not {value!r}")
        checked[key] = value
    if checked.get("compile") is False:
        checked.pop("compile")
    if checked.get("prefetch_factor") and checked.get("num_workers") == 0:
        raise ValueError("prefetch_factor needs num_workers > 0 (torch's DataLoader refuses it otherwise)")
    return cast(TrialChange, checked)


def loader_part(change: LoaderChange) -> LoaderChange:
    return cast(LoaderChange, {k: v for k, v in change.items() if k in LOADER_KEYS})


def model_part(change: TrialChange) -> TrialChange:
    return cast(TrialChange, {k: v for k, v in change.items() if k in MODEL_KEYS})


def describe(change: Mapping[str, object]) -> str:
    """``autocast=bfloat16 + compile`` for a table row or a plan."""
    parts = []
    for key, value in change.items():
        parts.append(key if value is True else f"{key}={value}")
    return " + ".join(parts) or "nothing"


# --------------------------------------------------------------------------- a finding's change


def finding_changes(rule: str, change: FindingChange) -> list[TrialChange]:
    """The changes that try a finding's suggestion, the one its bound refers to first; [] when its
    change is not one a step can try (a launcher, an allocator setting, the machine's)."""
    if rule == "fp32-math":
        # Its bound is TF32's ratio over FP32; bfloat16 autocast is the larger change it also offers.
        options: list[TrialChange] = [{"tf32": True}]
        if change.get("autocast_dtype") in AUTOCAST_DTYPES:
            options.append(cast(TrialChange, {"autocast": change["autocast_dtype"]}))
        return options
    if rule == "launch-bound":
        if change.get("compile_mode") in COMPILE_MODES:
            return [{"compile": change["compile_mode"]}]
        return [{"compile": True}] if change.get("torch_compile") else []
    if rule == "small-batch" and _positive_int(change.get("batch_size")):
        return [{"batch_size": change["batch_size"]}]
    loader: dict[str, object] = {k: v for k, v in change.items() if k in LOADER_KEYS}
    if loader and not any(k in change for k in MODEL_KEYS if k != "batch_size"):
        try:
            return [check_change(loader)]
        except ValueError:
            return []
    return []
