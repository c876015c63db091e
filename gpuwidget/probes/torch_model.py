"""Model probe: dtypes, autocast, matmul precision and compilation, from the first forward passes;
CUDA peak memory and device capability for the cell.

Global module hooks (``register_module_forward_pre_hook``) see every ``nn.Module`` call;
only *top-level* calls (not nested in another module's forward) are looked at, for the
first :data:`TOP_LEVEL_CALLS` of them with trainable parameters, and then the hooks remove
themselves, so a long training loop pays nothing after its first steps.

The model is the module being trained: the one whose parameters changed in place during
the watch (an optimizer step bumps each tensor's version counter), not merely the first
or the largest one called. A transform (an ``nn.Module`` called in ``__getitem__``) has no
trainable parameters and does not use up the budget; a submodule called from a method of
another module (a LightningModule's ``training_step`` calls ``self.encoder``) stands for
that module, which is what the user trains and names.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, cast

from gpuwidget.clock import now
from gpuwidget.facts import AutocastState, CudaDeviceFacts, CudaFacts, DdpFacts, ModelFacts
from gpuwidget.probes.hooks import ModelHook

TOP_LEVEL_CALLS = 16
# Top-level calls looked at in all, trainable or not (transforms run per sample).
MAX_CALLS = 4096
# Frames above a module call searched for a method of another module (training_step).
OWNER_FRAMES = 4
# Modules called top-level on behalf of one model kept (a LightningModule's encoder and decoder).
MAX_ENTRIES = 4


class ModelProbe:
    """Collects facts about the models a watched cell calls."""

    def __init__(self) -> None:
        self.installed = False
        self._handles: list[Any] = []
        self._local = threading.local()
        self._seen = 0
        self._calls = 0
        self._models: dict[int, ModelFacts] = {}
        self._objects: dict[int, Any] = {}
        self._versions: dict[int, int] = {}  # trainable parameters' version counters when first seen
        self._parallel: dict[int, ParallelWatch] = {}  # DDP / DataParallel wrappers seen, by id
        # The modules actually called top-level for each model (itself, or its submodules called from
        # one of its methods) and when it was first called: where a step probe hooks its forward.
        self._entries: dict[int, list[Any]] = {}
        self._first_call: dict[int, float] = {}
        # The model whose parameters the stepped optimizer holds (set by probes.torch_steps).
        self.trained_key: int | None = None
        # Called once, as (key, model, entries, first call, training calls), when a model that no
        # optimizer steps is called to train (grad enabled) after its parameters changed since its first
        # such call: a loop that updates them itself (probes.torch_steps counts its steps from then).
        self.on_updated: Any = None
        self._fingerprints: dict[int, tuple[float | None, ...]] = {}
        self._training_calls: dict[int, int] = {}

    def install(self) -> None:
        if self.installed:
            return
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after, always_call=True),
        ]
        self.installed = True

    def uninstall(self) -> None:
        self._unhook()
        for watch in self._parallel.values():
            watch.remove()

    def _unhook(self) -> None:
        """Remove the global forward hooks; the DDP wrappers' own counters stay until :meth:`uninstall`
        (one hook on one module, read on DDP's sampled iterations the whole watch through)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.installed = False

    def _before(self, module: Any, args: tuple[Any, ...]) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            with contextlib.suppress(Exception):  # a probe never breaks the forward pass
                self._look(module, args)

    def _after(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        self._local.depth = max(0, getattr(self._local, "depth", 1) - 1)
        if (self._seen >= TOP_LEVEL_CALLS or self._calls >= MAX_CALLS) and self._local.depth == 0:
            self._unhook()

    def _look(self, module: Any, args: tuple[Any, ...]) -> None:
        import torch

        self._calls += 1
        called = module
        module = _owner(module, sys._getframe(3))  # 3: _before, Module._call_impl, its caller
        key = id(module)
        entries = self._entries.setdefault(key, [])
        if len(entries) < MAX_ENTRIES and not any(ref() is called for ref in entries):
            entries.append(weakref.ref(called))
        if key in self._models:
            self._models[key]["calls"] += 1
            if self._versions[key] >= 0:
                self._seen += 1
                self._watch_update(torch, key, module)
            return
        dtypes: Counter[str] = Counter()
        devices: set[str] = set()
        parameters = 0
        for parameter in module.parameters():
            count = parameter.numel()
            parameters += count
            dtypes[str(parameter.dtype).replace("torch.", "")] += count
            devices.add(parameter.device.type)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._versions[key] = sum(p._version for p in trainable) if trainable else -1
        if trainable:
            self._seen += 1
        tensor = _first_tensor(args)
        device_type = next(iter(devices)) if len(devices) == 1 else ("cuda" if "cuda" in devices else "cpu")
        self._objects[key] = weakref.ref(module)  # never keep the user's model alive
        self._first_call[key] = now()
        parallel = ParallelWatch.of(module)
        if parallel is not None:
            self._parallel[key] = parallel
        self._models[key] = {
            "class": type(module).__name__,
            "parameters": parameters,
            "param_dtypes": dict(dtypes),
            "param_devices": sorted(devices),
            "input_dtype": None if tensor is None else str(tensor.dtype).replace("torch.", ""),
            "input_device": None if tensor is None else tensor.device.type,
            "autocast": _autocast_state(torch, device_type),
            "compiled": hasattr(module, "_orig_mod") or type(module).__name__ == "OptimizedModule",
            "training": bool(module.training),
            "calls": 1,
        }
        if trainable:
            self._watch_update(torch, key, module)

    def _watch_update(self, torch: Any, key: int, module: Any) -> None:
        """At a top-level training call (grad enabled) of a model no optimizer has claimed: did its
        parameters change since its first one? An optimizer's step is seen by its own hook; a loop that
        updates the parameters itself (``p.data.add_(p.grad, alpha=-lr)``, which bumps no version
        counter) only through their values."""
        if self.on_updated is None or self.trained_key is not None or not torch.is_grad_enabled():
            return
        self._training_calls[key] = calls = self._training_calls.get(key, 0) + 1
        values = _fingerprint(torch, module)
        first = self._fingerprints.setdefault(key, values)
        if values != first:
            hook, self.on_updated = self.on_updated, None
            hook(key, module, self._entries_of(key, module), self._first_call.get(key, 0.0), calls)

    def _trained(self, key: int) -> bool:
        """Its trainable parameters were updated in place since it was first seen."""
        ref = self._objects.get(key)
        module = None if ref is None else ref()
        if module is None or self._versions.get(key, -1) < 0:
            return False
        return sum(p._version for p in module.parameters() if p.requires_grad) > self._versions[key]

    def candidates(self) -> Iterator[tuple[int, Any, list[Any], float]]:
        """The models seen that are still alive: (key, model, the modules called top-level for it, first call)."""
        for key, ref in list(self._objects.items()):
            module = ref()
            if module is None:
                continue
            yield key, module, self._entries_of(key, module), self._first_call.get(key, 0.0)

    def _entries_of(self, key: int, module: Any) -> list[Any]:
        """The live modules called top-level for this model, or the model itself."""
        return [entry for entry in (ref() for ref in self._entries.get(key, [])) if entry is not None] or [module]

    def _main(self) -> int | None:
        """The model the stepped optimizer trains; else the trained module with the most parameters;
        without training (inference), the module with the most trainable parameters, then the most
        parameters."""
        if not self._models:
            return None
        if self.trained_key in self._models:
            return self.trained_key
        return max(self._models, key=lambda k: (self._trained(k), self._versions.get(k, -1) >= 0,
                                                self._models[k]["parameters"]))

    def model(self) -> Any:
        """The main model object, or None."""
        key = self._main()
        ref = None if key is None else self._objects.get(key)
        return None if ref is None else ref()

    def facts(self, names: Mapping[int, str]) -> ModelFacts | None:
        """The main model (most parameters) with its user-namespace name, or None if none ran."""
        key = self._main()
        if key is None:
            return None
        facts = self._models[key].copy()
        facts["name"] = names.get(key)
        parallel = self._parallel.get(key)
        facts["data_parallel"] = parallel is not None and parallel.kind == "DataParallel"
        if parallel is not None:
            facts.update(parallel.facts())
        facts.update(precision_settings())
        return facts


# DDP's reducer records its timings on iterations 1-10 and then every 100th
# (kDDPRuntimeLoggingSampleRate in torch/csrc/distributed/c10d/reducer.hpp): the wrapper's logging
# data is read again on those forward calls, so its averages survive a model freed before the watch ends.
DDP_READ_EVERY = 100
DDP_EARLY_READS = 12
# Each read's latest-iteration figures are kept too (``DdpFacts.iterations``), the most recent this many:
# one iteration is a noisy figure of a typical step, the median of several is not.
DDP_KEPT_ITERATIONS = 32
DDP_ITERATION_KEYS = ("iteration", "forward_compute_time", "backward_compute_time", "backward_comm_time",
                      "backward_compute_comm_overlap_time")
# _get_ddp_logging_data() keys that are 0/1 flags, kept as bool.
DDP_FLAGS = ("gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers", "has_sync_bn",
             "has_rebuilt_buckets", "is_multi_device_module")
# Comma-separated byte counts, kept as lists of ints.
DDP_LISTS = ("bucket_sizes", "rebuilt_bucket_sizes")


class ParallelWatch:
    """A DistributedDataParallel or DataParallel wrapper the probe saw: DDP's own logging data
    (``_get_ddp_logging_data()``), read on the forward calls where its reducer has new figures."""

    def __init__(self, module: Any, kind: str) -> None:
        self.kind = kind
        self._module = weakref.ref(module)
        self._calls = 0
        self._ddp: DdpFacts = {}
        self._iterations: list[dict[str, int]] = []  # DDP's figures of each sampled iteration read
        self._handle: Any = None
        self._gpus = len(getattr(module, "device_ids", None) or [])
        self._static: DdpFacts = {}
        if kind == "DistributedDataParallel":
            self._static = {"static_graph": bool(getattr(module, "static_graph", False))}
            self._handle = module.register_forward_pre_hook(ModelHook(self._count))

    @classmethod
    def of(cls, module: Any) -> ParallelWatch | None:
        from torch import nn

        if isinstance(module, nn.parallel.DistributedDataParallel):
            return cls(module, "DistributedDataParallel")
        if isinstance(module, nn.DataParallel):
            return cls(module, "DataParallel")
        return None

    def _count(self, module: Any, args: Any) -> None:
        self._calls += 1
        if self._calls <= DDP_EARLY_READS or self._calls % DDP_READ_EVERY == 1:
            with contextlib.suppress(Exception):  # a probe never breaks the forward pass
                self._read(module)

    def _read(self, module: Any) -> None:
        self._ddp = ddp_logging_facts(module._get_ddp_logging_data())
        figures = cast(Mapping[str, int], self._ddp)
        latest = {key: int(figures.get(key) or 0) for key in DDP_ITERATION_KEYS}
        if latest["iteration"] > (self._iterations[-1]["iteration"] if self._iterations else 0):
            self._iterations = [*self._iterations, latest][-DDP_KEPT_ITERATIONS:]

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def facts(self) -> ModelFacts:
        if self.kind == "DataParallel":
            return {"data_parallel_gpus": self._gpus}
        module = self._module()
        if module is not None:
            with contextlib.suppress(Exception):  # the process group may be gone already
                self._read(module)
        if not self._ddp:
            return {"ddp": self._static.copy()}
        return {"ddp": {**self._ddp, **self._static, "iterations": list(self._iterations)}}


def ddp_logging_facts(data: Mapping[str, object]) -> DdpFacts:
    """The numeric and boolean fields of DDP's logging data: times in ns as torch reports them
    (``avg_*`` are averages over the sampled iterations), sizes in bytes; absolute timestamps
    (``*_start``, ``*_end``) and strings (addresses, environment) are left out."""
    facts: dict[str, object] = {}
    for key, value in data.items():
        if key in DDP_LISTS and isinstance(value, str):
            facts[key] = [int(part) for part in value.replace(" ", "").split(",") if part.isdigit()]
        elif key in DDP_FLAGS:
            facts[key] = bool(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not key.endswith(("_start", "_end")):
            facts[key] = value
    return cast(DdpFacts, facts)


def _owner(module: Any, frame: Any) -> Any:
    """The module whose method made this top-level call (a LightningModule's training_step
    calling ``self.encoder``), or ``module`` itself when called from other code."""
    from torch import nn

    for _ in range(OWNER_FRAMES):
        if frame is None:
            break
        if not str(frame.f_globals.get("__name__", "")).startswith("torch."):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not module:
                return owner
            return module
        frame = frame.f_back
    return module


# Trainable parameters whose first element stands for the model's values (an embedding's first row
# changes only in the steps whose batch holds token 0; a layer's weight in every step).
FINGERPRINT_PARAMETERS = 8


def _fingerprint(torch: Any, module: Any) -> tuple[float | None, ...]:
    """The first element of a few trainable parameters: it moves when an update moves them."""
    with torch.no_grad():
        trainable = (p for p in module.parameters() if p.requires_grad and p.numel())
        firsts = [p.detach().reshape(-1)[0] for p in itertools.islice(trainable, FINGERPRINT_PARAMETERS)]
        if not firsts:
            return ()
        try:
            values = torch.stack([f.float() for f in firsts]).cpu().tolist()  # one copy to the host
        except RuntimeError:  # parameters on several devices
            values = [float(f) for f in firsts]
    return tuple(None if math.isnan(value) else value for value in values)  # NaN != NaN: not a change


def _first_tensor(value: Any, depth: int = 0) -> Any:
    if hasattr(value, "dtype") and hasattr(value, "device"):
        return value
    if depth < 3:
        items: Any = value.values() if isinstance(value, Mapping) else value
        if isinstance(items, (list, tuple)) or isinstance(value, Mapping):
            for item in items:
                found = _first_tensor(item, depth + 1)
                if found is not None:
                    return found
    return None


def _autocast_state(torch: Any, device_type: str) -> AutocastState:
    try:
        enabled = bool(torch.is_autocast_enabled(device_type))
        dtype = str(torch.get_autocast_dtype(device_type)).replace("torch.", "") if enabled else None
    except (TypeError, RuntimeError, AttributeError):  # older torch: no device argument
        enabled = bool(torch.is_autocast_enabled())
        dtype = None
    return {"enabled": enabled, "dtype": dtype, "device_type": device_type}


# torch's float32 precision names, new API (``fp32_precision``) -> legacy (``float32_matmul_precision``).
_LEGACY_MATMUL_NAMES = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def precision_settings() -> ModelFacts:
    """Global float32 math settings: TF32 on Ampere+ makes FP32 matmuls and convolutions use Tensor Cores.

    PyTorch now documents ``torch.backends.cuda.matmul.fp32_precision`` and
    ``torch.backends.cudnn.conv.fp32_precision``; once a program sets one of them, the legacy readers
    (``torch.get_float32_matmul_precision()``, ``matmul.allow_tf32``) raise "mix of the legacy and
    new APIs". So the new attributes are read where they exist and the legacy ones only otherwise,
    each read on its own: a setting that can't be read is left out, never a failed probe.
    ``tf32_api`` says which API this torch has, so advice can be written in it.
    """
    import torch

    backends: Any = torch.backends
    matmul_node: Any = getattr(getattr(backends, "cuda", None), "matmul", None)
    if hasattr(matmul_node, "fp32_precision"):
        generic = _read(lambda: getattr(backends, "fp32_precision", "none"))
        cudnn = _read(lambda: getattr(backends.cudnn, "fp32_precision", "none"))
        matmul = _effective(_read(lambda: matmul_node.fp32_precision), generic)
        conv = _effective(_read(lambda: backends.cudnn.conv.fp32_precision), cudnn, generic)
        facts: ModelFacts = {"tf32_api": "fp32_precision", "matmul_fp32_precision": matmul,
                             "conv_fp32_precision": conv}
        if matmul is not None:
            facts["float32_matmul_precision"] = _LEGACY_MATMUL_NAMES.get(matmul, matmul)
            facts["cuda_matmul_allow_tf32"] = matmul != "ieee"
        if conv is not None:
            facts["cudnn_allow_tf32"] = conv != "ieee"
        return facts
    facts = {"tf32_api": "legacy"}
    for key, read in (("float32_matmul_precision", torch.get_float32_matmul_precision),
                      ("cuda_matmul_allow_tf32", lambda: bool(backends.cuda.matmul.allow_tf32)),
                      ("cudnn_allow_tf32", lambda: bool(backends.cudnn.allow_tf32))):
        value = _read(read)
        if value is not None:
            facts[key] = value  # type: ignore[literal-required]
    return facts


def _read(getter: Any) -> Any:
    """One setting, or None where this torch can't say (a raising getter, a missing attribute)."""
    try:
        return getter()
    except Exception:  # noqa: BLE001 - one unreadable setting must not lose the others
        return None


def _effective(*levels: Any) -> str | None:
    """The precision in force: "none" at a level means "inherit from the level above"; "ieee" at the top."""
    if levels[0] is None:
        return None
    for level in levels:
        if level not in (None, "none"):
            return str(level)
    return "ieee"


class CudaMemoryProbe:
    """Peak CUDA memory of the cell per device (reset at start when CUDA is already in use)."""

    def __init__(self) -> None:
        self.reset_at_start = False

    def install(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
            self.reset_at_start = True

    def uninstall(self) -> None:
        pass

    def facts(self) -> CudaFacts | None:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        devices: list[CudaDeviceFacts] = []
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            device: CudaDeviceFacts = {
                "index": index,
                "name": properties.name,
                "capability": list(torch.cuda.get_device_capability(index)),
                "total_memory": int(properties.total_memory),
                "peak_allocated": int(torch.cuda.max_memory_allocated(index)),
                "peak_reserved": int(torch.cuda.max_memory_reserved(index)),
            }
            uuid = getattr(properties, "uuid", None)  # to match NVML's device by UUID (mixed-GPU hosts)
            if uuid is not None:
                device["uuid"] = str(uuid)
            devices.append(device)
        return {"devices": devices, "peak_since_cell_start": self.reset_at_start}
