"""Headline figures of a run, computed once from its Trace and workload facts.

Every figure is measured; a figure the run cannot support (no GPU, no DataLoader seen)
is None or absent rather than a guess. Loop figures (samples/s, data wait) refer to the
*primary* loader, the one the cell spent the most time iterating.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from gpuwidget.facts import LoaderFacts, Summary, WorkloadFacts
from gpuwidget.trace import Trace

# Span kinds the workload probes record (gpuwidget.probes.torch_data).
STEP_SPAN = "step"
DATA_WAIT_SPAN = "loader.wait"

# A GPU is idle below this utilisation; a gap must last this long to count. Nsight Systems
# treats 500 ms without GPU work as starvation; NVML's utilisation itself averages over
# 1/6 s to 1 s, so shorter gaps are not resolvable from NVML anyway.
IDLE_UTIL_PERCENT = 5.0
IDLE_GAP_S = 0.5

# NVML clock-event bits that mean the GPU slowed itself down: software power cap (0x4),
# hardware slowdown (0x8), software thermal (0x20), hardware thermal (0x40) and power
# brake (0x80). Idle (0x1) and application-clock settings (0x2) are not throttling.
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
# Clock figures are judged only on samples where the GPU was doing work.
BUSY_UTIL_PERCENT = 50.0

_GPU_COLUMN = re.compile(r"^gpu(\d+)\.")


def gpu_indices(trace: Trace) -> list[int]:
    """GPU numbers that have at least one column in the trace, ascending."""
    found = {int(m.group(1)) for name in trace.columns if (m := _GPU_COLUMN.match(name))}
    return sorted(found)


def primary_loader(workload: WorkloadFacts | None) -> LoaderFacts | None:
    """The DataLoader the cell spent the most time iterating, or None."""
    loaders = (workload or {}).get("loaders") or []
    return max(loaders, key=lambda loader: loader.get("loop_time_s") or 0.0, default=None)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> list[float | None]:
    if not len(values):
        return [None for _ in qs]
    return [float(v) for v in np.percentile(np.asarray(values, dtype=float), qs)]


def _stat(trace: Trace, column: str, field: str = "mean") -> float | None:
    stats = trace.stats(column)
    return None if stats is None else float(getattr(stats, field))


def idle_gaps(trace: Trace, index: int) -> list[tuple[float, float]]:
    """Intervals where GPU ``index`` stayed under IDLE_UTIL_PERCENT for at least IDLE_GAP_S."""
    frame = trace.window(columns=[f"gpu{index}.util"])
    util = frame.max[f"gpu{index}.util"]  # the envelope: a bucket is idle only if all of it was
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
              duration_s: float | None = None) -> Summary:
    """The run's summary dict (keys documented in DESIGN.md's public contract)."""
    duration = trace.duration if duration_s is None else duration_s
    summary: Summary = {"duration_s": duration}

    loader = primary_loader(workload)
    loop_time = (loader or {}).get("loop_time_s") or 0.0
    if loader is not None and loop_time > 0:
        summary["loader"] = loader.get("name")
        summary["steps"] = loader["steps"]
        summary["samples"] = loader["samples"] or None
        summary["samples_per_s"] = loader["samples"] / loop_time if loader["samples"] else None
        summary["steps_per_s"] = loader["steps"] / loop_time
        summary["loop_time_s"] = loop_time
        summary["data_wait_fraction"] = loader["wait_total_s"] / loop_time
        p50, p95, p99 = percentiles(loader.get("step_times") or [])
        summary.update({"step_time_p50": p50, "step_time_p95": p95, "step_time_p99": p99})
        # Where the cell's time went: blocked on data, the loop's own work, and the rest
        # (set-up, evaluation outside a DataLoader, the time before the loop started).
        all_loops = sum(item.get("loop_time_s") or 0.0 for item in (workload or {}).get("loaders") or [])
        waits = sum(item.get("wait_total_s") or 0.0 for item in (workload or {}).get("loaders") or [])
        summary["time_breakdown"] = {
            "data_wait_s": waits,
            "compute_s": max(0.0, all_loops - waits),
            "other_s": max(0.0, duration - all_loops),
        }
    else:
        summary.update({"steps": None, "samples": None, "samples_per_s": None, "data_wait_fraction": None})

    summary["cpu_util_mean"] = _stat(trace, "cpu.util")
    summary["process_cpu_mean"] = _stat(trace, "proc.cpu")
    summary["workers_cpu_mean"] = _stat(trace, "proc.workers_cpu")

    busy: dict[int, float] = {}
    mem_fraction: dict[int, float] = {}
    longest_gap = 0.0
    gap_count = 0
    for index in gpu_indices(trace):
        util = _stat(trace, f"gpu{index}.util")
        if util is not None:
            busy[index] = util
            gaps = idle_gaps(trace, index)
            gap_count += len(gaps)
            longest_gap = max([longest_gap] + [end - start for start, end in gaps])
        used = _stat(trace, f"gpu{index}.mem_used", "max")
        total = _stat(trace, f"gpu{index}.mem_total", "max")
        if used is not None and total:
            mem_fraction[index] = used / total
    cuda = (workload or {}).get("cuda") or {}
    for device in cuda.get("devices") or []:
        # The allocator's own peak is exact where NVML polling could miss a short spike.
        if device.get("total_memory"):
            peak = device["peak_reserved"] / device["total_memory"]
            mem_fraction[device["index"]] = max(mem_fraction.get(device["index"], 0.0), peak)
    throttle = [t for t in (_throttling(trace, index) for index in busy) if t is not None]
    if throttle:
        summary["gpu_throttle_fraction"] = max(fraction for fraction, _ in throttle)
        ratios = [ratio for _, ratio in throttle if ratio is not None]
        if ratios:
            summary["gpu_clock_ratio_busy"] = min(ratios)
    own_memory = [_stat(trace, f"gpu{index}.proc_mem", "max") for index in gpu_indices(trace)]
    if any(value is not None for value in own_memory):
        summary["process_gpu_mem_peak"] = max(value or 0.0 for value in own_memory)
    if busy:
        summary["gpu_busy_mean"] = sum(busy.values()) / len(busy)
        summary["gpu_busy_by_gpu"] = {str(index): value for index, value in busy.items()}
        summary["gpu_idle_gaps"] = gap_count
        summary["gpu_longest_idle_s"] = longest_gap
    if mem_fraction:
        summary["peak_gpu_mem_fraction"] = max(mem_fraction.values())
        summary["peak_gpu_mem_fraction_by_gpu"] = {str(index): value for index, value in mem_fraction.items()}
    return summary


def _throttling(trace: Trace, index: int) -> tuple[float, float | None] | None:
    """(share of busy samples with a throttle bit set, mean SM clock / max clock while busy).

    Read from the samples still held at full resolution: a bitmask has no meaningful mean.
    """
    columns = [f"gpu{index}.util", f"gpu{index}.clock_events", f"gpu{index}.sm_clock", f"gpu{index}.sm_clock_max"]
    frame = trace.recent_since(-np.inf, columns)
    util, events = frame.mean[columns[0]], frame.mean[columns[1]]
    with np.errstate(invalid="ignore"):
        busy = util >= BUSY_UTIL_PERCENT
    if not busy.any():
        return None
    known = busy & ~np.isnan(events)
    fraction = float(np.mean((events[known].astype(np.int64) & THROTTLE_BITS) != 0)) if known.any() else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = frame.mean[columns[2]][busy] / frame.mean[columns[3]][busy]
    ratio = ratio[~np.isnan(ratio)]
    return fraction, (float(np.mean(ratio)) if len(ratio) else None)
