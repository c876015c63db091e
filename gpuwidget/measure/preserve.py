"""Process-wide state a measurement touches, saved before and put back after: RNG, torch.backends
flags, and the compile caches it filled.

The model and the optimizer are measured on copies (gpuwidget.measure.sides), so the user's own are
never stepped; what remains shared is global: the random generators (gpuwidget.measure.rng), the
float32 precision switches and cuDNN's flags, and torch.compile's code caches.

The precision switches exist in two APIs in torch 2.13: the new ``fp32_precision`` attributes and the
legacy ``allow_tf32`` / ``get_float32_matmul_precision()``, which raise once the new ones disagree
with each other ("mix of the legacy and new APIs"; gpuwidget.probes.torch_model reads them the same
way). The legacy values are views of the new ones, so the new attributes are what is saved and put
back, every one of them, and the legacy reads then give what they gave before (raising included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuwidget.measure.rng import preserved_rng

# (object path under torch.backends, attribute): the new API's switches, outermost first (restored in
# this order, so a level set after its parent keeps its own value).
PRECISION_SWITCHES = (("", "fp32_precision"), ("cuda.matmul", "fp32_precision"),
                      ("cudnn", "fp32_precision"), ("cudnn.conv", "fp32_precision"),
                      ("cudnn.rnn", "fp32_precision"), ("mkldnn", "fp32_precision"),
                      ("mkldnn.matmul", "fp32_precision"), ("mkldnn.conv", "fp32_precision"),
                      ("mkldnn.rnn", "fp32_precision"))
# Flags of one API only, saved and restored as they are.
PLAIN_FLAGS = (("cudnn", "benchmark"), ("cudnn", "deterministic"), ("cudnn", "enabled"),
               ("cuda.matmul", "allow_fp16_reduced_precision_reduction"),
               ("cuda.matmul", "allow_bf16_reduced_precision_reduction"), ("mkldnn", "enabled"))
# Legacy reads, compared by tests (not restored: they follow the switches above).
LEGACY_READS = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))


def _node(path: str) -> Any:
    import torch

    node: Any = torch.backends
    for part in filter(None, path.split(".")):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _read(path: str, name: str) -> Any:
    node = _node(path)
    if node is None:
        return None
    try:
        return getattr(node, name)
    except AttributeError:  # not in this build
        return None
    except Exception as exc:  # noqa: BLE001 - a legacy read that raises is part of the state
        return f"raises {type(exc).__name__}"


def backend_flags() -> dict[str, object]:
    """Every switch this module knows, as read now (a read that raises reads as ``"raises RuntimeError"``)."""
    import torch

    flags = {f"{path or 'backends'}.{name}": _read(path, name) for path, name in
             PRECISION_SWITCHES + PLAIN_FLAGS + LEGACY_READS}
    try:
        flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except Exception as exc:  # noqa: BLE001
        flags["float32_matmul_precision"] = f"raises {type(exc).__name__}"
    flags["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    return flags


@contextmanager
def preserved_backends() -> Iterator[None]:
    """Put the precision switches and cuDNN's flags back as they were, however the block ends."""
    saved = [(path, name, _read(path, name)) for path, name in PRECISION_SWITCHES + PLAIN_FLAGS]
    try:
        yield
    finally:
        for path, name, value in saved:
            node = _node(path)
            if node is None or value is None or (isinstance(value, str) and value.startswith("raises ")):
                continue
            # A switch this build refuses to set was not changed by the block either.
            with contextlib.suppress(Exception):
                setattr(node, name, value)


@contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 on (or off) for CUDA matmuls and cuDNN convolutions and RNNs, in the new API, for the block."""
    value = "tf32" if enabled else "ieee"
    with preserved_backends():
        for path in ("cuda.matmul", "cudnn.conv", "cudnn.rnn"):
            node = _node(path)
            if node is not None and hasattr(node, "fp32_precision"):
                node.fp32_precision = value
        yield


@contextmanager
def preserved_compile_caches() -> Iterator[None]:
    """Code objects torch.compile first compiled inside the block lose their cache entries afterwards.

    A copy of the user's model, compiled, leaves guarded entries on the code of its class's forward;
    those entries would count against the recompile limit of the user's own ``torch.compile`` later.
    Code that had entries before the block (the user's compiled models) keeps them all.
    """
    import sys

    dynamo = sys.modules.get("torch._dynamo.convert_frame")
    before = set(dynamo.input_codes.seen_ids) if dynamo is not None else set()
    try:
        yield
    finally:
        dynamo = sys.modules.get("torch._dynamo.convert_frame")
        if dynamo is not None:
            from torch._dynamo.eval_frame import reset_code

            for ref in list(dynamo.input_codes.seen):
                code = ref()
                if code is not None and id(code) not in before:
                    reset_code(code)


@contextmanager
def preserved_state() -> Iterator[None]:
    """RNG, backend flags and compile caches, as they were before the block."""
    with preserved_rng(), preserved_backends(), preserved_compile_caches():
        yield
