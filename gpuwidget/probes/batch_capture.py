"""One real batch of the trained model, copied once per watch, so a change can later be tried on it.

The step probe calls :func:`capture_batch` at the trained model's first training forward it sees
(its forward pre-hook, once per watch): the call's own arguments are copied (``detach().clone()``,
on the device they are on), and so is what the calling code holds beside them that a loss needs:

* called from a ``training_step(self, batch, batch_idx)`` method (Lightning), that ``batch``;
* otherwise the caller's local tensors whose first dimension is the batch's (``y`` in
  ``loss = criterion(model(x), y)``): the candidates for the loss's target, by name.

It costs one copy of one batch, once; nothing runs on later steps.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwidget.probes.torch_data import first_dim

# Frames above the forward hook searched for the code that called the model (torch's own skipped).
CALLER_FRAMES = 8
# Caller locals kept as target candidates at most.
MAX_TARGETS = 4
# A caller local larger than this multiple of the inputs' bytes is not a target (a cached dataset).
MAX_TARGET_BYTES_RATIO = 4


@dataclass
class CapturedBatch:
    """The trained model's inputs in one training step, copied; see the module docstring."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    entry: Any  # weak reference to the module that was called (the model, or a submodule a training_step called)
    step_batch: Any = None  # the batch a training_step(batch, batch_idx) was given, copied
    has_step_batch: bool = False
    targets: dict[str, Any] = field(default_factory=dict)  # the caller's tensors beside the inputs, by name
    caller: str | None = None  # the calling function's name

    @property
    def samples(self) -> int:
        return first_dim(self.args) or first_dim(self.kwargs) or first_dim(self.step_batch)


def clone_batch(value: Any, depth: int = 0) -> Any:
    """Tensors copied (detached, same device and layout), tuples, lists and dicts rebuilt; the rest kept."""
    if hasattr(value, "detach") and hasattr(value, "clone"):
        return value.detach().clone()
    if depth > 4:
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(clone_batch(v, depth + 1) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(clone_batch(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        try:
            return type(value)({k: clone_batch(v, depth + 1) for k, v in value.items()})  # type: ignore[call-arg]
        except TypeError:  # a mapping type that takes no dict (Hugging Face's BatchEncoding takes one)
            return {k: clone_batch(v, depth + 1) for k, v in value.items()}
    return value


def _tensors(value: Any, depth: int = 0) -> list[Any]:
    if hasattr(value, "detach") and hasattr(value, "shape"):
        return [value]
    if depth > 3:
        return []
    items: Any = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item, depth + 1)]


def _caller(frame: Any) -> Any:
    """The first frame above the hook that is neither torch's nor gpuwidget's probes'."""
    for _ in range(CALLER_FRAMES):
        if frame is None:
            return None
        name = str(frame.f_globals.get("__name__", ""))
        if not (name.startswith("torch.") or name == "torch" or name.startswith("gpuwidget.probes")):
            return frame
        frame = frame.f_back
    return None


def capture_batch(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CapturedBatch:
    """Copy one training forward's inputs and what its caller holds beside them (called from a hook)."""
    captured = CapturedBatch(clone_batch(tuple(args)), dict(clone_batch(dict(kwargs))), weakref.ref(module))
    frame = _caller(sys._getframe(1))
    if frame is None:
        return captured
    code = frame.f_code
    captured.caller = code.co_name
    local_values = frame.f_locals
    if code.co_name == "training_step" and code.co_argcount >= 2 and code.co_varnames[0] == "self":
        captured.step_batch = clone_batch(local_values.get(code.co_varnames[1]))
        captured.has_step_batch = True
        return captured
    inputs = _tensors((args, dict(kwargs)))
    samples = first_dim(args) or first_dim(dict(kwargs))
    if not inputs or not samples:
        return captured
    seen = {id(t) for t in inputs}
    limit = MAX_TARGET_BYTES_RATIO * sum(t.numel() * t.element_size() for t in inputs)
    candidates: list[tuple[str, Any]] = []
    for name, value in list(local_values.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and any(id(item) in seen for item in value):
            # `batch` in `model(batch[0])`: the batch's other elements.
            candidates += [(f"{name}[{i}]", item) for i, item in enumerate(value) if id(item) not in seen]
        else:
            candidates.append((name, value))
    for name, value in candidates:
        if len(captured.targets) >= MAX_TARGETS:
            break
        if not (hasattr(value, "detach") and hasattr(value, "shape")) or id(value) in seen:
            continue
        if getattr(value, "requires_grad", False) or not value.shape or int(value.shape[0]) != samples:
            continue
        if value.numel() * value.element_size() > limit:
            continue
        captured.targets[name] = value.detach().clone()
    return captured
