"""memory-pressure: the cell came close to running out of GPU memory, or the allocator holds
far more than the tensors need (fragmentation).

Near the limit, the caching allocator frees and retries (slow) and the next larger
batch or sequence fails. PyTorch's allocator documentation recommends
``expandable_segments`` against fragmentation.
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "memory-pressure"
# Peak use at or above this share of the GPU's memory is close to out-of-memory.
NEAR_LIMIT_FRACTION = 0.92
# Reserved but unallocated memory above this share of the GPU is fragmentation.
FRAGMENTATION_FRACTION = 0.3


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    peak = summary.get("peak_gpu_mem_fraction")
    devices = ((workload.get("cuda") or {}).get("devices")) or []
    fragmented = [
        d for d in devices
        if d.get("total_memory") and (d["peak_reserved"] - d["peak_allocated"]) / d["total_memory"]
        >= FRAGMENTATION_FRACTION
    ]
    if (peak is None or peak < NEAR_LIMIT_FRACTION) and not fragmented:
        return None
    evidence: dict[str, object] = {"peak_gpu_mem_fraction": None if peak is None else round(peak, 3)}
    if fragmented:
        d = fragmented[0]
        evidence.update(peak_allocated=d["peak_allocated"], peak_reserved=d["peak_reserved"],
                        total_memory=d["total_memory"])
    near_limit = peak is not None and peak >= NEAR_LIMIT_FRACTION
    return Finding(
        rule=RULE,
        severity="warn",
        title=(f"GPU memory peaked at {100 * peak:.0f}% of the device" if near_limit and peak is not None
               else "The CUDA allocator holds much more memory than the tensors use"),
        evidence=evidence,
        suggestion=("Close to the limit the allocator frees cached blocks and retries, which stalls steps, "
                    "and a slightly larger input runs out of memory. Use a smaller batch with gradient "
                    "accumulation, activation checkpointing, or bfloat16 autocast; against fragmentation set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA call."),
        change={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        code='import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before CUDA starts',
        expected_speedup=None,
    )
