"""Headline figures of a run, computed once from its Trace and workload facts.

Every figure is measured; a figure the run cannot support (no GPU, no DataLoader
seen) is None rather than a guess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpuwidget.trace import Trace

# Span kinds the workload probes record (see gpuwidget.probes).
STEP_SPAN = "step"
DATA_WAIT_SPAN = "loader.wait"

_GPU_COLUMN = re.compile(r"^gpu(\d+)\.")


def gpu_indices(trace: Trace) -> list[int]:
    """GPU numbers that have at least one column in the trace, ascending."""
    found = {int(m.group(1)) for name in trace.columns if (m := _GPU_COLUMN.match(name))}
    return sorted(found)


def _mean(trace: Trace, column: str) -> float | None:
    stats = trace.stats(column)
    return None if stats is None else stats.mean


def _max(trace: Trace, column: str) -> float | None:
    stats = trace.stats(column)
    return None if stats is None else stats.max


def summarize(trace: Trace, workload: Mapping[str, Any] | None = None,
              duration_s: float | None = None) -> dict[str, Any]:
    """The run's summary dict (keys documented in DESIGN.md's public contract)."""
    workload = workload or {}
    duration = trace.duration if duration_s is None else duration_s
    summary: dict[str, Any] = {"duration_s": duration}

    steps = trace.span_stats(STEP_SPAN)
    wait = trace.span_stats(DATA_WAIT_SPAN)
    summary["steps"] = steps.count if steps else (wait.count if wait else None)
    samples = workload.get("samples")
    summary["samples"] = samples
    summary["samples_per_s"] = samples / duration if samples and duration > 0 else None
    summary["data_wait_fraction"] = (min(1.0, wait.total / duration) if wait and duration > 0 else None)

    summary["cpu_util_mean"] = _mean(trace, "cpu.util")
    summary["process_cpu_mean"] = _mean(trace, "proc.cpu")
    summary["workers_cpu_mean"] = _mean(trace, "proc.workers_cpu")

    busy: dict[int, float] = {}
    mem_fraction: dict[int, float] = {}
    for index in gpu_indices(trace):
        util = _mean(trace, f"gpu{index}.util")
        if util is not None:
            busy[index] = util
        used = _max(trace, f"gpu{index}.mem_used")
        total = _max(trace, f"gpu{index}.mem_total")
        if used is not None and total:
            mem_fraction[index] = used / total
    if busy:
        summary["gpu_busy_mean"] = sum(busy.values()) / len(busy)
        summary["gpu_busy_by_gpu"] = busy
    if mem_fraction:
        summary["peak_gpu_mem_fraction"] = max(mem_fraction.values())
        summary["peak_gpu_mem_fraction_by_gpu"] = mem_fraction
    return summary
