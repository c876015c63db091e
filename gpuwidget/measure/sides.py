"""The two sides of an A/B measurement: the user's training step as it is, and with the change.

Each side is a copy of the trained model and its optimizer (``copy.deepcopy`` of both together, so
the copied optimizer holds the copied parameters), so the user's own are never stepped, compiled or
converted. A side runs one optimizer step at a time: the micro-batches of one step (more than one
when a smaller batch accumulates gradients), each forward and loss under the side's autocast, the
backward (scaled for float16), then the optimizer's step and ``zero_grad(set_to_none=True)``.

Batches come from the batch the probes copied (the same one every step) or, for loader settings,
from a new DataLoader over the user's dataset built by the tuner (gpuwidget.measure.tuner), one per
run, its start-up and first batches left out of the timing.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuwidget.clock import now
from gpuwidget.facts import LoaderChange
from gpuwidget.measure import preserve
from gpuwidget.measure.changes import loader_part
from gpuwidget.measure.loss import ModelInputs, StepLoss
from gpuwidget.probes.torch_data import first_dim

# Batches a loader-fed run takes before its timing starts, per worker (start-up, first prefetch).
LOADER_WARMUP_PER_WORKER = 2


class MeasureError(RuntimeError):
    """The change cannot be measured on this run (the message says why and what to do)."""


# --------------------------------------------------------------------------- batches


def map_tensors(value: Any, fn: Callable[[Any], Any], depth: int = 0) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, namedtuples, lists, dicts)."""
    if hasattr(value, "shape") and hasattr(value, "detach"):
        return fn(value)
    if depth > 4:
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn, depth + 1) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn, depth + 1) for k, v in value.items()}
    if hasattr(value, "items") and hasattr(value, "keys"):  # a mapping of another type (BatchEncoding)
        return {k: map_tensors(v, fn, depth + 1) for k, v in value.items()}
    return value


def resized(batch: Any, rows: int, size: int) -> Any:
    """The batch with ``size`` rows: every tensor whose first dimension is ``rows`` cycles through its rows."""
    import torch

    def resize(t: Any) -> Any:
        if not t.ndim or t.shape[0] != rows or size == rows:
            return t
        return t[torch.arange(size, device=t.device) % rows]

    return map_tensors(batch, resize)


def split(batch: Any, rows: int, parts: int) -> list[Any]:
    """``parts`` micro-batches of ``rows // parts`` rows each (tensors of another first dimension whole)."""
    if parts <= 1:
        return [batch]
    size = rows // parts

    def part(i: int) -> Any:
        return map_tensors(batch, lambda t: t[i * size:(i + 1) * size] if t.ndim and t.shape[0] == rows else t)

    return [part(i) for i in range(parts)]


def to_device(batch: Any, device: Any) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True) if t.device != device else t)


def channels_last(batch: Any) -> Any:
    import torch

    return map_tensors(batch, lambda t: t.contiguous(memory_format=torch.channels_last)
                       if t.ndim == 4 and t.is_floating_point() else t)


# --------------------------------------------------------------------------- copies


def copy_training(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """Deep copies of the model and its optimizer together (the copy's optimizer holds the copy's
    parameters); the optimizer's own ``step`` wrapper (an LR scheduler's, bound to the user's
    optimizer) is dropped from the copy so stepping it never steps the user's."""
    try:
        model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    except Exception as exc:  # noqa: BLE001 - said to the user with what to do
        raise MeasureError(f"the model or its optimizer cannot be copied ({type(exc).__name__}: {exc}); "
                           "gpuwidget measures changes on copies, never on the user's own objects") from None
    if optimizer_copy is not None:
        optimizer_copy.__dict__.pop("step", None)
        for key in ("_opt_called",):
            optimizer_copy.__dict__.pop(key, None)
    return model_copy, optimizer_copy


def fused(optimizer: Any, device_type: str) -> tuple[Any, str]:
    """The optimizer rebuilt with ``fused=True`` (or ``foreach=True`` where this optimizer or device has
    no fused kernel), its state carried over; and what was done, for the notes."""
    import torch

    kind = type(optimizer)
    takes = inspect.signature(kind.__init__).parameters
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        supported = device_type in _get_fused_kernels_supported_devices()
    except ImportError:
        supported = device_type == "cuda"
    option = "fused" if "fused" in takes and supported else "foreach" if "foreach" in takes else None
    if option is None:
        return optimizer, f"{kind.__name__} takes neither fused= nor foreach=: the optimizer is unchanged"
    if any(group.get(option) for group in optimizer.param_groups):
        return optimizer, f"{kind.__name__} is already {option}: the optimizer is unchanged"
    state = optimizer.state_dict()
    groups = [{"params": list(group["params"])} for group in optimizer.param_groups]
    try:
        rebuilt = kind(groups, **{option: True})
        rebuilt.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        raise MeasureError(f"could not rebuild {kind.__name__} with {option}=True: {exc}") from None
    for group in rebuilt.param_groups:
        group[option] = True
        group["foreach" if option == "fused" else "fused"] = None
    if option == "fused":  # fused kernels take their step counts on the parameters' device, as float32
        for parameter, values in rebuilt.state.items():
            step = values.get("step")
            if isinstance(step, torch.Tensor):
                values["step"] = step.to(device=parameter.device, dtype=torch.float32)
    why = "" if option == "fused" else (
        f" (no fused {kind.__name__} on {device_type})" if "fused" in takes else f" ({kind.__name__} has no fused=)")
    return rebuilt, f"optimizer: {kind.__name__}({option}=True){why}"


# --------------------------------------------------------------------------- a side


@dataclass
class Side:
    """One way to run the training step, on its own copy."""

    label: str
    module: Any  # the model's copy
    optimizer: Any
    loss: StepLoss | None  # None: no model, a loader's batches only
    device: Any
    rows: int  # samples per optimizer step
    accumulation: int = 1
    autocast: str | None = None
    scaler: Any = None
    tf32: bool | None = None
    channels_last: bool = False
    call: Any = None  # what the loss calls: the module, or its compiled form
    loader: Any = None  # the user's loader, with loader_change: fed from a new one
    loader_change: LoaderChange = field(default_factory=lambda: LoaderChange())
    compile_mode: Any = None
    compiled: bool = False
    micro_batches: list[Any] = field(default_factory=list)
    source_rows: int = 0

    # ---------------------------------------------------------------- set-up

    def prepare(self, payload: Any, rows: int) -> None:
        """The micro-batches of one step from a batch of ``rows`` rows (the copied one)."""
        self.source_rows = rows
        self.micro_batches = self._batches(payload, rows)

    def _batches(self, payload: Any, rows: int) -> list[Any]:
        batch = resized(payload, rows, self.rows)
        if self.channels_last:
            batch = channels_last(batch)
        return split(batch, self.rows, self.accumulation)

    @contextlib.contextmanager
    def switches(self) -> Iterator[None]:
        """The side's global switches (TF32) for the block."""
        if self.tf32 is None:
            yield
        else:
            with preserve.tf32(self.tf32):
                yield

    def _autocast(self) -> Any:
        import torch

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.autocast))

    # ---------------------------------------------------------------- one step

    def step(self, batches: list[Any] | None = None, record: bool = False) -> tuple[Any, dict[str, Any] | None]:
        """One optimizer step; (the step's loss, detached; the gradients before the update when ``record``)."""
        total = None
        for batch in batches if batches is not None else self.micro_batches:
            assert self.loss is not None
            with self._autocast():
                loss = self.loss.fn(self.call, batch)
            if self.accumulation > 1:
                loss = loss / self.accumulation
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        grads = None
        if record:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            grads = {name: None if p.grad is None else p.grad.detach().float().clone()
                     for name, p in self.module.named_parameters()}
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, grads

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- a timed run

    def run(self, steps: int, lead: bool = True) -> tuple[float, float]:
        """``steps`` steps, timed: (samples, seconds).

        On CUDA the run is timed whole between synchronizations (a step's kernels run asynchronously,
        and a synchronization per step would take their overlap away). On the CPU every step is timed
        (its work is done when it returns) and the run's seconds are its steps times its median step:
        a step that other processes held off the cores is the machine's, not the change's.
        With ``lead``, one untimed step first: the first step after the other side's pays for bringing
        this side's weights back into the caches (a bias of the run's length, not a speed)."""
        if self.loader is not None:
            return self._run_loader(steps)
        with self.switches():
            if lead:
                self.step()
            self.sync()
            if self.device.type == "cuda":
                started = now()
                for _ in range(steps):
                    self.step()
                self.sync()
                return float(steps * self.rows), now() - started
            times = []
            for _ in range(steps):
                began = now()
                self.step()
                times.append(now() - began)
            times.sort()
            middle = len(times) // 2
            median = times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2
            return float(steps * self.rows), steps * median

    def _run_loader(self, steps: int) -> tuple[float, float]:
        from gpuwidget.measure.tuner import _candidate, _iterating, copies_per_batch

        candidate = _candidate(self.loader, self.loader_change.copy())
        workers = int(candidate.num_workers)
        warmup = max(1, LOADER_WARMUP_PER_WORKER * workers)
        copies = copies_per_batch(self.loader, workers)
        samples = 0
        with self.switches(), _iterating(candidate) as iterator:
            for _ in range(warmup):
                batch = next(iterator, None)
                if batch is None:
                    raise MeasureError("the loader ran out of batches in its warm-up: measure a longer dataset")
                self._train_on(batch)
            self.sync()
            started = now()
            for _ in range(steps):
                batch = next(iterator, None)
                if batch is None:
                    break
                samples += first_dim(batch) if self.loss is None else self.rows
                self._train_on(batch)
            self.sync()
            elapsed = now() - started
        if not samples:
            raise MeasureError("the loader ran out of batches before its timing: measure a longer dataset")
        return samples / copies, elapsed

    def _train_on(self, batch: Any) -> None:
        if self.loss is None:
            return  # no trained model: the loader's batches are what is measured
        payload = to_device(self.loss.from_loader(batch), self.device)
        self.step(self._batches(payload, first_dim(batch)))

    # ---------------------------------------------------------------- memory

    def resident_bytes(self) -> int:
        """Bytes of the side's parameters, buffers and optimizer state."""
        import torch

        seen: set[int] = set()
        total = 0
        tensors = [*self.module.parameters(), *self.module.buffers()] if self.module is not None else []
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total


def loader_side(label: str, loader: Any, change: LoaderChange) -> Side:
    """A side that only draws batches from a loader (no trained model was seen)."""
    import torch

    return Side(label, None, None, None, torch.device("cpu"), rows=0, loader=loader,
                loader_change=loader_part(change))


def model_inputs(payload: Any) -> bool:
    return isinstance(payload, ModelInputs)
