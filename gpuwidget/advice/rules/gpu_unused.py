"""gpu-unused: the machine has a GPU but the cell did its work on the CPU.

No GPU utilisation, none of the GPU's memory held by this process, and the model's
parameters on the CPU: the usual cause is a missing ``.to("cuda")`` on the model or the
batches.
"""

from __future__ import annotations

from gpuwidget.advice.code import model_code
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import busy, gpu_measured, model_name
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "gpu-unused"
# Below this the GPU did essentially nothing: judged on NVML's utilisation ("kernel running": no kernel
# ran at all) where the GPU reports it, else on the busy figure (SM activity on a MIG instance).
IDLE_GPU_BUSY_PERCENT = 2.0
# The process must have worked (percent of a core) for "ran on the CPU" to mean anything.
BUSY_PROCESS_PERCENT = 50.0
# This process holding less GPU memory than this means it never put tensors there
# (a CUDA context alone takes a few hundred MB).
NO_GPU_MEMORY_BYTES = 64 * 2**20


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    model = workload.get("model") or {}
    devices = model.get("param_devices") or []
    worked = busy(summary)
    idle = worked.kernel_running if worked.kernel_running is not None else worked.percent
    if idle >= IDLE_GPU_BUSY_PERCENT or "cuda" in devices:
        return None
    if (summary.get("process_cpu_mean") or 0.0) < BUSY_PROCESS_PERCENT:
        return None
    own = summary.get("process_gpu_mem_peak")
    if own is not None and own >= NO_GPU_MEMORY_BYTES:
        return None
    name = model_name(workload)
    return Finding(
        rule=RULE,
        severity="critical",
        title="A GPU is here but the cell ran on the CPU",
        evidence={**worked.evidence,
                  "process_cpu_percent": round(summary.get("process_cpu_mean") or 0.0, 1),
                  "model_device": ",".join(devices) or "unknown",
                  "process_gpu_memory": own},
        suggestion=(f"{len(machine.get('gpus') or [])} GPU(s) stayed idle while this process worked on the CPU. "
                    "Move the model and each batch to the GPU."),
        change={"device": "cuda"},
        code=(model_code(name, '{model} = {model}.to("cuda")')
              + '\n# and in the training loop, each batch:\n'
              '# x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)'),
        expected_speedup=None,
    )
