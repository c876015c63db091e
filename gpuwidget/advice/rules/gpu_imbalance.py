"""gpu-imbalance: the GPUs a multi-GPU workload used did unequal work, or some it should have used sat idle.

A single process training on one GPU of a node leaves the others idle by design: the summary
lists them apart ("GPUs 1-7 were idle and unused by this kernel") and this rule says nothing.
It speaks when the work was meant to spread: the workload used several GPUs and their busy shares
differ widely (a synchronous step waits for the busiest, e.g. DataParallel gathering on GPU 0), or
the model is wrapped for several GPUs while visible GPUs stayed idle and unused.
"""

from __future__ import annotations

from gpuwidget.advice.code import model_code
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured, model_name
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "gpu-imbalance"
# Busy percent of the used GPUs spread by at least this many points: one GPU does the others' waiting.
SPREAD_PERCENT = 30.0
# Model wrappers that say "use several GPUs" (torch.nn and torch.distributed class names).
MULTI_GPU_WRAPPERS = frozenset({"DataParallel", "DistributedDataParallel", "FullyShardedDataParallel"})


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    by_gpu = summary.get("gpu_busy_by_gpu") or {}
    used = {index: by_gpu[str(index)] for index in summary.get("gpus_used") or [] if str(index) in by_gpu}
    idle = list(summary.get("gpus_unused_idle") or [])
    wrapper = (workload.get("model") or {}).get("class")
    name = model_name(workload)
    if len(used) >= 2 and max(used.values()) - min(used.values()) >= SPREAD_PERCENT:
        busiest, quietest = max(used, key=used.__getitem__), min(used, key=used.__getitem__)
        mean = sum(used.values()) / len(used)
        return Finding(
            rule=RULE,
            severity="warn",
            title=f"GPU {busiest} was {used[busiest]:.0f}% busy, GPU {quietest} {used[quietest]:.0f}%",
            evidence={"gpu_busy_by_gpu": {str(i): round(v, 1) for i, v in used.items()},
                      "spread_percent": round(used[busiest] - used[quietest], 1), "model_class": wrapper},
            suggestion=("The GPUs this workload used did unequal work, and a synchronous step waits for the "
                        "busiest. DataParallel gathers outputs and the loss on one GPU: one process per GPU "
                        "with DistributedDataParallel (torchrun) shares it evenly; otherwise check that each "
                        "rank gets the same batch size and shard."),
            change={"launcher": "torchrun", "wrapper": "DistributedDataParallel"},
            code=f"# one process per GPU: torchrun --nproc_per_node={len(used)} train.py  (DistributedDataParallel)",
            expected_speedup=round(used[busiest] / mean, 2) if mean > 0 else None,
        )
    if wrapper in MULTI_GPU_WRAPPERS and idle:
        count = len(used) + len(idle)
        return Finding(
            rule=RULE,
            severity="warn",
            title=f"{name} is wrapped in {wrapper} but {len(idle)} visible GPU(s) stayed idle",
            evidence={"gpus_used": sorted(used), "gpus_unused_idle": idle, "model_class": wrapper},
            suggestion=(f"The model is meant to run on several GPUs, yet GPUs {', '.join(map(str, idle))} did "
                        "no work for this kernel. Give the wrapper every GPU (device_ids=None for DataParallel) "
                        "or start one process per GPU."),
            change={"device_ids": None, "nproc_per_node": count},
            code=("import torch\n"
                  + model_code(name, "{model} = torch.nn.DataParallel({model}.module)  # every visible GPU")
                  if wrapper == "DataParallel"
                  else f"# one process per GPU: torchrun --nproc_per_node={count} train.py"),
            expected_speedup=round(count / max(1, len(used)), 2),
        )
    return None
