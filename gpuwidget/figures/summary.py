"""Headline figures of a run, computed once from its Trace and workload facts.

Every figure is measured; a figure the run cannot support (no GPU, no DataLoader seen)
is None or absent rather than a guess. Loop figures (samples/s, data wait) refer to the
*training loop*: the primary loader, the one whose batches fed the trained model's optimizer steps
(:func:`primary_loader`), or, where no DataLoader fed them (``get_batch``, a generator), the
optimizer's steps themselves (``step_source``). FLOPs per step, achieved FLOP/s and MFU come from
the optimizer's counted step (:func:`training_figures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from gpuwidget.facts import (
    CudaDeviceFacts,
    LoaderFacts,
    MachineFacts,
    Summary,
    TimeBreakdown,
    TrainingFacts,
    WorkloadFacts,
    uuid_key,
)
from gpuwidget.figures.warmup import WarmupSplit, split_run, warmup_cause
from gpuwidget.peaks import chip, peak_flops
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN, TRAIN_STEP_SPAN
from gpuwidget.trace import Trace, gpu_indices

# A GPU is idle below this busy figure (SM activity where GPM has it, else utilisation); a gap must
# last this long to count. Nsight Systems treats 500 ms without GPU work as starvation; NVML's
# utilisation itself averages over 1/6 s to 1 s, so shorter gaps are not resolvable from NVML anyway.
IDLE_UTIL_PERCENT = 5.0
IDLE_GAP_S = 0.5
# The busy figure, by how it is named in the summary (``gpu_busy_metric``) -> its Trace column. DCGM's
# profiling guidance and dcgm-exporter judge a GPU by SM activity (DCGM_FI_PROF_SM_ACTIVE): NVML's
# utilisation is the share of time *any* kernel ran ("kernel running", nvidia-smi's GPU-Util), so a few
# tiny kernels read as a fully busy GPU while most SMs idle.
BUSY_COLUMNS = {"sm_active": "sm_active", "kernel_running": "util"}
# "Kernel running" this many points above "SM active" is worth a line saying why the two differ.
BUSY_GAP_POINTS = 30.0

# A GPU source says per tick whether the GPU slowed itself down (``slowdown``: thermal, hardware
# slowdown, power brake) and whether it held its power limit (``power_capped``), whatever the vendor
# calls it (gpuwidget.sources.gpu). A busy H100 at its default limit sits at the cap as a matter of
# course; the cap is a slowdown only when the enforced limit is below the default (rule gpu-throttled).
# Clock figures are judged only on samples where the GPU was doing work.
BUSY_UTIL_PERCENT = 50.0
# An energy counter reading lower than the one before by more than this share of it is a reset (the
# driver reloaded); less is float32 rounding in the trace's archive (a relative error of 6e-8).
ENERGY_RESET_TOLERANCE = 1e-6
# Energy over a cell needs readings across at least this share of it; the rest is extrapolated at the
# nearest readings' rate (the sampler's first reading comes a few ms into the cell, later on a loaded host).
ENERGY_MIN_COVERAGE = 0.5
# A DataLoader is the training loop's when its batch came right before at least this share of the
# trained model's optimizer steps. Its own loop feeds every step (with gradient accumulation, the
# last of each step's batches does); a validation loader iterated between epochs, or a 2-batch
# sanity check, feeds none; half leaves room for a loop whose epochs alternate with an evaluation
# on another loader that happens to end right before a step.
FED_SHARE = 0.5
# A loop takes one batch per optimizer step when at least this share of its batches fed one: the rest
# were taken and not trained on (a batch read for its size at each epoch's start is 1 in 32 of a small
# epoch); gradient accumulation over 2 batches or more feeds at most half of them.
ONE_BATCH_PER_STEP = 0.9


def primary_loader(workload: WorkloadFacts | None) -> LoaderFacts | None:
    """The training loop's DataLoader, or None.

    Where the optimizer's steps were counted, it is the loader whose batches fed most of them
    (None when none did: the loop fetches its own batches). Otherwise (no optimizer stepped: an
    inference loop; a run recorded before steps were counted) the loader the cell spent the most
    time iterating. A loader built anew each epoch over the same dataset is one loader already
    (probes.torch_data).
    """
    loaders = (workload or {}).get("loaders") or []
    steps = ((workload or {}).get("training") or {}).get("optimizer_steps") or 0
    if steps and any("steps_fed" in loader for loader in loaders):
        fed = max(loaders, key=lambda loader: (loader.get("steps_fed") or 0, loader.get("loop_time_s") or 0.0))
        return fed if (fed.get("steps_fed") or 0) >= FED_SHARE * steps else None
    return max(loaders, key=lambda loader: loader.get("loop_time_s") or 0.0, default=None)


def loop_steps(loader: LoaderFacts, training: TrainingFacts) -> int:
    """The loop's steps: its loader's batches, or, where nearly every batch fed an optimizer step
    (:data:`ONE_BATCH_PER_STEP`: one batch per step), the optimizer's steps: a batch only looked at
    (``next(iter(loader))`` for its size, as PyTorch's DDP tutorial does each epoch) is no step of the
    loop. (Not the batches that fed a step: accelerate's loader reads one batch ahead, so the last
    batch of each epoch is seen to feed none.) With gradient accumulation the steps stay the batches
    (``optimizer_steps`` counts the updates)."""
    batches, fed = int(loader.get("steps") or 0), int(loader.get("steps_fed") or 0)
    optimizer_steps = int(training.get("optimizer_steps") or 0)
    if optimizer_steps and fed >= ONE_BATCH_PER_STEP * batches:
        return min(batches, optimizer_steps)
    return batches


def optimizer_loop(training: TrainingFacts, workload: WorkloadFacts | None = None) -> Summary:
    """The loop figures from the optimizer's steps, for a loop no DataLoader fed: steps, their rate,
    samples (the trained model's input's first dimension per step), and the steady steps' percentiles
    with the warm-up apart (:func:`step_figures`)."""
    loop = training.get("loop_s") or 0.0
    steps = training.get("optimizer_steps") or 0
    if not steps or loop <= 0:
        return {}
    per_step = training.get("samples_per_step")
    steps_per_s = (training.get("spanned_steps") or steps) / loop
    figures: Summary = {"step_source": training.get("step_source") or "optimizer", "steps": steps,
                        "steps_per_s": steps_per_s,
                        "loop_time_s": loop, "samples": per_step * steps if per_step else None,
                        "samples_per_s": per_step * steps_per_s if per_step else None, "data_wait_fraction": None}
    figures.update(step_figures(training.get("step_times") or [], steps, workload))
    steady_headline(figures, training.get("step_times") or [], None, steps)
    return figures


def steady_headline(summary: Summary, step_times: Sequence[float], wait_times: Sequence[float] | None,
                    steps: int) -> None:
    """The headline rates over the steady steps where a warm-up was split off (``warmup_steps``):
    ``samples_per_s`` and ``steps_per_s`` over the loop's time less the warm-up's, and
    ``data_wait_fraction`` over the steady steps' waits where every step's times are kept. The
    figures with the warm-up stay beside them (``*_with_warmup``): four compiling steps of 0.3 s in
    150 steps of 3 ms would put a loop at a third of its speed. A run that is all warm-up keeps them."""
    warm = int(summary.get("warmup_steps") or 0)
    loop = float(summary.get("loop_time_s") or 0.0)
    steady_s = loop - float(summary.get("warmup_s") or 0.0)
    if not warm or summary.get("all_warmup") or warm >= steps or steady_s <= 0 or loop <= 0:
        return
    share = (steps - warm) / steps  # of the samples and steps: the warm-up's batches are of the same size
    figures = cast(dict[str, Any], summary)
    for key in ("samples_per_s", "steps_per_s"):
        value = figures.get(key)
        if value:
            figures[f"{key}_with_warmup"] = value
            figures[key] = float(value) * loop * share / steady_s
    waits, times = list(wait_times or []), list(step_times)
    overall = summary.get("data_wait_fraction")
    if overall is not None and len(times) == steps and len(waits) >= steps:
        steady_times = sum(times[warm:])
        if steady_times > 0:
            summary["data_wait_fraction_with_warmup"] = overall
            summary["data_wait_fraction"] = sum(waits[warm:steps]) / steady_times


def steady_step_times(training: TrainingFacts) -> list[float]:
    """The optimizer's step times after the warm-up (figures.warmup), or all of them when the run
    never reached a steady state."""
    times = list(training.get("step_times") or [])
    split = split_run(times, training.get("optimizer_steps"))
    return times if split.all_warmup else split.steady(times) or times


def training_figures(workload: WorkloadFacts | None, machine: MachineFacts | None = None) -> Summary:
    """FLOPs per step, achieved FLOP/s and, where a GPU trained, the chip's peak for the dtype the
    counted step's matmuls ran in and MFU; ``mfu_missing`` says why there is no MFU."""
    training = (workload or {}).get("training") or {}
    if not training.get("optimizer_steps"):
        return {}
    figures: Summary = ({"optimizer_steps": training["optimizer_steps"]}
                        if training.get("step_source", "optimizer") == "optimizer" else {})
    flops = training.get("flops_per_step")
    if not flops:
        figures["mfu_missing"] = training.get("flops_missing") or "no step's FLOPs were counted"
        return figures
    dtype = training.get("flops_dtype") or "fp32"
    figures.update({"flops_per_step": flops, "flops_dtype": dtype})
    steady = steady_step_times(training)
    if not steady or sum(steady) <= 0:
        figures["mfu_missing"] = "no step time was measured beside the counted step"
        return figures
    achieved = flops * len(steady) / sum(steady)
    figures["achieved_flops_per_s"] = achieved
    if training.get("device_type") != "cuda":
        figures["mfu_missing"] = f"the model trained on the {training.get('device_type') or 'CPU'}, not a GPU"
        return figures
    name = _trained_gpu_name(workload, machine)
    if name and "MIG" in name.upper().split():
        figures["mfu_missing"] = f"{name} is a MIG slice: the datasheet's peak is the whole chip's"
        return figures
    peak = peak_flops(name, dtype)
    if peak is None:
        known = chip(name)
        figures["mfu_missing"] = (f"the {known.chip}'s datasheet has no dense {dtype} peak" if known is not None
                                  else f"{name or 'this GPU'} is not in gpuwidget's table of chip peaks")
        return figures
    figures["peak_flops_per_s"] = peak
    figures["mfu"] = achieved / peak
    return figures


def _trained_gpu_name(workload: WorkloadFacts | None, machine: MachineFacts | None) -> str | None:
    """The name of the GPU the model trained on: torch's CUDA device that held memory (else its first),
    else NVML's first GPU."""
    devices = ((workload or {}).get("cuda") or {}).get("devices") or []
    for device in sorted(devices, key=lambda device: not device.get("peak_reserved")):
        if device.get("name"):
            return device["name"]
    for gpu in (machine or {}).get("gpus") or []:
        if gpu.get("name"):
            return gpu["name"]
    return None


def loop_step_times(workload: WorkloadFacts | None) -> tuple[list[float], int]:
    """The loop's step times (seconds, the latest of them) and the steps counted: the primary
    DataLoader's; without one, the trained model's optimizer steps (``WorkloadFacts["training"]``)."""
    loader = primary_loader(workload)
    if loader is not None and loader.get("steps"):
        return list(loader.get("step_times") or []), int(loader["steps"])
    training = (workload or {}).get("training") or {}
    times = list(training.get("step_times") or [])
    return times, int(training.get("optimizer_steps") or len(times))


def loop_warmup(workload: WorkloadFacts | None) -> WarmupSplit:
    """The warm-up of the loop whose step times the summary uses (:func:`loop_step_times`)."""
    return split_run(*loop_step_times(workload))


def covered(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def process_steps(trace: Trace, pid: int | None,
                  kind: str = STEP_SPAN) -> tuple[list[tuple[float, float]], float, bool]:
    """One process's kept step spans of ``kind`` (``pid`` None: the watch's own, which carry no pid): the
    closed ones, the seconds of all of them (an open one too: a loop left early, an iterator left
    unfinished), and whether the trace still holds every step span it was given."""
    every = trace.spans(kind)
    stats = trace.span_stats(kind)
    complete = stats is None or stats.count == len(every)
    spans = [span for span in every if span.attrs.get("pid") == pid]
    closed = [(span.start, span.end) for span in spans if not span.attrs.get("open")]
    return closed, sum(span.duration for span in spans), complete


def time_breakdown(duration: float, trace: Trace, pid: int | None, loop_s: float, wait_s: float,
                   kind: str = STEP_SPAN) -> TimeBreakdown:
    """Where one process's time went, in parts that sum to ``duration``.

    The steps are the DataLoader's (``step`` spans) or, for a loop no DataLoader fed (``step_source``
    "optimizer"), the optimizer's (``kind`` ``train.step``; ``loop_s`` their total, ``wait_s`` 0: no
    data wait is measured there).

    ``loop_s`` and ``wait_s`` are the process's loaders' exact totals (every loader summed). The
    loop's seconds are the time its steps cover, each second once: a loader iterated inside
    another's step (validation inside a training epoch) or an iterator left open (a framework's
    sanity check) does not count that time twice, and a step left open at the end counts as
    "other". Steps the trace no longer holds (a long run) count as their totals say. Waits lie
    inside the steps. Where the trace holds every step: ``before_loop_s``, the time before the
    first (process start-up, imports, set-up), and ``after_loop_s``, after the last (saving,
    tear-down, a process group's end); "other" is then the gaps between steps (evaluation outside
    a DataLoader, between epochs).
    """
    closed, kept_s, complete = process_steps(trace, pid, kind)
    loop = min(duration, covered(closed, 0.0, duration) + max(0.0, loop_s - kept_s))
    wait = min(loop, max(0.0, wait_s))
    parts: TimeBreakdown = {"data_wait_s": wait, "compute_s": loop - wait, "other_s": duration - loop}
    if complete and closed:
        rest = duration - loop
        before = min(rest, max(0.0, min(start for start, _ in closed)))
        after = min(rest - before, max(0.0, duration - max(end for _, end in closed)))
        parts.update({"before_loop_s": before, "after_loop_s": after, "other_s": rest - before - after})
    return parts


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> list[float | None]:
    if not len(values):
        return [None for _ in qs]
    return [float(v) for v in np.percentile(np.asarray(values, dtype=float), qs)]


def paired(step_times: Sequence[float], wait_times: Sequence[float]) -> tuple[list[float], list[float]]:
    """Steps and each one's data wait, the latest of both lists paired. A loop's waits can run one
    ahead of its steps (the batch of a step not yet closed): that extra wait is dropped, then both
    keep as many of their latest items as the shorter has (no waits at all: zeros)."""
    steps, waits = list(step_times), list(wait_times)
    if len(waits) == len(steps) + 1:
        waits.pop()
    if not waits:
        return steps, [0.0] * len(steps)
    count = min(len(steps), len(waits))
    return steps[len(steps) - count:], waits[len(waits) - count:]


def step_figures(step_times: Sequence[float], steps: int | None = None, workload: WorkloadFacts | None = None,
                 loader: LoaderFacts | None = None) -> Summary:
    """The step-time percentiles over the steady steps, and the warm-up before them
    (``warmup_steps``, ``warmup_s``, ``warmup_cause``; ``all_warmup`` when no steady state was
    reached, and then the percentiles are of every step): gpuwidget.figures.warmup. ``steps``
    is how many steps the loop took, when the times may be only the latest of them."""
    split = split_run(step_times, steps)
    p50, p95, p99 = percentiles(step_times if split.all_warmup else split.steady(step_times))
    figures: Summary = {"step_time_p50": p50, "step_time_p95": p95, "step_time_p99": p99,
                        "warmup_steps": split.steps, "warmup_s": split.seconds}
    if split.all_warmup:
        figures["all_warmup"] = True
    cause = warmup_cause(split, workload, loader)
    if cause:
        figures["warmup_cause"] = cause
    return figures


def _stat(trace: Trace, column: str, field: str = "mean") -> float | None:
    stats = trace.stats(column)
    return None if stats is None else float(getattr(stats, field))


def idle_gaps(trace: Trace, index: int, metric: str = "util") -> list[tuple[float, float]]:
    """Intervals where GPU ``index``'s ``metric`` column stayed under IDLE_UTIL_PERCENT for at least IDLE_GAP_S."""
    frame = trace.window(columns=[f"gpu{index}.{metric}"])
    util = frame.max[f"gpu{index}.{metric}"]  # the envelope: a bucket is idle only if all of it was
    gaps: list[tuple[float, float]] = []
    start: float | None = None
    for t, value in zip(frame.t.tolist(), util.tolist()):
        idle = value == value and value < IDLE_UTIL_PERCENT  # NaN (no reading) ends a gap
        if idle and start is None:
            start = t
        elif not idle and start is not None:
            if t - start >= IDLE_GAP_S:
                gaps.append((start, t))
            start = None
    if start is not None and len(frame.t) and frame.t[-1] - start >= IDLE_GAP_S:
        gaps.append((start, float(frame.t[-1])))
    return gaps


def summarize(trace: Trace, workload: WorkloadFacts | None = None,
              duration_s: float | None = None, machine: MachineFacts | None = None,
              price: float | None = None) -> Summary:
    """The run's summary dict (keys documented in DESIGN.md's public contract and facts.Summary).

    ``machine`` (the NVML source's device list) lets torch's devices be matched to NVML's by UUID.
    The watched cell is the trace's time 0 to ``duration_s`` (the watch starts the trace's clock as
    the cell starts); energy is charged over it. ``price`` (per GPU-hour) gives its cost.
    """
    duration = trace.duration if duration_s is None else duration_s
    summary: Summary = {"duration_s": duration}

    loader = primary_loader(workload)
    loop_time = (loader or {}).get("loop_time_s") or 0.0
    training = (workload or {}).get("training") or {}
    trained_in = (workload or {}).get("trained_in")
    pid = trained_in.get("pid") if trained_in else None  # the process that trained (None: the watch's own)
    if loader is not None and loop_time > 0:
        summary["step_source"] = "dataloader"
        summary["loader"] = loader.get("name")
        summary["steps"] = batches = loop_steps(loader, training)
        summary["samples"] = loader["samples"] or None
        summary["samples_per_s"] = loader["samples"] / loop_time if loader["samples"] else None
        summary["steps_per_s"] = batches / loop_time
        summary["loop_time_s"] = loop_time
        summary["data_wait_fraction"] = loader["wait_total_s"] / loop_time
        summary.update(step_figures(loader.get("step_times") or [], loader["steps"], workload, loader))
        steady_headline(summary, loader.get("step_times") or [], loader.get("wait_times"), loader["steps"])
        # Where the cell's time went (in the process that trained): blocked on data, the loop's
        # own work, before its first step, and the rest (evaluation outside a DataLoader, the end).
        loaders = (workload or {}).get("loaders") or []
        summary["time_breakdown"] = time_breakdown(
            duration, trace, pid, loop_s=sum(item.get("loop_time_s") or 0.0 for item in loaders),
            wait_s=sum(item.get("wait_total_s") or 0.0 for item in loaders))
    elif steps := optimizer_loop(training, workload):  # no DataLoader fed the loop: the optimizer's steps
        summary.update(steps)
        summary["time_breakdown"] = time_breakdown(duration, trace, pid, loop_s=steps.get("loop_time_s") or 0.0,
                                                   wait_s=0.0, kind=TRAIN_STEP_SPAN)
    else:
        summary.update({"steps": None, "samples": None, "samples_per_s": None, "data_wait_fraction": None})
    summary.update(training_figures(workload, machine))

    summary.update(host_figures(trace))

    summary.update(gpu_figures(trace, workload, machine, cell=(0.0, duration) if duration_s is not None else None))
    summary.update(cost_figures(summary, price))
    energy = summary.get("energy_j")
    if energy is not None:
        if summary.get("samples"):
            summary["energy_per_sample_j"] = energy / summary["samples"]  # type: ignore[operator]
        if summary.get("steps"):
            summary["energy_per_step_j"] = energy / summary["steps"]  # type: ignore[operator]
    return summary


def gpu_figures(trace: Trace, workload: WorkloadFacts | None = None,
                machine: MachineFacts | None = None, cell: tuple[float, float] | None = None) -> Summary:
    """The GPU figures, judged on the GPUs this workload used; the others are listed apart.

    A node's seven idle GPUs must not dilute the one that trained: ``gpu_busy_mean``, idle gaps,
    memory, throttling and SM activity come from the GPUs the workload used (its processes held
    memory there per NVML, or torch allocated there). Without any sign of use (the work ran on the
    CPU, or nothing says where) every GPU is judged, and ``gpu_busy_basis`` says which it was.

    The busy figure is SM activity (GPM) where every judged GPU has it, else NVML's utilisation
    ("kernel running"); ``gpu_busy_metric`` says which, ``gpu_kernel_running_mean`` keeps the latter
    beside it, and ``gpu_busy_missing`` says why neither exists (a MIG instance without GPM).
    ``cell`` (trace times) is the span energy is charged over.
    """
    indices = gpu_indices(trace)
    torch_devices = torch_devices_by_gpu(workload, machine)
    used = gpus_used(trace, indices, torch_devices)
    judged = used or indices
    figures: Summary = {}
    kernel = _means(trace, indices, "util")
    sm = _means(trace, indices, "sm_active")
    read = [index for index in judged if index in kernel or index in sm]
    metric = "sm_active" if read and all(index in sm for index in read) else "kernel_running"
    chosen, other = (sm, kernel) if metric == "sm_active" else (kernel, sm)
    busy = {index: chosen[index] if index in chosen else other[index] for index in indices
            if index in chosen or index in other}
    # Which column says a GPU worked, for clocks and links: utilisation where it exists (any kernel).
    work = {index: "util" if index in kernel else "sm_active" for index in busy}
    judged_busy = [busy[index] for index in judged if index in busy]
    if judged_busy:
        column = {index: BUSY_COLUMNS[metric] if index in chosen else work[index] for index in busy}
        gaps = [gap for index in judged if index in busy for gap in idle_gaps(trace, index, column[index])]
        figures["gpu_busy_mean"] = sum(judged_busy) / len(judged_busy)
        figures["gpu_busy_metric"] = metric
        figures["gpu_busy_by_gpu"] = {str(index): value for index, value in busy.items()}
        figures["gpu_busy_basis"] = "used" if used else "visible"
        figures["gpu_idle_gaps"] = len(gaps)
        figures["gpu_longest_idle_s"] = max([0.0] + [end - start for start, end in gaps])
    elif judged:
        figures["gpu_busy_missing"] = busy_missing(judged, machine)
    judged_kernel = [kernel[index] for index in judged if index in kernel]
    if judged_kernel:
        figures["gpu_kernel_running_mean"] = sum(judged_kernel) / len(judged_kernel)
        figures["gpu_kernel_running_by_gpu"] = {str(index): value for index, value in kernel.items()}
    if indices:
        figures["gpus_used"] = used
        unused = [index for index in indices if used and index not in used]
        # Someone else's work is any kernel running there: utilisation where the GPU has it.
        ran = {**sm, **kernel}
        figures["gpus_unused_idle"] = [i for i in unused if ran.get(i, 0.0) < IDLE_UTIL_PERCENT]
        figures["gpus_unused_busy"] = [i for i in unused if ran.get(i, 0.0) >= IDLE_UTIL_PERCENT]
    figures.update(_activity(trace, judged))
    figures.update(_memory(trace, judged, torch_devices))
    figures.update(_clocks(trace, [index for index in judged if index in busy], work))
    figures.update(_own_memory(trace, indices, torch_devices, machine))
    figures.update(_pcie_links(trace, judged, work))
    figures.update(_energy(trace, judged, cell))
    if judged:
        figures["gpus_judged"] = len(judged)
    return figures


def _means(trace: Trace, indices: Sequence[int], metric: str) -> dict[int, float]:
    """Each GPU's whole-run mean of ``gpu{i}.{metric}``, where it has readings."""
    return {index: value for index in indices if (value := _stat(trace, f"gpu{index}.{metric}")) is not None}


def busy_missing(judged: Sequence[int], machine: MachineFacts | None) -> str:
    """Why the judged GPUs have no busy figure, in words (a MIG instance without GPM, most often)."""
    devices = {int(gpu["index"]): gpu for gpu in (machine or {}).get("gpus") or [] if gpu.get("index") is not None}
    reasons = []
    for index in judged:
        device = devices.get(index) or {}
        name = f"GPU {index}" + (f" ({device['name']})" if device.get("name") else "")
        if device.get("is_mig") and not device.get("gpm"):
            reasons.append(f"{name} is a MIG instance: NVML reports no utilisation (kernel running) for MIG "
                           "instances, and SM activity needs GPM, which this GPU lacks (Hopper and newer have it)")
        elif device.get("gpm"):
            reasons.append(f"{name} gave no SM activity: GPM needs two samples at least 100 ms apart, and "
                           "the driver reported no utilisation either")
        else:
            reasons.append(f"{name}: the driver reported neither utilisation (kernel running) nor SM activity")
    return "; ".join(reasons) + "."


def busy_gap_note(summary: Summary) -> str | None:
    """One line on why "kernel running" reads far above "SM active", where it does (None otherwise)."""
    if summary.get("gpu_busy_metric") != "sm_active":
        return None
    sm_active, running = summary.get("gpu_busy_mean"), summary.get("gpu_kernel_running_mean")
    if sm_active is None or running is None or running - sm_active < BUSY_GAP_POINTS:
        return None
    return (f"A kernel was running {running:.0f}% of the time but only {sm_active:.0f}% of the SMs were active: "
            "a few small kernels keep the GPU \"busy\" for nvidia-smi while most of its SMs idle.")


def cost_figures(summary: Summary, price: float | None) -> Summary:
    """What the judged GPUs cost over the cell at ``price`` per GPU-hour, and the idle share of it.

    Idle is by the busy figure (SM activity where GPM has it): a GPU whose SMs are 30% active
    spends 70% of what it costs idle. Without a busy figure the idle cost is left out, not guessed.
    """
    gpus = summary.get("gpus_judged")
    duration = summary.get("duration_s")
    if price is None or not gpus or duration is None:
        return {}
    cost = gpus * duration / 3600.0 * price
    figures: Summary = {"gpu_hour_price": price, "cost": cost}
    busy = summary.get("gpu_busy_mean")
    if busy is not None:
        figures["idle_cost"] = cost * (1.0 - min(100.0, max(0.0, busy)) / 100.0)
    return figures


def torch_devices_by_gpu(workload: WorkloadFacts | None, machine: MachineFacts | None) -> dict[int, CudaDeviceFacts]:
    """torch's CUDA devices keyed by the trace's GPU number: by UUID where both sides know it (NVML's
    numbering is a guess on mixed-model hosts), else by CUDA index (the numbering both follow)."""
    by_uuid = {uuid_key(gpu["uuid"]): gpu["index"] for gpu in (machine or {}).get("gpus") or []
               if gpu.get("uuid") and gpu.get("index") is not None}
    devices: dict[int, CudaDeviceFacts] = {}
    for device in ((workload or {}).get("cuda") or {}).get("devices") or []:
        uuid = device.get("uuid")
        index = by_uuid.get(uuid_key(str(uuid))) if uuid else None
        devices[device["index"] if index is None else int(index)] = device
    return devices


def gpus_used(trace: Trace, indices: Sequence[int], torch_devices: dict[int, CudaDeviceFacts]) -> list[int]:
    """GPUs this workload used: its processes held memory there (NVML) or torch reserved memory there."""
    used = {index for index in indices if (_stat(trace, f"gpu{index}.proc_mem", "max") or 0.0) > 0}
    used |= {index for index, device in torch_devices.items() if (device.get("peak_reserved") or 0) > 0}
    return sorted(used)


def _activity(trace: Trace, judged: Sequence[int]) -> Summary:
    """GPM's SM and tensor-pipe activity (Hopper and newer), mean over the judged GPUs that have it."""
    figures: Summary = {}
    for metric, key in (("sm_active", "gpu_sm_active_mean"), ("tensor_active", "gpu_tensor_active_mean"),
                        ("nvlink_tx", "gpu_nvlink_tx_mean"), ("nvlink_rx", "gpu_nvlink_rx_mean")):
        values = [value for index in judged if (value := _stat(trace, f"gpu{index}.{metric}")) is not None]
        if values:
            figures[key] = sum(values) / len(values)  # type: ignore[literal-required]
    return figures


def _memory(trace: Trace, judged: Sequence[int], torch_devices: dict[int, CudaDeviceFacts]) -> Summary:
    fraction: dict[int, float] = {}
    for index in judged:
        used = _stat(trace, f"gpu{index}.mem_used", "max")
        total = _stat(trace, f"gpu{index}.mem_total", "max")
        if used is not None and total:
            fraction[index] = used / total
    for index, device in torch_devices.items():
        # The allocator's own peak is exact where NVML polling could miss a short spike.
        if device.get("total_memory") and (index in judged or not judged):
            peak = device["peak_reserved"] / device["total_memory"]
            fraction[index] = max(fraction.get(index, 0.0), peak)
    if not fraction:
        return {}
    return {"peak_gpu_mem_fraction": max(fraction.values()),
            "peak_gpu_mem_fraction_by_gpu": {str(index): value for index, value in fraction.items()}}


def _clocks(trace: Trace, judged: Sequence[int], work: dict[int, str]) -> Summary:
    """Slowdown and power-cap shares of busy samples and the clock ratio (worst GPU), and the
    enforced power limit over the board's default (lowest). ``work``: each GPU's column saying it worked."""
    figures: Summary = {}
    by_gpu = {index: t for index, t in ((index, _throttling(trace, index, work.get(index, "util")))
                                        for index in judged) if t is not None}
    throttle = list(by_gpu.values())
    if throttle:
        figures["gpu_throttle_fraction_by_gpu"] = {str(index): t[0] for index, t in by_gpu.items()}
        figures["gpu_throttle_fraction"] = max(slowdown for slowdown, _, _ in throttle)
        figures["gpu_power_capped_fraction"] = max(capped for _, capped, _ in throttle)
        ratios = [ratio for _, _, ratio in throttle if ratio is not None]
        if ratios:
            figures["gpu_clock_ratio_busy"] = min(ratios)
    limits = []
    for index in judged:
        enforced = _stat(trace, f"gpu{index}.power_limit", "min")
        default = _stat(trace, f"gpu{index}.power_limit_default", "max")
        if enforced is not None and default:
            limits.append(enforced / default)
    if limits:
        figures["gpu_power_limit_ratio"] = min(limits)
    return figures


def _own_memory(trace: Trace, indices: Sequence[int], torch_devices: dict[int, CudaDeviceFacts],
                machine: MachineFacts | None) -> Summary:
    """Peak GPU memory of this process (one GPU), from NVML, or from torch where NVML can't know it.

    NVML has no PID-namespace support: in a container it lists this process under its host pid, so
    its memory reads 0 or is left out. Then torch's own memory_reserved stands in, and the summary
    says the namespace is foreign.
    """
    listed = [value for index in indices if (value := _stat(trace, f"gpu{index}.proc_mem", "max")) is not None]
    nvml_peak = max(listed) if listed else None
    reserved = [device.get("peak_reserved") or 0 for device in torch_devices.values()]
    torch_peak = float(max(reserved)) if reserved else None
    foreign = any(gpu.get("foreign_pid_namespace") for gpu in (machine or {}).get("gpus") or [])
    foreign = foreign or bool(torch_peak and nvml_peak == 0)
    figures: Summary = {}
    if foreign:
        figures["gpu_pid_namespace_foreign"] = True
    if torch_peak is not None and (foreign or nvml_peak is None):
        figures["process_gpu_mem_peak"] = torch_peak
        figures["process_gpu_mem_source"] = "torch"
    elif nvml_peak is not None:
        figures["process_gpu_mem_peak"] = nvml_peak
        figures["process_gpu_mem_source"] = "driver"
    return figures


def _energy(trace: Trace, judged: Sequence[int], cell: tuple[float, float] | None = None) -> Summary:
    """Joules the judged GPUs used over the cell (NVML's energy counter), if every one of them reports it."""
    used = [energy_used(trace, f"gpu{index}.energy_j", cell) for index in judged]
    if not used or any(joules is None for joules in used):
        return {}  # absent, not 0: a GPU that can't say (NotSupported, before Volta) would understate it
    return {"energy_j": sum(joules for joules in used if joules is not None)}


def energy_used(trace: Trace, column: str, cell: tuple[float, float] | None = None) -> float | None:
    """What a cumulative energy counter rose by over ``cell`` (trace times; default: from its first reading
    to its last), or None (under two readings, or readings covering under ENERGY_MIN_COVERAGE of the cell).

    The sampler reads the counter from its own start to its stop, which on a loaded host can begin
    late and end long after the cell did (its last reading waits for the watch to wind down): the
    counter is interpolated at the cell's start and end between the readings either side, and
    extrapolated at the rate of the nearest two where the readings stop short of an edge.

    The counter counts from the driver's start; a reading below the one before means the driver
    reloaded (the count began again), and the new reading is what was used since. Archive buckets
    keep each bucket's lowest and highest reading, so resets are seen however long the run; without
    one the rise is exact where the cell's edges fall on raw rows (archive buckets hold float32).
    """
    stats = trace.stats(column)
    if stats is None or stats.count < 2:
        return None
    frame = trace.window(columns=[column])
    low, high = frame.min[column], frame.max[column]
    read = ~np.isnan(low)
    t, low, high = frame.t[read].astype(float), low[read].astype(float), high[read].astype(float)
    steps = low[1:] - high[:-1]
    # Beyond float32's rounding (archive buckets) a step down is a reset, not noise.
    reset = steps < -(np.abs(high[:-1]) * ENERGY_RESET_TOLERANCE)
    steps = np.where(reset, low[1:], np.maximum(steps, 0.0))  # a reset: the new count is what was used since
    # The exact rise from the first reading to the last: float32 archive buckets would round it.
    total = stats.last - stats.min if not np.any(reset) else float(np.sum(high - low) + np.sum(steps))
    if cell is None:
        return total
    start, end = cell
    covered = min(end, t[-1]) - max(start, t[0])
    if end <= start or covered < ENERGY_MIN_COVERAGE * (end - start):
        return None  # the readings miss most of the cell (a GPU lost early): no figure rather than a guess
    # Energy used since the first reading, at each row's first (low) reading (the newest rows are raw).
    since = np.concatenate([[0.0], np.cumsum((high - low)[:-1] + steps)])
    # The edges move the exact total by what the counter did between them and the first or last reading.
    before = _counter_at(t, since, start)
    after = _counter_at(t, since, end) - since[-1]
    return max(0.0, total - before + after)


def _counter_at(t: np.ndarray, since: np.ndarray, at: float) -> float:
    """The cumulative energy at time ``at``: interpolated between readings, extrapolated at the edge rate."""
    if t[0] <= at <= t[-1] or len(t) < 2:
        return float(np.interp(at, t, since))
    i, j = (0, 1) if at < t[0] else (-2, -1)
    span = t[j] - t[i]
    rate = (since[j] - since[i]) / span if span > 0 else 0.0
    edge = i if at < t[0] else j
    return float(since[edge] + rate * (at - t[edge]))


def _pcie_links(trace: Trace, judged: Sequence[int], work: dict[int, str]) -> Summary:
    """Each judged GPU's PCIe link at its best during the run against what it allows; an idle GPU
    trains its link down to save power, so only a GPU that was busy at some point is judged."""
    links: dict[str, dict[str, int]] = {}
    names = ("pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max")
    for index in judged:
        figures = {name: _stat(trace, f"gpu{index}.{name}", "max") for name in names}
        if any(figures[name] is None for name in names):
            continue
        if (_stat(trace, f"gpu{index}.{work.get(index, 'util')}", "max") or 0.0) < BUSY_UTIL_PERCENT:
            continue
        links[str(index)] = {name: int(value or 0) for name, value in figures.items()}
    if not links:
        return {}
    degraded = [int(index) for index, link in links.items()
                if link["pcie_gen"] < link["pcie_gen_max"] or link["pcie_width"] < link["pcie_width_max"]]
    return {"gpu_pcie_link_by_gpu": links, "gpus_pcie_degraded": degraded}


def gpu_scope_note(summary: Summary) -> str | None:
    """One line on the GPUs the figures leave out: "GPUs 1-7 were idle and unused by this kernel"."""
    parts = []
    for indices, what in ((summary.get("gpus_unused_idle") or [], "idle and unused by this kernel"),
                          (summary.get("gpus_unused_busy") or [], "busy with other work, not this kernel's")):
        if indices:
            parts.append(f"{_gpu_list(indices)} {'was' if len(indices) == 1 else 'were'} {what}")
    return "; ".join(parts) + "." if parts else None


def gpu_scope_notes(summary: Summary) -> list[str]:
    """What a reader must know to read the GPU figures: why "kernel running" and "SM active" differ, why
    neither was measured, GPUs left out, a foreign PID namespace, a slow link."""
    notes = [note] if (note := busy_gap_note(summary)) else []
    if summary.get("gpu_busy_missing"):
        notes.append(f"Not measured how busy the GPU was: {summary['gpu_busy_missing']}")
    if note := gpu_scope_note(summary):
        notes.append(note)
    if summary.get("gpu_pid_namespace_foreign"):
        notes.append("This process runs in its own PID namespace (a container): the driver reports host pids, "
                     "so its GPU memory is torch's memory_reserved.")
    links = summary.get("gpu_pcie_link_by_gpu") or {}
    for index in summary.get("gpus_pcie_degraded") or []:
        link = links.get(str(index)) or {}
        notes.append(f"GPU {index}'s PCIe link ran at Gen{link.get('pcie_gen')} x{link.get('pcie_width')} of "
                     f"Gen{link.get('pcie_gen_max')} x{link.get('pcie_width_max')}: host-device copies are slower.")
    return notes


def _gpu_list(indices: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> "GPUs 1-3, 5"; [4] -> "GPU 4"."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"GPU{'s' if len(indices) > 1 else ''} {text}"


# Host columns (gpuwidget.sources.host) -> summary keys, each the mean over the run. The CPU
# figures are always present (None without readings); the kernel counters only where the
# platform has them (schedstat, PSI), so a missing counter is an absent key, never 0.
HOST_MEANS = {"cpu.util": "cpu_util_mean", "proc.cpu": "process_cpu_mean", "proc.workers_cpu": "workers_cpu_mean"}
HOST_MEANS_WHERE_MEASURED = {
    "proc.run_delay": "process_run_delay_mean",
    "proc.workers_run_delay": "workers_run_delay_mean",
    "cpu.others": "other_cpu_mean",
    "psi.cpu_some": "psi_cpu_some_mean",
    "psi.io_some": "psi_io_some_mean",
    "psi.cgroup_cpu_some": "psi_cgroup_cpu_some_mean",
}


# Starting and stopping DataLoader workers is not how they build batches: a fork is quick,
# but a spawned worker (macOS, Windows, multiprocessing_context="spawn") imports torch
# afresh and tears it down at the end, seconds of CPU that made a storage-bound loader look
# CPU-bound. The workers' figures count from the first batch to the last.
STEADY_COLUMNS = frozenset({"proc.workers_cpu", "proc.workers_run_delay"})


def host_figures(trace: Trace) -> Summary:
    """The host and process-tree figures of the summary: CPU use, run delay, pressure (units in facts.Summary)."""
    figures: Summary = {}
    steady = _batches(trace)
    for column, key in (*HOST_MEANS.items(), *HOST_MEANS_WHERE_MEASURED.items()):
        value = _steady_mean(trace, column, steady) if column in STEADY_COLUMNS else None
        if value is None:
            value = _stat(trace, column)
        if value is not None or column in HOST_MEANS:
            figures[key] = value  # type: ignore[literal-required]
    return figures


def _batches(trace: Trace) -> tuple[float, float] | None:
    """When the cell's first and last batches arrived, if the trace still holds the first."""
    stats = trace.span_stats(DATA_WAIT_SPAN)
    spans = trace.spans(DATA_WAIT_SPAN)
    if stats is None or len(spans) < 2 or stats.count != len(spans):
        return None  # too few, or the oldest were dropped (a long run: start-up weighs little)
    return spans[0].end, spans[-1].end


def _steady_mean(trace: Trace, column: str, between: tuple[float, float] | None) -> float | None:
    """The mean of ``column`` between two times, or None when nothing was read then."""
    if between is None:
        return None
    values = trace.window(t0=between[0], t1=between[1], columns=[column]).mean[column]
    values = values[~np.isnan(values)]
    return float(values.mean()) if len(values) else None


def _throttling(trace: Trace, index: int, work: str = "util") -> tuple[float, float, float | None] | None:
    """(share of busy samples that slowed down, share at the power cap, mean SM clock over its maximum
    on busy samples), or None when the GPU was never busy.

    Read from the samples still held at full resolution: a 0/1 flag's bucket mean is no sample's.
    A tick without the flags (the source leaves them out while the GPU idles on purpose) is not
    judged. Busy is by ``work``: utilisation (a kernel ran: clocks then matter), SM activity where
    there is none (MIG).
    """
    columns = [f"gpu{index}.{work}", f"gpu{index}.slowdown", f"gpu{index}.power_capped", f"gpu{index}.sm_clock",
               f"gpu{index}.sm_clock_max"]
    frame = trace.recent_since(-np.inf, columns)
    util, slowed, capped = (frame.mean[column] for column in columns[:3])
    known = ~np.isnan(slowed)
    with np.errstate(invalid="ignore"):
        busy = util >= BUSY_UTIL_PERCENT
    if not busy.any():
        return None
    judged = busy & known
    slowdown = float(np.mean(slowed[judged] > 0)) if judged.any() else 0.0
    at_cap = float(np.mean(np.nan_to_num(capped[judged]) > 0)) if judged.any() else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = frame.mean[columns[3]][busy] / frame.mean[columns[4]][busy]
    ratio = ratio[~np.isnan(ratio)]
    return slowdown, at_cap, (float(np.mean(ratio)) if len(ratio) else None)
