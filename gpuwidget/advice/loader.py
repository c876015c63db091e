"""What the DataLoader measurements say: is the loop starved, why, and which settings fix it.

Shared by the three loader rules (``dataloader-starved``, ``dataloader-cpu-bound``,
``io-bound``) so they agree on one diagnosis; the code they offer is written by
gpuwidget.advice.code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuwidget.advice.summary import primary_loader
from gpuwidget.facts import LoaderFacts, MachineFacts, Summary, WorkloadFacts

# The loop is starved when at least this share of its time is spent blocked in next().
# PyTorch's profiler recommendations flag DataLoader time above 5% of a step; we ask for
# 10% so that a finding is worth acting on and timing noise of short cells stays below it.
STARVED_WAIT_FRACTION = 0.10
# Fewer steps than this say nothing reliable about a loop.
MIN_STEPS = 5
# Process CPU seconds per wall second while blocked in next() with num_workers=0: the main
# process builds each batch itself, so >= 0.5 means batch building is CPU work, <= 0.25
# means it mostly sleeps (storage, network).
CPU_WORK_RATIO = 0.5
IO_WAIT_RATIO = 0.25
# Share of a core each worker process used (num_workers > 0): busy workers are CPU-bound,
# idle ones while the loop waits are waiting on storage. Same cut-offs as above.
WORKER_BUSY = 0.5
WORKER_IDLE = 0.25
# Host CPU (all cores) at or above this mean is saturated: more workers cannot help.
HOST_SATURATED_PERCENT = 85.0
# Workers are sized to produce batches this much faster than the loop consumes them.
WORKER_MARGIN = 1.2
# Storage-bound loading overlaps waits, not CPU: workers beyond the core count help, up to
# this multiple of the cores (and a hard cap, as each worker holds a dataset copy).
IO_WORKERS_PER_CORE = 4
MAX_WORKERS = 32
# Waits are bursty when the 95th percentile wait exceeds this multiple of the median.
BURSTY_WAIT_RATIO = 4.0
DEFAULT_PREFETCH = 2


@dataclass
class LoaderDiagnosis:
    """The measured state of the primary loader and the settings that would feed the loop."""

    loader: LoaderFacts
    wait_fraction: float
    wait_per_step: float
    compute_per_step: float
    starved: bool
    cause: str  # "cpu", "io" or "unknown"
    cpu_saturated: bool
    num_workers: int
    usable_cpus: int
    workers_busy: float | None
    change: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.loader.get("name") or "the DataLoader"

    @property
    def expected_speedup(self) -> float:
        """Upper bound if every wait disappeared: the loop time minus all time in next()."""
        return 1.0 / max(1e-9, 1.0 - self.wait_fraction)


def diagnose(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> LoaderDiagnosis | None:
    """None when no DataLoader ran long enough to judge."""
    loader = primary_loader(workload)
    if loader is None or loader["steps"] < MIN_STEPS or not loader.get("loop_time_s"):
        return None
    settings = loader.get("settings") or {}
    steps = loader["steps"]
    wait_fraction = loader["wait_total_s"] / loader["loop_time_s"]
    wait = loader["wait_total_s"] / steps
    compute = max(loader["compute_total_s"] / steps, 1e-6)
    num_workers = int(settings.get("num_workers") or 0)
    usable = int(machine.get("usable_cpus") or 1)

    workers_busy = None
    workers_cpu = summary.get("workers_cpu_mean")
    if num_workers > 0 and workers_cpu is not None:
        workers_busy = workers_cpu / 100.0 / num_workers
    wait_cpu = loader.get("wait_cpu_ratio")
    if num_workers == 0 and wait_cpu is not None:
        cause = "cpu" if wait_cpu >= CPU_WORK_RATIO else ("io" if wait_cpu <= IO_WAIT_RATIO else "unknown")
    elif workers_busy is not None:
        cause = "cpu" if workers_busy >= WORKER_BUSY else ("io" if workers_busy <= WORKER_IDLE else "unknown")
    else:
        cause = "unknown"
    host = summary.get("cpu_util_mean")
    host_saturated = host is not None and host >= HOST_SATURATED_PERCENT
    if host_saturated and cause != "cpu":
        # Batch builders that use little CPU on a saturated host are waiting for a core, not
        # for storage: more workers would only queue for the same cores.
        cause = "cpu"
    cpu_saturated = cause == "cpu" and host_saturated

    diagnosis = LoaderDiagnosis(
        loader=loader, wait_fraction=wait_fraction, wait_per_step=wait, compute_per_step=compute,
        starved=wait_fraction >= STARVED_WAIT_FRACTION, cause=cause, cpu_saturated=cpu_saturated,
        num_workers=num_workers, usable_cpus=usable, workers_busy=workers_busy,
    )
    diagnosis.evidence = _evidence(diagnosis, host, wait_cpu)
    if diagnosis.starved:
        diagnosis.change = _change(diagnosis, settings, workload, machine)
    return diagnosis


def _evidence(d: LoaderDiagnosis, host: float | None, wait_cpu: float | None) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "data_wait_fraction": round(d.wait_fraction, 3),
        "wait_per_step_ms": round(1000 * d.wait_per_step, 2),
        "compute_per_step_ms": round(1000 * d.compute_per_step, 2),
        "steps": d.loader["steps"],
        "num_workers": d.num_workers,
        "usable_cpus": d.usable_cpus,
    }
    if host is not None:
        evidence["host_cpu_percent"] = round(host, 1)
    if d.workers_busy is not None:
        evidence["worker_busy_fraction"] = round(d.workers_busy, 2)
    if wait_cpu is not None and d.num_workers == 0:
        evidence["cpu_while_waiting"] = round(wait_cpu, 2)
    return evidence


def production_time(d: LoaderDiagnosis) -> float:
    """Seconds one worker needs to produce one batch, from what was measured.

    Without workers the main process built each batch during its wait. With ``k``
    starved workers, the loop received one batch per (wait + compute), so each worker
    needed about ``k`` times that.
    """
    if d.num_workers == 0:
        return d.wait_per_step
    return d.num_workers * (d.wait_per_step + d.compute_per_step)


def workers_needed(d: LoaderDiagnosis) -> int:
    """Workers that produce batches WORKER_MARGIN times faster than the loop consumes them,
    capped by the cores for CPU work (beyond them, workers only contend), or by
    IO_WORKERS_PER_CORE per core for storage waits."""
    needed = max(1, math.ceil(WORKER_MARGIN * production_time(d) / d.compute_per_step))
    cap = min(MAX_WORKERS, IO_WORKERS_PER_CORE * d.usable_cpus) if d.cause == "io" else d.usable_cpus
    return max(1, min(needed, cap))


def _uses_cuda(workload: Mapping[str, Any], machine: Mapping[str, Any]) -> bool:
    model = workload.get("model") or {}
    return "cuda" in (model.get("param_devices") or []) or bool(workload.get("cuda"))


def _change(d: LoaderDiagnosis, settings: Mapping[str, Any], workload: Mapping[str, Any],
            machine: Mapping[str, Any]) -> dict[str, Any]:
    change: dict[str, Any] = {}
    workers = d.num_workers
    if not d.cpu_saturated:
        target = workers_needed(d)
        if target > workers:
            change["num_workers"] = workers = target
    if workers > 0:
        waits = np.asarray(d.loader.get("wait_times") or [0.0])
        median = float(np.median(waits))
        if median > 0 and float(np.percentile(waits, 95)) > BURSTY_WAIT_RATIO * median:
            current = settings.get("prefetch_factor") or DEFAULT_PREFETCH
            change["prefetch_factor"] = max(4, 2 * current)
        if d.loader.get("epochs", 0) >= 2 and not settings.get("persistent_workers"):
            change["persistent_workers"] = True
    if _uses_cuda(workload, machine) and not settings.get("pin_memory"):
        change["pin_memory"] = True
    return change
