"""Facts the GPU rules share: was a GPU measured, how hard it worked, where the model ran, its capability."""

from __future__ import annotations

from typing import NamedTuple

from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

# DCGM's profiling-metrics guidance: SM activity of 0.8 or more is needed to use a GPU well, below
# 0.5 its use is ineffective. NVML's utilisation is the share of time *any* kernel ran ("kernel
# running": one tiny kernel counts as 100%), so where GPM gives SM activity (Hopper and newer, MIG
# instances included) the summary's busy figure is SM activity, and the rules judge that.
SM_ACTIVE_LOW_PERCENT = 50.0
# The main process at or above this share of one core is pegged (Python is single-threaded).
PEGGED_PROCESS_PERCENT = 90.0


class Busy(NamedTuple):
    """How hard the judged GPUs worked, percent, which counter says so, and NVML's "kernel running"
    beside it where known (both named in evidence)."""

    percent: float
    signal: str  # "sm_active" (GPM) or "kernel_running" (NVML utilisation)
    kernel_running: float | None = None

    @property
    def evidence(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"signal": self.signal}
        if self.signal == "sm_active":
            out["sm_active_percent"] = round(self.percent, 1)
        if self.kernel_running is not None:
            out["kernel_running_percent"] = round(self.kernel_running, 1)
        return out


def busy(summary: Summary) -> Busy:
    """The summary's busy figure (call after gpu_measured): SM activity where GPM has it, else NVML's
    utilisation. A summary from before ``gpu_busy_metric`` held utilisation in ``gpu_busy_mean`` and
    SM activity apart; it is read that way."""
    metric = summary.get("gpu_busy_metric")
    if metric is not None:
        return Busy(summary["gpu_busy_mean"], "sm_active" if metric == "sm_active" else "kernel_running",
                    summary.get("gpu_kernel_running_mean"))
    sm_active = summary.get("gpu_sm_active_mean")
    if sm_active is not None:
        return Busy(sm_active, "sm_active", summary["gpu_busy_mean"])
    return Busy(summary["gpu_busy_mean"], "kernel_running", summary["gpu_busy_mean"])


def gpu_measured(summary: Summary, machine: MachineFacts) -> bool:
    """GPU rules need GPU evidence: a GPU on the machine and its busy figure recorded (a MIG instance
    without GPM has none: ``gpu_busy_missing`` says so and the GPU rules stay silent)."""
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


def model_name(workload: WorkloadFacts) -> str | None:
    """The user's variable for the trained model, or None where no name of theirs holds it."""
    return (workload.get("model") or {}).get("name") or None


def gpu_speedup_bound(summary: Summary, cap: float = 10.0) -> float | None:
    """A GPU cannot be busier than 100%: throughput can rise at most 100 / busy-percent (SM activity
    where GPM has it)."""
    if summary.get("gpu_busy_mean") is None:
        return None
    percent = busy(summary).percent
    if percent <= 0:
        return None
    return round(min(cap, max(1.0, 100.0 / percent)), 2)


def vendor(machine: MachineFacts | None) -> str:
    """The judged GPUs' vendor ("nvidia", "amd"), for a finding that sends the user to the driver's own tool."""
    vendors = {gpu.get("vendor") or "nvidia" for gpu in (machine or {}).get("gpus") or []}
    return "amd" if vendors == {"amd"} else "nvidia"
