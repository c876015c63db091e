"""pageable-transfer: batches go to the GPU from pageable host memory.

Copies from pageable memory are staged through a pinned buffer by the driver and cannot
overlap with compute; ``pin_memory=True`` plus ``.to(device, non_blocking=True)`` makes
them direct and asynchronous (PyTorch's "pin memory" tuning guide). When the loader is
also starved, dataloader-starved already carries this change. A loader whose batches are already
on the GPU (a dataset held there) copies nothing, and pinning its CUDA tensors would raise.
"""

from __future__ import annotations

from gpuwidget.advice.code import loader_code
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import STARVED_WAIT_FRACTION, host_batches
from gpuwidget.advice.rules._gpu import gpu_measured, model_on_cuda
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.figures.summary import primary_loader

RULE = "pageable-transfer"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine) or not model_on_cuda(workload):
        return None
    loader = primary_loader(workload)
    if loader is None or (loader.get("settings") or {}).get("pin_memory") or not host_batches(loader):
        return None
    if (summary.get("data_wait_fraction") or 0.0) >= STARVED_WAIT_FRACTION:
        return None
    change: FindingChange = {"pin_memory": True}
    name = loader.get("name") or "loader"
    return Finding(
        rule=RULE,
        severity="info",
        title=f"Batches are copied to the GPU from pageable memory ({name})",
        evidence={"pin_memory": False, "model_device": "cuda"},
        suggestion=("The model is on the GPU but the loader returns batches in pageable memory, so each copy "
                    "is staged and blocks. Pin them and copy without blocking."),
        change=change,
        code=(loader_code(loader, change, workload)
              + "\n# and copy each batch without blocking: .to(device, non_blocking=True)"),
        expected_speedup=None,
    )
