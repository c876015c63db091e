"""dataloader-cpu-bound: starved while the CPUs are already saturated by building batches.

More workers cannot help when every core is busy; the batch has to get cheaper: decode or
augment on the GPU (torchvision transforms v2 on tensors, NVIDIA DALI), cache decoded
samples, or do fixed preprocessing once, ahead of training. Thresholds live in
gpuwidget.advice.loader (HOST_SATURATED_PERCENT, CPU_WORK_RATIO, WORKER_BUSY).
"""

from __future__ import annotations

from gpuwidget.advice.code import cache_code
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.loader import diagnose
from gpuwidget.advice.rules.loop_waits import IN_LOADER_MAX
from gpuwidget.facts import LoaderFacts, LoopWait, MachineFacts, Summary, WorkloadFacts
from gpuwidget.report import fmt_count, fmt_percent

RULE = "dataloader-cpu-bound"


def batch_builder(workload: WorkloadFacts, loader: LoaderFacts | None = None) -> LoopWait | None:
    """Where the main process built its batches: the function the stack samples found the loop in while
    it waited inside the loader's ``next()`` (the share loop-waits leaves to the DataLoader rules); else,
    where ``loader`` had no workers and its collate function took most of those waits as the DataLoader
    probe timed them, the collate function. Stack samples of a wait in Python that holds the GIL are
    read at the interpreter's switch interval (5 ms), often after a few-millisecond collate has ended;
    the probe's timing has no such blind spot."""
    found = next((wait for wait in workload.get("loop_waits") or []
                  if float(wait.get("in_loader") or 0.0) >= IN_LOADER_MAX and not wait.get("in_loop")), None)
    if found is not None or loader is None:
        return found
    share = loader.get("collate_share")
    site = (loader.get("settings") or {}).get("collate_code")
    if share is None or share < IN_LOADER_MAX or not site:
        return None
    waited = float(loader.get("wait_total_s") or 0.0)
    loop = float(loader.get("loop_time_s") or 0.0)
    return {**site, "share": share * waited / loop if loop > 0 else 0.0, "seconds": share * waited,
            "samples": 0, "in_loader": 1.0, "in_loop": False, "timed": True}


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    if d is None or not d.starved or not d.cpu_saturated:
        return None
    return Finding(
        rule=RULE,
        severity="critical" if d.wait_fraction >= 0.4 else "warn",
        title=f"Building batches saturates the CPU ({d.name})",
        # Cached or precomputed samples take no building: the whole wait is this change's gain.
        evidence={**d.evidence, "expected_gain": round(d.expected_speedup, 2),
                  "upper_bound_speedup": round(d.expected_speedup, 2)},
        suggestion=(f"The loop waits {d.waited} while the CPUs it may use are "
                    f"{fmt_percent(d.evidence.get('cpus_busy_percent', d.evidence.get('host_cpu_percent', 0)))} busy "
                    f"({fmt_count(d.usable_cpus, 'core')}), so more "
                    "workers would only compete for the same cores. Make each batch cheaper: cache decoded "
                    "samples, preprocess once ahead of training, or run the augmentations on the GPU "
                    "(torchvision transforms v2 on batched tensors, or NVIDIA DALI)."),
        change={},
        code=cache_code(d.loader, batch_builder(workload, d.loader)),
        expected_speedup=round(d.expected_speedup, 2),
    )
