"""Facts the GPU rules share: was a GPU measured, where did the model run, its capability."""

from __future__ import annotations

from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts


def gpu_measured(summary: Summary, machine: MachineFacts) -> bool:
    """GPU rules need GPU evidence: a GPU on the machine and its utilisation recorded."""
    return bool(machine.get("gpus")) and summary.get("gpu_busy_mean") is not None


def model_on_cuda(workload: WorkloadFacts) -> bool:
    model = workload.get("model") or {}
    return "cuda" in (model.get("param_devices") or [])


def capability(workload: WorkloadFacts) -> tuple[int, int] | None:
    """Compute capability of the first CUDA device the process used (from torch)."""
    devices = ((workload.get("cuda") or {}).get("devices")) or []
    if not devices:
        return None
    major, minor = devices[0]["capability"]
    return int(major), int(minor)


def model_name(workload: WorkloadFacts) -> str:
    return ((workload.get("model") or {}).get("name")) or "model"


def gpu_speedup_bound(summary: Summary, cap: float = 10.0) -> float | None:
    """A GPU cannot be busier than 100%: throughput can rise at most 100 / busy-percent."""
    busy = summary.get("gpu_busy_mean")
    if not busy or busy <= 0:
        return None
    return round(min(cap, max(1.0, 100.0 / busy)), 2)
