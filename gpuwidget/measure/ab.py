"""Run.measure: one change tried in the user's own training step, against the step as it is, A/B interleaved.

What it runs (gpuwidget.measure.sides): two copies of the trained model and its optimizer, one as the
cell trained it (under the autocast most of its forwards ran under, with the process's precision
switches), one with the change; the loss the cell used (gpuwidget.measure.loss); the batch the probes
copied, or for loader settings new loaders over the user's dataset.

In order:

1. numerics: both sides, from the same state (fresh copies) and the same random seed, take
   :data:`NUMERICS_STEPS` optimizer steps on the same batches; the last step's loss and gradients
   are compared (``loss_rel_diff``: |changed - unchanged| / |unchanged|; ``grad_rel_diff``: the norm of
   the gradients' difference over the unchanged gradients' norm). A compiled side compiles in its
   first step: that step's time is the compile time, reported and never timed as throughput;
2. the runs' size: a run is as many steps as last about :data:`RUN_S` at the pace of consecutive
   steps, timed once per side (a compiled side first takes :data:`COMPILED_WARMUP_STEPS` more: CUDA
   graphs record on the first calls); the size then stays, so every block runs the same steps;
3. ABBA blocks (unchanged, changed, changed, unchanged runs) while the next one, as long as the last,
   ends within the budget, or, from
   :data:`DECIDE_BLOCKS` blocks on, once the interval is within ±:data:`TARGET_HALF_WIDTH` and decides
   (gpuwidget.measure.stats); at least :data:`MIN_BLOCKS` blocks are run even when the compilation
   spent the budget (the notes say by how much it ran over), but never past twice the budget. A change
   that does nothing on this device (TF32 off CUDA, the autocast the loop already ran under) runs the
   same code on both sides: it stops at :data:`MIN_BLOCKS`, whose interval is the machine's timing
   noise, and its verdict is "no difference" where the numerics agree (a noisy host would otherwise
   call it faster or slower up to one time in twenty);
4. peak memory, on CUDA: one step each with the peak counter reset.

Ctrl-C (KeyboardInterrupt) ends it where it is: the copies are dropped, the state is put back, and
the Measurement holds the blocks measured so far (its verdict from their interval, with a note).
Nothing of the user's changes: the model and optimizer are copies, and the random generators, the
torch.backends switches and the compile caches it filled are restored (gpuwidget.measure.preserve).
CUDA's peak-memory counter is the one thing reset (it cannot be set back).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from gpuwidget.clock import now
from gpuwidget.facts import LoaderChange
from gpuwidget.measure import stats
from gpuwidget.measure.changes import TrialChange, check_change, describe, loader_part, model_part
from gpuwidget.measure.interrupts import keeping_interrupts, raise_if_interrupted
from gpuwidget.measure.loss import StepLoss, resolve_loss
from gpuwidget.measure.measurement import Measurement
from gpuwidget.measure.preserve import preserved_state
from gpuwidget.measure.sides import MeasureError, Side, copy_training, fused, loader_side, resized, split
from gpuwidget.measure.subjects import Subjects

DEFAULT_BUDGET_S = 30.0
NUMERICS_STEPS = 2
COMPILED_WARMUP_STEPS = 2
# A timed run lasts about this long: short enough for many blocks, each seeing the load its neighbours
# see, long enough for a run of consecutive steps to reach the pace consecutive steps keep (on a loaded
# two-core machine an isolated 0.5 ms step ran 25 times faster than the same step inside a run of 17).
RUN_S = 0.05
# Steps faster than this get an untimed step at the start of each run (gpuwidget.measure.sides.Side.run).
LEAD_BELOW_S = 0.02
# Steps at most in the pace's calibration run.
PACE_STEPS = 64
# A loader-fed run takes at least this many batches after its warm-up.
LOADER_RUN_BATCHES = 8
MIN_BLOCKS = 6  # six blocks give the sign-test interval its 95% (gpuwidget.measure.stats)
DECIDE_BLOCKS = 8  # blocks before an early stop is considered
TARGET_HALF_WIDTH = 0.05
SEED = 0x5EED

# Told as it goes: a line (what it is doing, the latest interval) and the seconds since it began.
Progress = Callable[[str, float], None]


@dataclass
class _Progress:
    """What has been measured so far (kept whole if an interrupt ends the measurement)."""

    ratios: list[float] = field(default_factory=list)
    rates: list[tuple[float, float]] = field(default_factory=list)
    numerics: dict[str, float | None] = field(default_factory=lambda: {"loss_rel_diff": None, "grad_rel_diff": None})
    notes: list[str] = field(default_factory=list)
    compile_s: float | None = None
    peak_memory_ratio: float | None = None
    decided_s: float | None = None
    last_verdict: str | None = None
    device: str = "cpu"
    loss: str = ""
    interrupted: bool = False
    step_s: dict[str, float] = field(default_factory=dict)  # each side's last numerics step, for the run size
    # Every key of the change does nothing on this device (TF32 off CUDA, the loop's own autocast): the
    # sides run the same code, so any difference their timing shows is the machine's noise.
    inert: bool = False


def measure_change(subjects: Subjects, change: Any, budget_s: float = DEFAULT_BUDGET_S,
                   step: Callable[[Any, Any], Any] | None = None, progress: Progress | None = None,
                   bound: float | None = None) -> Measurement:
    """Measure ``change`` (gpuwidget.measure.changes) on ``subjects``; see the module docstring.

    ``ValueError`` for a bad change, budget or ``step`` before anything runs; :class:`MeasureError`
    when the run's objects cannot be measured (gone, no optimizer, not copyable)."""
    checked = check_change(change)
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s > 0
                                          and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds, not {budget_s!r}")
    if step is not None and not callable(step):
        raise ValueError(f"step must be a function step(model, batch) -> loss, not {type(step).__name__}")
    model_change, loader_change = model_part(checked), loader_part(checked)
    loaders = subjects.loaders
    if loader_change and not loaders:
        raise MeasureError("no DataLoader fed this cell (or it is gone): loader settings need the loader")
    trains = subjects.model is not None and subjects.optimizer is not None and subjects.batch is not None
    if model_change and not trains:
        raise MeasureError(_why_not(subjects))
    started = now()
    done = _Progress()
    with warnings.catch_warnings(), preserved_state():
        # The copies' training_step may log (self.log without a Trainer warns) or warn each step: not the user's.
        warnings.simplefilter("ignore")
        try:
            with keeping_interrupts():
                _measure(subjects, checked, model_change, loader_change, trains, loaders, step, budget_s, started,
                         progress, done)
        except KeyboardInterrupt:
            done.interrupted = True
            done.notes.append(f"interrupted after {len(done.ratios)} block(s): the verdict is from those")
        finally:
            gc.collect()  # the copies go now, not at some later collection
            _empty_cache()
    return _result(checked, done, budget_s, now() - started, bound)


def _why_not(subjects: Subjects) -> str:
    if subjects.model is None:
        return "no trained model of this cell is alive (none was seen, or it was deleted): run the cell again"
    if subjects.optimizer is None:
        return "no optimizer stepped the model in this cell: there is no training step to measure"
    if subjects.batch_released:
        return "this run's copied batch was released (only the latest runs keep one): run the cell again"
    return "no training forward was seen after an optimizer step (the cell took one step?): run more steps"


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _measure(subjects: Subjects, change: TrialChange, model_change: TrialChange,
             loader_change: LoaderChange, trains: bool, loaders: list[Any],
             step: Callable[[Any, Any], Any] | None, budget_s: float, started: float, progress: Progress | None,
             done: _Progress) -> None:
    deadline = started + budget_s
    loader = loaders[0] if loader_change else None
    if trains:
        unchanged, changed, numerics_batches = _model_sides(subjects, model_change, step, done)
        done.inert = done.inert and not loader_change
        if loader is not None:
            for side, settings in ((unchanged, LoaderChange()), (changed, loader_change)):
                side.loader, side.loader_change = loader, settings
            done.notes.append("fed by new loaders over the cell's dataset: the unchanged one as it is, the changed "
                              "one with " + describe(loader_change))
        _tell(progress, "numerics: the same steps from the same state", started)
        compares = loader is None and unchanged.loss is not None and unchanged.loss.compares
        _numerics(unchanged, changed, numerics_batches, done, compares)
    else:
        unchanged, changed = loader_side("unchanged", loader, {}), loader_side("changed", loader, loader_change)
        done.notes.append("no trained model was seen: the loader's batches per second are what is measured")
    if loader_change and not model_change:
        done.notes.append("loader settings change no arithmetic: numerics not compared")
    _tell(progress, "warming up", started)
    for side in (unchanged, changed):
        if side.compiled:
            for _ in range(COMPILED_WARMUP_STEPS):
                side.run(1, lead=False)
    step_times = [_pace(side) for side in (unchanged, changed)]
    sizes = [_steps_for(t) if side.loader is None else _loader_run(side)
             for side, t in zip((unchanged, changed), step_times)]
    _blocks(unchanged, changed, sizes, step_times, started, deadline, budget_s, progress, done)
    if trains and unchanged.device.type == "cuda":
        done.peak_memory_ratio = _peak_memory_ratio(unchanged, changed)
    elif trains:
        done.notes.append("peak memory: not compared on the CPU (CUDA's peak counter is what it compares)")


def _pace(side: Side) -> float:
    """Seconds per step when steps follow each other: consecutive steps for about :data:`RUN_S` (at least
    two, at most :data:`PACE_STEPS`); 0 for a loader-fed side (timed by its runs)."""
    if side.loader is not None:
        return 0.0
    steps, elapsed = 0, 0.0
    while steps < 2 or (elapsed < RUN_S and steps < PACE_STEPS):
        elapsed += side.run(1, lead=False)[1]
        steps += 1
    return elapsed / steps


def _loader_run(side: Side) -> int:
    """Batches per loader-fed run: enough for :data:`RUN_S` after its warm-up, at least LOADER_RUN_BATCHES."""
    samples, seconds = side.run(LOADER_RUN_BATCHES)
    batches = samples / max(1, side.rows) if side.loss is not None else LOADER_RUN_BATCHES
    return max(LOADER_RUN_BATCHES, math.ceil(RUN_S * batches / max(seconds, 1e-6)))


def _steps_for(step_s: float) -> int:
    return max(1, math.ceil(RUN_S / max(step_s, 1e-6)))


def _tell(progress: Progress | None, line: str, started: float) -> None:
    if progress is not None:
        progress(line, now() - started)


def _model_sides(subjects: Subjects, change: TrialChange, step: Callable[[Any, Any], Any] | None,
                 done: _Progress) -> tuple[Side, Side, list[tuple[list[Any], int]]]:
    """The two sides, and the micro-batches and accumulation steps the numerics use on each."""
    import torch

    model, optimizer, captured = subjects.model, subjects.optimizer, subjects.batch
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        raise MeasureError(f"the model is wrapped in {type(model).__name__}: measure it in a single process")
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    done.device = str(device)
    a_module, a_optimizer = copy_training(model, optimizer)
    b_module, b_optimizer = copy_training(model, optimizer)
    try:
        loss = resolve_loss(a_module, captured, subjects.losses, step, original=model)
    except ValueError as exc:
        raise MeasureError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the user's model raised on its own batch
        raise MeasureError(f"the model raised on the copied batch: {type(exc).__name__}: {exc}") from None
    done.loss = loss.kind
    if loss.note:
        done.notes.append(loss.note)
    observed = captured.samples or 1
    user_autocast = subjects.autocast_dtype
    new_autocast = change.get("autocast", user_autocast)
    inert = set()
    if "autocast" in change and change["autocast"] == user_autocast:
        done.notes.append(f"the loop already ran under {user_autocast} autocast: the change is the loop as it is")
        inert.add("autocast")
    a = Side("unchanged", a_module, a_optimizer, loss, device, rows=observed, autocast=user_autocast,
             scaler=_scaler(user_autocast, device), call=a_module)
    b = Side("changed", b_module, b_optimizer, loss, device, rows=observed, autocast=new_autocast,
             scaler=_scaler(new_autocast, device), call=b_module, tf32=change.get("tf32"))
    if "tf32" in change and device.type != "cuda":
        done.notes.append("TF32 switches CUDA's matmuls and convolutions: on the CPU it changes nothing")
        inert.add("tf32")
    done.inert = bool(change) and set(change) <= inert
    if change.get("channels_last"):
        if not any(p.ndim == 4 for p in b_module.parameters()):
            done.notes.append("channels_last: the model has no 4-d weights (convolutions): nothing changes")
        b.module = b.call = b_module.to(memory_format=torch.channels_last)
        b.channels_last = True
    if change.get("fused_optimizer"):
        b.optimizer, how = fused(b_optimizer, device.type)
        done.notes.append(how)
    a_numerics_rows, a_numerics_parts = observed, 1
    if "batch_size" in change:
        size = change["batch_size"]
        if size < observed:
            parts = max(1, round(observed / size))
            b.rows, b.accumulation = size * parts, parts
            done.notes.append(f"batch {size}: {parts} micro-batches accumulated per optimizer step "
                              f"(effective batch {size * parts}, observed {observed})")
            comparable = observed % size == 0
        else:
            b.rows = size
            parts = size // observed
            comparable = size % observed == 0
            a_numerics_rows, a_numerics_parts = (size, parts) if comparable else (observed, 1)
            done.notes.append(f"batch {size} (observed {observed}): one optimizer step per batch, so the effective "
                              "batch grows (scale the learning rate with it); the numerics compare it with "
                              f"{parts} accumulated batches of {observed}")
        if not comparable:
            done.notes.append(f"numerics not compared: {size} and the observed {observed} do not divide")
            loss = StepLoss(loss.kind, loss.fn, loss.payload, compares=False, note=loss.note, lightning=loss.lightning)
            a.loss = b.loss = loss
    if "compile" in change:
        mode = None if change["compile"] is True else cast(str, change["compile"])  # False: check_change drops it
        b.compile_mode = change["compile"]
        if hasattr(model, "_orig_mod"):
            done.notes.append("the model is compiled already: the change compiles its copy once more")
        if loss.lightning:
            b.call = _CompiledSteps(b.module, torch.compile(b.module.training_step, mode=mode))
        else:
            b.call = torch.compile(b.module, mode=mode)
        b.compiled = True
    a.prepare(loss.payload, observed)
    b.prepare(loss.payload, observed)
    a_numerics = split(resized(loss.payload, observed, a_numerics_rows), a_numerics_rows, a_numerics_parts)
    return a, b, [(a_numerics, a_numerics_parts), (b.micro_batches, b.accumulation)]


class _CompiledSteps:
    """A LightningModule's copy whose ``training_step`` is compiled (the loss calls ``m.training_step``)."""

    def __init__(self, module: Any, training_step: Any) -> None:
        self._module = module
        self.training_step = training_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _scaler(dtype: str | None, device: Any) -> Any:
    if dtype != "float16":
        return None
    import torch

    return torch.amp.GradScaler(device.type)


def _numerics(a: Side, b: Side, plan: list[tuple[list[Any], int]], done: _Progress, compares: bool) -> None:
    """The same steps from the same state on both sides; also where the changed side compiles."""
    import torch

    results = []
    breaks_before = _graph_breaks() if b.compiled else None
    for side, (side_batches, parts) in zip((a, b), plan):
        accumulation, side.accumulation = side.accumulation, parts
        torch.manual_seed(SEED)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(SEED)
        skipped = 0
        loss, grads = None, None
        try:
            with side.switches():
                for index in range(NUMERICS_STEPS):
                    scale = side.scaler.get_scale() if side.scaler is not None else None
                    began = now()
                    loss, grads = side.step(side_batches, record=index == NUMERICS_STEPS - 1)
                    side.sync()
                    if index == 0 and side.compiled:
                        done.compile_s = now() - began
                    done.step_s[side.label] = now() - began
                    if scale is not None and side.scaler.get_scale() < scale:
                        skipped += 1
        finally:
            side.accumulation = accumulation
        if skipped:
            done.notes.append(f"GradScaler skipped {skipped} of the {NUMERICS_STEPS} compared steps on the "
                              f"{side.label} side (overflow at its starting scale)")
        results.append((float(loss) if loss is not None else math.nan, grads or {}))
    if done.compile_s is not None:
        done.notes.append(f"compiled in {done.compile_s:.1f} s; the first step is not counted")
        breaks = _graph_breaks()
        if breaks is not None:
            done.notes.append(f"graph breaks: {breaks - (breaks_before or 0)}")
    if not compares:
        return
    (loss_a, grads_a), (loss_b, grads_b) = results
    done.numerics["loss_rel_diff"] = abs(loss_b - loss_a) / max(abs(loss_a), 1e-12)
    done.numerics["grad_rel_diff"] = _grad_diff(grads_a, grads_b)


def _graph_breaks() -> int | None:
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    return int(sum(utils.counters.get("graph_break", {}).values()))


def _grad_diff(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    import torch

    difference = reference = 0.0
    for name, grad in a.items():
        other = b.get(name)
        if grad is None or other is None:
            continue
        difference += float(torch.linalg.vector_norm(other - grad)) ** 2
        reference += float(torch.linalg.vector_norm(grad)) ** 2
    if reference == 0.0:
        return None
    return math.sqrt(difference / reference)


def _blocks(a: Side, b: Side, sizes: list[int], step_times: list[float], started: float, deadline: float,
            budget_s: float, progress: Progress | None, done: _Progress) -> None:
    """ABBA blocks until the budget is spent or the interval decides."""
    over_limit = started + 2 * budget_s
    leads = [side.loader is None and step_s < LEAD_BELOW_S for side, step_s in zip((a, b), step_times)]
    block_s = 0.0  # the last block's time: the next one is not started past the deadline it would cross
    while True:
        moment = now()
        if moment + block_s >= deadline and (len(done.ratios) >= MIN_BLOCKS or moment + block_s >= over_limit):
            break
        first_a = a.run(sizes[0], lead=leads[0])
        first_b = b.run(sizes[1], lead=leads[1])
        second_b = b.run(sizes[1], lead=leads[1])
        second_a = a.run(sizes[0], lead=leads[0])
        raise_if_interrupted()  # a Ctrl-C as a side's workers forked (gpuwidget.measure.interrupts)
        done.ratios.append(stats.block_ratio([first_a, second_a], [first_b, second_b]))
        done.rates.append(((first_a[0] + second_a[0]) / (first_a[1] + second_a[1]),
                           (first_b[0] + second_b[0]) / (first_b[1] + second_b[1])))
        block_s = now() - moment
        interval = stats.median_interval(done.ratios)
        verdict = stats.verdict(interval)
        if verdict != done.last_verdict:
            done.last_verdict, done.decided_s = verdict, now() - started
        if interval is not None:
            _tell(progress, f"{len(done.ratios)} blocks: {interval.median:.2f}x [{interval.low:.2f}, "
                            f"{interval.high:.2f}], {verdict}", started)
        if stats.may_stop(done.ratios, DECIDE_BLOCKS, TARGET_HALF_WIDTH) or (done.inert and
                                                                            len(done.ratios) >= MIN_BLOCKS):
            break  # an inert change: six blocks show the machine's noise, and more decide nothing
    spent = now() - started
    if spent > budget_s * 1.05:
        done.notes.append(f"ran {spent - budget_s:.1f} s past the {budget_s:.0f} s budget to measure "
                          f"{len(done.ratios)} blocks" + (" after the compilation" if done.compile_s else ""))


def _peak_memory_ratio(a: Side, b: Side) -> float | None:
    import torch

    peaks = []
    for side in (a, b):
        with side.switches():
            side.sync()
            torch.cuda.reset_peak_memory_stats(side.device)
            base = torch.cuda.memory_allocated(side.device)
            side.step()
            side.sync()
            peaks.append(side.resident_bytes() + torch.cuda.max_memory_allocated(side.device) - base)
    return peaks[1] / peaks[0] if peaks[0] > 0 else None


def _result(change: TrialChange, done: _Progress, budget_s: float, elapsed: float,
            bound: float | None) -> Measurement:
    interval = stats.median_interval(done.ratios)
    rates = None
    if done.rates:
        unchanged = sorted(r[0] for r in done.rates)
        changed = sorted(r[1] for r in done.rates)
        rates = (unchanged[len(unchanged) // 2], changed[len(changed) // 2])
    if interval is not None and interval.coverage < stats.CONFIDENCE:
        done.notes.append(f"only {interval.blocks} block(s): the interval is their range, "
                          f"{100 * interval.coverage:.0f}% coverage, not 95%")
    verdict = stats.verdict(interval)
    if done.inert and done.numerics["loss_rel_diff"] in (None, 0.0):
        if verdict != "no difference":
            done.notes.append(f"the sides ran the same code: their timing's {verdict} interval is this "
                              "machine's noise, not the change's")
        verdict = "no difference"
    return Measurement(
        change=change,
        speedup=interval.median if interval else None,
        ci=(interval.low, interval.high) if interval else None,
        verdict=verdict,
        peak_memory_ratio=done.peak_memory_ratio,
        numerics=done.numerics,
        notes=done.notes,
        blocks=len(done.ratios),
        coverage=interval.coverage if interval else None,
        ratios=list(done.ratios),
        elapsed_s=elapsed,
        decided_s=done.decided_s,
        compile_s=done.compile_s,
        budget_s=budget_s,
        device=done.device,
        loss=done.loss,
        rates=rates,
        interrupted=done.interrupted,
        bound=bound,
    )
