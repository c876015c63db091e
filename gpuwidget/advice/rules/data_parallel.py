"""data-parallel: the model is wrapped in ``torch.nn.DataParallel``; DistributedDataParallel is faster.

DataParallel runs one Python process for every GPU: each step it copies the model to every GPU,
scatters the batch and gathers the outputs (and the loss) on the first GPU, all under one GIL.
PyTorch's documentation recommends DistributedDataParallel instead, even on a single machine: one
process per GPU, gradients all-reduced while backward runs, no replication per step
(torch.nn.DataParallel's docstring and the "DataParallel vs DistributedDataParallel" note).
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured, gpu_speedup_bound, model_name
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "data-parallel"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    model = workload.get("model") or {}
    if not (model.get("data_parallel") or model.get("class") == "DataParallel"):
        return None
    name = model_name(workload)
    # One process per visible GPU (DataParallel's device_ids may have left some out: gpu-imbalance says so).
    gpus = len(machine.get("gpus") or []) or int(model.get("data_parallel_gpus") or 0)
    nproc = str(gpus) if gpus else "gpu"  # torchrun's "gpu": one process per visible GPU
    by_gpu = summary.get("gpu_busy_by_gpu") or {}
    evidence: dict[str, object] = {"model_class": "DataParallel", "gpus": gpus or None}
    if by_gpu:
        evidence["gpu_busy_by_gpu"] = {index: round(value, 1) for index, value in by_gpu.items()}
    used = f"its {gpus} GPUs" if gpus else "the GPUs"
    suggestion = (f"{name or 'The model'} is wrapped in torch.nn.DataParallel: every step copies the model to "
                  f"{used}, splits the batch and gathers outputs and loss on GPU 0, in one Python process. "
                  "DistributedDataParallel runs one process per GPU and overlaps the gradient all-reduce with "
                  "backward; PyTorch recommends it even on one machine. Put the training in a script (or a "
                  "function for notebook_launcher), wrap the model there and launch one process per GPU.")
    if not gpu_measured(summary, machine):
        suggestion += " (Without a GPU, DataParallel runs the module as it is: this matters on a GPU machine.)"
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"{name or 'The model'} uses nn.DataParallel: one process per GPU with DistributedDataParallel is faster",
        evidence=evidence,
        suggestion=suggestion,
        change={"wrapper": "DistributedDataParallel", "launcher": "torchrun", "nproc_per_node": nproc},
        code=_code(name, nproc),
        expected_speedup=gpu_speedup_bound(summary) if gpu_measured(summary, machine) and by_gpu else None,
    )


def _code(name: str | None, nproc: str) -> str:
    model = name or "model"
    inner = f"{model}.module" if name else "model"
    return "\n".join([
        "# One process per GPU with DistributedDataParallel instead of nn.DataParallel.",
        "# In train.py (each process runs it; torchrun sets LOCAL_RANK, RANK, WORLD_SIZE):",
        "#     import os, torch, torch.distributed as dist",
        "#     from torch.nn.parallel import DistributedDataParallel",
        "#     dist.init_process_group(\"nccl\")",
        "#     local_rank = int(os.environ[\"LOCAL_RANK\"])",
        "#     torch.cuda.set_device(local_rank)",
        f"#     {model} = DistributedDataParallel({inner}.to(local_rank), device_ids=[local_rank])",
        "#     sampler = torch.utils.data.distributed.DistributedSampler(dataset)  # each rank its shard",
        "#     loader = torch.utils.data.DataLoader(dataset, batch_size=per_gpu_batch, sampler=sampler)",
        "# then launch it:",
        f"#     torchrun --nproc_per_node={nproc} train.py",
        "# or, from this notebook, with the training in a function train():",
        "#     from accelerate import notebook_launcher",
        f"#     notebook_launcher(train, num_processes={nproc if nproc != 'gpu' else 'torch.cuda.device_count()'})",
    ])
