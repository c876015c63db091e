"""The batch-size probe: how large a batch fits, and how large is worth it, measured on the model.

Batches shaped like an observed one (synthetic values of the same dtypes) run forward and
backward at growing sizes: doubling until the device runs out of memory (or ``max_batch``),
then bisecting between the last size that fit and the first that did not. Each size's
throughput (samples/s) is timed after a warm-up. Two answers come out:

* the largest size that fits, less a 5% margin (memory use wobbles between steps);
* the recommendation: the smallest size that no larger size beats by more than 5%
  throughput, with the memory it needs.

Nothing of the user's survives the probe changed: weights, buffers, gradients and the RNG
states are saved before and restored bitwise after, however the probe ends. On a machine
without CUDA the throughput curve is still measured on the CPU (no memory search unless
asked for, and then bounded by the memory available).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpuwidget import heap
from gpuwidget.clock import now
from gpuwidget.measure.host_memory import available_bytes, peak_resident, resident_bytes
from gpuwidget.measure.rng import preserved_rng
from gpuwidget.probes.torch_data import first_dim
from gpuwidget.report import html_table, text_table

# A doubling that gains less than this is not worth its memory.
MIN_GAIN = 0.05
# Keep this share of the largest fitting size, for the step-to-step wobble of memory use.
MEMORY_MARGIN = 0.05
# Sizes are rounded to multiples of this where they fit (Tensor Core friendly shapes).
ALIGN = 8
WARMUP_STEPS = 1
# Each size is timed over at least this many steps and this many seconds (small batches are
# fast, and a few steps of a millisecond are mostly noise).
TIMED_STEPS = 3
MIN_TIMED_S = 0.2
DEFAULT_BUDGET_S = 30.0
# A CPU memory search uses at most this share of the memory available, leaving the rest to the
# machine and to the prediction's error (activations grow with the batch, allocator slack not).
HOST_MEMORY_SHARE = 0.8


@dataclass
class SizeTrial:
    batch_size: int
    samples_per_s: float | None = None  # None: it did not fit
    peak_memory: int | None = None  # bytes on the device (CUDA only)


@dataclass
class BatchProbeResult:
    trials: list[SizeTrial]
    largest_fitting: int | None  # None: no out-of-memory was reached
    recommended: int
    device: str
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def max_safe(self) -> int | None:
        """The largest fitting size less the margin, a multiple of ALIGN where possible."""
        if self.largest_fitting is None:
            return None
        return _align_down(max(1, math.floor(self.largest_fitting * (1 - MEMORY_MARGIN))))

    @property
    def recommended_memory(self) -> int | None:
        return next((t.peak_memory for t in self.trials if t.batch_size == self.recommended), None)

    def _rows(self) -> list[list[str]]:
        rows = []
        for t in sorted(self.trials, key=lambda t: t.batch_size):
            rate = "out of memory" if t.samples_per_s is None else f"{t.samples_per_s:,.0f}"
            memory = "-" if t.peak_memory is None else f"{t.peak_memory / 2**30:.2f} GiB"
            rows.append([str(t.batch_size), rate, memory, "recommended" if t.batch_size == self.recommended else ""])
        return rows

    def _summary(self) -> str:
        fits = (f"the largest batch that fits is {self.largest_fitting} (use at most {self.max_safe})"
                if self.largest_fitting is not None else "no size up to the limit ran out of memory")
        memory = self.recommended_memory
        needs = f", needing {memory / 2**30:.2f} GiB" if memory else ""
        return (f"On {self.device}: batch {self.recommended} is where doubling stops paying "
                f"(> {100 * MIN_GAIN:.0f}% more samples/s){needs}; {fits}.")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        headers = ["batch", "samples/s", "peak memory", ""]
        rows = self._rows()
        text = [self._summary(), *self.notes, "", *text_table(headers, rows)]
        page = (f"<div class='gpuwidget-batch-probe'><div>{html.escape(self._summary())}</div>"
                + "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
                + html_table(headers, rows, [bool(row[-1]) for row in rows]) + "</div>")
        return {"text/plain": "\n".join(text), "text/html": page}


def _align_down(size: int) -> int:
    return size - size % ALIGN if size >= ALIGN else size


# --------------------------------------------------------------------------- synthetic batches


def _synthetic(example: Any, size: int, device: Any) -> Any:
    """A batch of ``size`` shaped like ``example`` (first dimension replaced), same dtypes."""
    import torch

    if isinstance(example, torch.Tensor):
        shape = (size, *example.shape[1:])
        if example.is_floating_point():
            return torch.randn(shape, dtype=example.dtype, device=device)
        if example.dtype == torch.bool:
            return torch.zeros(shape, dtype=torch.bool, device=device)
        if not example.numel():
            return torch.zeros(shape, dtype=example.dtype, device=device)
        # Values drawn from the example's own: token ids stay in the vocabulary, and labels
        # keep their ignore index (-100) without inventing other negative classes.
        values = example.detach().flatten().to(device)
        picks = torch.randint(0, values.numel(), shape, device=device)
        return values[picks]
    if isinstance(example, (list, tuple)):
        return type(example)(_synthetic(item, size, device) for item in example)
    if isinstance(example, dict):
        return {key: _synthetic(value, size, device) for key, value in example.items()}
    return example


# --------------------------------------------------------------------------- keeping state


@contextmanager
def _preserved(model: Any) -> Iterator[None]:
    """Restore weights, buffers, gradients, training mode and RNG states bitwise afterwards."""
    import torch

    state = {name: tensor.detach().clone() for name, tensor in model.state_dict(keep_vars=True).items()}
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
    training = model.training
    with preserved_rng():
        try:
            yield
        finally:
            with torch.no_grad():
                current = model.state_dict(keep_vars=True)
                for name, saved in state.items():
                    current[name].copy_(saved)
            for name, parameter in model.named_parameters():
                parameter.grad = grads.get(name)
            model.train(training)


# --------------------------------------------------------------------------- probing


def _step(model: Any, batch: Any, loss_fn: Callable[..., Any] | None) -> None:
    if loss_fn is None and callable(getattr(model, "training_step", None)):
        # A LightningModule: training_step is its step (it may have no forward at all).
        loss = _as_loss(model.training_step(batch, 0))
    else:
        inputs = batch[0] if isinstance(batch, (list, tuple)) and len(batch) > 1 else batch
        # A dict batch (Hugging Face) goes in as keywords, labels included: the model returns its loss.
        output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        if loss_fn is not None and isinstance(batch, (list, tuple)) and len(batch) > 1:
            loss = loss_fn(output, batch[1])
        else:
            loss = _as_loss(output)
    loss.backward()
    model.zero_grad(set_to_none=True)


def _as_loss(output: Any) -> Any:
    if hasattr(output, "loss") and output.loss is not None:  # Hugging Face model outputs
        return output.loss
    if isinstance(output, dict):
        output = output["loss"] if "loss" in output else next(iter(output.values()))
    if isinstance(output, (list, tuple)):
        output = output[0]
    return output.float().mean()


def probe_batch_size(model: Any, example_batch: Any, loss_fn: Callable[..., Any] | None = None,
                     max_batch: int = 4096, budget_s: float = DEFAULT_BUDGET_S, device: Any = None,
                     start: int | None = None, search_memory: bool | None = None) -> BatchProbeResult:
    """Measure throughput per batch size on ``model`` and find the largest size that fits.

    ``example_batch`` is one batch as the loader yields it (a tensor, or a tuple/list/dict of
    tensors: inputs first, then targets; a dict goes to the model as keywords, so a Hugging
    Face model given ``labels`` returns its own loss); ``loss_fn(output, target)`` is used when
    given, else the model's loss or the mean of its output. A LightningModule runs its
    ``training_step(batch, 0)`` (it may have no ``forward``). The user's model, gradients and RNG are left exactly as
    they were. Sizes grow from ``start`` (default: the example's size) by doubling, then
    bisect on out-of-memory. ``search_memory`` (default: on CUDA) keeps doubling past the
    point where throughput stops improving, to find the largest size that fits; on the CPU,
    where nothing raises out-of-memory, sizes stop where the predicted memory would pass 80 %
    of what the host (or its cgroup) has available. ``budget_s`` must be a positive number.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"probe_batch_size needs a torch.nn.Module, not {type(model).__name__}")
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be a positive integer, not {max_batch!r}")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds, not {budget_s!r}")
    parameter = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (
        parameter.device if parameter is not None else torch.device("cpu"))
    cuda = device.type == "cuda"
    search = cuda if search_memory is None else search_memory
    started = now()
    deadline = started + budget_s
    notes: list[str] = []
    if not cuda:
        notes.append("No CUDA device: the throughput curve was measured on the CPU"
                     + ("." if search else "; memory was not searched."))

    # On the CPU nothing raises out-of-memory (Linux overcommits): sizes are bounded by prediction.
    host = _HostBound(notes) if search and not cuda else None

    def measure(size: int) -> SizeTrial:
        if host is None:
            return _time_size(model, example_batch, loss_fn, size, device)
        return host.measure(size, lambda: _time_size(model, example_batch, loss_fn, size, device))

    with _preserved(model):
        model.train()
        first = _align_down(max(1, min(start or first_dim(example_batch), max_batch)))
        trials, fitted, failed = search_sizes(measure, first, max_batch, search, lambda: now() >= deadline)
        if now() >= deadline:
            notes.append(f"Stopped at the {budget_s:.0f} s budget.")
    if fitted is None:
        raise RuntimeError(f"even a batch of {first} ran out of memory on {device}")
    recommended = _recommend(trials)
    return BatchProbeResult(sorted(trials.values(), key=lambda t: t.batch_size),
                            fitted if failed is not None else None, recommended, str(device), now() - started, notes)


def _time_size(model: Any, example_batch: Any, loss_fn: Callable[..., Any] | None, size: int,
               device: Any) -> SizeTrial:
    """Samples/s of forward and backward at one batch size (and its peak memory on CUDA); a size
    that runs out of memory is a trial without a rate."""
    import torch

    cuda = device.type == "cuda"
    trial = SizeTrial(size)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        batch = _synthetic(example_batch, size, device)
        for _ in range(WARMUP_STEPS):
            _step(model, batch, loss_fn)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = now()
        steps = 0
        while steps < TIMED_STEPS or now() - t0 < MIN_TIMED_S:
            _step(model, batch, loss_fn)
            steps += 1
            if cuda:
                torch.cuda.synchronize(device)
        trial.samples_per_s = steps * size / (now() - t0)
        if cuda:
            trial.peak_memory = int(torch.cuda.max_memory_allocated(device))
    except torch.OutOfMemoryError:
        trial.samples_per_s = None
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    finally:
        batch = None
    return trial


class _HostBound:
    """Runs CPU trials only where the memory they are predicted to need is available.

    A trial's need is its peak resident memory above the process's size when the probe
    began. A larger size is predicted to need the largest smaller size's need scaled by
    the sizes' ratio: activations grow with the batch, and counting the fixed part
    (weights' gradients) as growing too errs on the side of stopping early. A size
    predicted not to fit counts as one that ran out of memory, so the search bisects below it.
    """

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        # Free heap blocks left resident by earlier work would be reused without the resident
        # size growing, hiding what a trial takes: measure from a trimmed heap.
        heap.trim()
        self.baseline = resident_bytes()
        self.room = HOST_MEMORY_SHARE * available_bytes()
        self.needs: dict[int, int] = {}  # size -> bytes above the baseline at its peak
        self.refused = False

    def predicted(self, size: int) -> float:
        below = [s for s in self.needs if s < size]
        if not below or size <= max(self.needs):
            return 0.0  # the first size, or one below a size that ran
        largest = max(below)
        return self.needs[largest] * size / largest

    def measure(self, size: int, run: Callable[[], SizeTrial]) -> SizeTrial:
        need = self.predicted(size)
        # Memory taken since the probe began (trials' cache) is the probe's own, usable again.
        held = max(0, resident_bytes() - self.baseline)
        room = min(self.room, HOST_MEMORY_SHARE * (available_bytes() + held))
        if need > room:
            if not self.refused:
                self.refused = True
                self.notes.append(f"Memory search bounded by the host memory available: a batch of {size} would "
                                  f"need about {need / 2**30:.2f} GiB, {room / 2**30:.2f} GiB can be used.")
            return SizeTrial(size)
        heap.trim()  # the previous trial's freed memory must not hide this one's
        with peak_resident() as resident:
            trial = run()
        self.needs[size] = resident.peak - self.baseline
        return trial


def search_sizes(measure: Callable[[int], SizeTrial], first: int, max_batch: int, search_memory: bool,
                 expired: Callable[[], bool]) -> tuple[dict[int, SizeTrial], int | None, int | None]:
    """The search over ``measure(size) -> SizeTrial``: (trials by size, largest that fit, first that failed).

    Doubling from ``first`` until a size runs out of memory, reaches ``max_batch``, or (unless
    ``search_memory``) doubling stops paying; then bisecting between the last size that fit and
    the first that did not, to within a sixteenth. Stops wherever ``expired()``.
    """
    trials: dict[int, SizeTrial] = {}

    def fits(size: int) -> bool:
        trials[size] = measure(size)
        return trials[size].samples_per_s is not None

    size = first
    fitted: int | None = None
    failed: int | None = None
    while not expired():
        if not fits(size):
            failed = size
            break
        fitted = size
        if size >= max_batch or (_stopped_paying(trials) and not search_memory):
            break
        size = min(2 * size, max_batch)
    while failed is not None and fitted is not None and failed - fitted > max(1, fitted // 16) and not expired():
        middle = (fitted + failed) // 2
        if _align_down(middle) > fitted:
            middle = _align_down(middle)
        if fits(middle):
            fitted = middle
        else:
            failed = middle
    return trials, fitted, failed


def _stopped_paying(trials: dict[int, SizeTrial]) -> bool:
    """Two doublings in a row gained less than MIN_GAIN over the best smaller size (one could be noise)."""
    sizes = sorted(t.batch_size for t in trials.values() if t.samples_per_s)
    if len(sizes) < 3:
        return False
    rate = {s: float(trials[s].samples_per_s or 0.0) for s in sizes}
    best_before = max(rate[s] for s in sizes[:-2])
    return all(rate[s] < (1 + MIN_GAIN) * best_before for s in sizes[-2:])


def _recommend(trials: dict[int, SizeTrial]) -> int:
    """The smallest size that no larger size beats by more than MIN_GAIN.

    Comparing with every larger size, not only the next doubling, keeps one noisy
    measurement from ending the search early.
    """
    sizes = sorted(s for s, t in trials.items() if t.samples_per_s)
    rate = {s: float(trials[s].samples_per_s or 0.0) for s in sizes}
    for i, size in enumerate(sizes):
        if all(rate[larger] < (1 + MIN_GAIN) * rate[size] for larger in sizes[i + 1:]):
            return size
    return sizes[-1]
