"""launch-bound: the GPU idles while the Python process is pegged and data wait is low.

"Idle" is judged on GPM's SM activity where the GPU has it: a loop of tiny kernels keeps NVML's
utilisation high (some kernel is always running) while most SMs sit idle.

Each step launches many small kernels and the host cannot issue them fast enough: the
GPU waits on Python and the CUDA launch path. Fusing work (torch.compile), replaying whole
steps (CUDA graphs, ``mode="reduce-overhead"``) or a larger batch per launch cut that cost.
Where the loader's batch can grow (small-batch fires), that rule names the cause instead: on a
fast GPU a small batch pegs the host too, and the batch is the larger lever.
"""

from __future__ import annotations

from gpuwidget.advice.code import model_code
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import STARVED_WAIT_FRACTION
from gpuwidget.advice.rules import small_batch
from gpuwidget.advice.rules._gpu import (
    PEGGED_PROCESS_PERCENT,
    SM_ACTIVE_LOW_PERCENT,
    busy,
    gpu_measured,
    gpu_speedup_bound,
    model_name,
    model_on_cuda,
)
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "launch-bound"
# Without GPM: NVML utilisation ("kernel running") below this while the host is pegged means the GPU
# waits on kernel launches. With GPM the busy figure is SM activity, judged at DCGM's SM_ACTIVE_LOW_PERCENT
# (the same 50): tiny kernels keep utilisation near 100% while SM activity reads a few percent.
LOW_GPU_BUSY_PERCENT = 50.0


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine) or not model_on_cuda(workload):
        return None
    worked = busy(summary)
    low = SM_ACTIVE_LOW_PERCENT if worked.signal == "sm_active" else LOW_GPU_BUSY_PERCENT
    process = summary.get("process_cpu_mean")
    wait = summary.get("data_wait_fraction") or 0.0
    if worked.percent >= low or process is None or process < PEGGED_PROCESS_PERCENT:
        return None
    if wait >= STARVED_WAIT_FRACTION:
        return None
    if small_batch.check(summary, workload, machine) is not None:
        return None  # the batch can grow: small-batch names this cause, with the loader's change
    model = workload.get("model") or {}
    name = model_name(workload)
    compiled = bool(model.get("compiled"))
    if compiled:
        code = "import torch\n" + model_code(
            name, '{model} = torch.compile({model}._orig_mod, mode="reduce-overhead")  # CUDA graphs')
        change: FindingChange = {"compile_mode": "reduce-overhead"}
    else:
        code = "import torch\n" + model_code(name, "{model} = torch.compile({model})")
        change = {"torch_compile": True}
    return Finding(
        rule=RULE,
        severity="warn",
        title=(f"The GPU waits on Python: {'SMs active' if worked.signal == 'sm_active' else 'kernel running'} "
               f"{worked.percent:.0f}% while the process uses {process:.0f}% of a core"),
        evidence={**worked.evidence, "process_cpu_percent": round(process, 1), "data_wait_fraction": round(wait, 3),
                  "compiled": compiled},
        suggestion=("The main process is saturated launching work and the loop is not waiting for data, "
                    "yet the GPU is idle most of the time: each step is many small kernels. "
                    + ("Compile with mode='reduce-overhead' to replay steps as CUDA graphs, "
                       if compiled else "Compile the model so small operations fuse into fewer kernels, ")
                    + "or use a larger batch so each launch does more work."),
        change=change,
        code=code,
        expected_speedup=gpu_speedup_bound(summary),
    )
