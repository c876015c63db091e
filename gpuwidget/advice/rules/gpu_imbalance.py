"""gpu-imbalance: the GPUs a multi-GPU workload used did unequal work, or some it should have used sat idle.

A single process training on one GPU of a node leaves the others idle by design: the summary
lists them apart ("GPUs 1-7 were idle and unused by this kernel") and this rule says nothing.
It speaks when the work was meant to spread: the workload used several GPUs and their busy shares
differ widely (a synchronous step waits for the busiest, e.g. DataParallel gathering on GPU 0), or
the model is wrapped for several GPUs while visible GPUs stayed idle and unused, or several training
processes (ranks) ran while visible GPUs that no rank used stayed idle.
"""

from __future__ import annotations

from gpuwidget.advice.code import model_code
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured, model_name
from gpuwidget.advice.rules._ranks import ranks
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.figures.summary import IDLE_UTIL_PERCENT

RULE = "gpu-imbalance"
# The busy figure (SM activity where GPM has it, else utilisation) of the used GPUs spread by at least
# this many points: one GPU does the others' waiting. DataParallel's gather on GPU 0 shows in both.
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
    unranked = _idle_gpus_no_rank_uses(summary, workload, machine)
    if unranked:
        return _unranked_finding(unranked, workload, by_gpu)
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


def _idle_gpus_no_rank_uses(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> list[int]:
    """With several ranks, each on a GPU: the visible GPUs none of them used that stayed idle."""
    training = ranks(workload)
    used = {int(gpu) for rank in training if (gpu := rank.get("gpu")) is not None}
    if len(training) < 2 or not used:
        return []
    by_gpu = summary.get("gpu_busy_by_gpu") or {}
    visible = [int(gpu["index"]) for gpu in machine.get("gpus") or [] if gpu.get("index") is not None]
    return [index for index in visible or [int(key) for key in by_gpu]
            if index not in used and by_gpu.get(str(index), 0.0) < IDLE_UTIL_PERCENT]


def _unranked_finding(unranked: list[int], workload: WorkloadFacts, by_gpu: dict[str, float]) -> Finding:
    training = ranks(workload)
    used = sorted({int(gpu) for rank in training if (gpu := rank.get("gpu")) is not None})
    count = len(used) + len(unranked)
    listed = ", ".join(map(str, unranked))
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"{len(training)} ranks trained on GPU(s) {', '.join(map(str, used))}; GPU(s) {listed} stayed idle",
        evidence={"ranks": len(training), "gpus_of_ranks": used, "gpus_no_rank_used": unranked,
                  "gpu_busy_by_gpu": {key: round(value, 1) for key, value in by_gpu.items()}},
        suggestion=(f"No training process used GPU(s) {listed}, and they did no other work. Start one process "
                    f"per GPU (torchrun --nproc_per_node={count}, or notebook_launcher(..., num_processes={count})) "
                    "and scale the learning rate or keep the global batch size as the run needs."),
        change={"nproc_per_node": count},
        code=f"# one process per GPU: torchrun --nproc_per_node={count} train.py",
        expected_speedup=round(count / len(used), 2),
    )
