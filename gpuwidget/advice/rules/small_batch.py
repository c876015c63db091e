"""small-batch: the GPU is often idle and most of its memory unused while the loop is not starved.

Each step does too little work to keep the GPU busy; a larger batch does more per launch
and per Python step. Memory headroom bounds how far the batch can grow; utilisation
bounds the gain (the GPU cannot be busier than 100%).

On a fast GPU a small batch also pegs the host: an H200 finishes a batch-8 MLP step's kernels
long before Python has launched the next ones (benchmarks/gpu_check.py's small-batch workload: SMs
active 3%, the process at 98% of a core, 60x the samples/s at batch 512). The batch is then still
the lever, and this rule names it; launch-bound, the same idle GPU seen from the host, stands aside.
"""

from __future__ import annotations

import math

from gpuwidget.advice.code import loader_code
from gpuwidget.advice.evidence import enough_evidence
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import STARVED_WAIT_FRACTION
from gpuwidget.advice.rules._gpu import (
    PEGGED_PROCESS_PERCENT,
    SM_ACTIVE_LOW_PERCENT,
    busy,
    gpu_measured,
    gpu_speedup_bound,
)
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.figures.summary import primary_loader

RULE = "small-batch"
# Without GPM: NVML utilisation ("kernel running", percent of time any kernel ran) below this means
# the GPU waits on the host. It is higher than SM_ACTIVE_LOW_PERCENT, DCGM's threshold for SM activity
# (what the summary's busy figure is where GPM exists), because utilisation overstates how busy a GPU
# is: a kernel running on a few SMs counts as fully busy.
LOW_GPU_BUSY_PERCENT = 60.0
# Less than this share of GPU memory at peak leaves room to at least double the batch.
MEMORY_HEADROOM_FRACTION = 0.5
# Grow the batch towards this share of GPU memory, leaving room for fragmentation.
TARGET_MEMORY_FRACTION = 0.8


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    loader = primary_loader(workload)
    worked = busy(summary)
    low = SM_ACTIVE_LOW_PERCENT if worked.signal == "sm_active" else LOW_GPU_BUSY_PERCENT
    memory = summary.get("peak_gpu_mem_fraction")
    wait = summary.get("data_wait_fraction") or 0.0
    if loader is None or worked.percent >= low or memory is None or memory >= MEMORY_HEADROOM_FRACTION:
        return None
    if not enough_evidence(workload):
        return None  # too short a loop to judge its GPU use (advice.evidence; watch-longer says so)
    if wait >= STARVED_WAIT_FRACTION:
        return None
    batch = (loader.get("settings") or {}).get("batch_size")
    if not batch:
        return None
    factor = 2 ** max(1, int(math.log2(TARGET_MEMORY_FRACTION / max(memory, 1e-3))))
    new_batch = max(8, int(batch * factor) // 8 * 8)
    change: FindingChange = {"batch_size": new_batch}
    sm = worked.signal == "sm_active"
    idle_what = "GPU's SMs" if sm else "GPU"
    busy_what = "GPU's SMs were active" if sm else "GPU ran a kernel"
    process = summary.get("process_cpu_mean") or 0.0
    evidence = {**worked.evidence, "peak_gpu_mem_fraction": round(memory, 3), "batch_size": batch,
                "data_wait_fraction": round(wait, 3)}
    host = ""
    if process >= PEGGED_PROCESS_PERCENT:
        evidence["process_cpu_percent"] = round(process, 1)
        host = (f" The process used {process:.0f}% of a core launching each step's kernels: a larger batch spreads "
                "that cost over more samples (compiling the model, torch.compile, cuts it too).")
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"Batches of {batch} leave the {idle_what} idle {100 - worked.percent:.0f}% of the time",
        evidence=evidence,
        suggestion=(f"The {busy_what} {worked.percent:.0f}% of the time and it used at most {100 * memory:.0f}% "
                    f"of its memory, and the loop was not waiting for data.{host} A batch of {new_batch} gives "
                    "each step more work per launch; scale the learning rate with it (linearly, with warm-up) "
                    "to keep the same training dynamics."),
        change=change,
        code=loader_code(loader, change, workload),
        expected_speedup=gpu_speedup_bound(summary),
    )
