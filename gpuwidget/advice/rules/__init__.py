"""The advisor's rules: one module per cause, each ``check(summary, workload, machine) -> Finding | None``.

Rule ids are stable (DESIGN.md); thresholds are named constants at the top of each module.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules import (
    cpu_contention,
    data_parallel,
    dataloader_cpu_bound,
    dataloader_starved,
    ddp_communication,
    fp32_math,
    gpu_imbalance,
    gpu_throttled,
    gpu_unused,
    io_bound,
    launch_bound,
    memory_pressure,
    pageable_transfer,
    periodic_stall,
    rank_straggler,
    small_batch,
    watch_longer,
)
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

Rule = Callable[[Summary, WorkloadFacts, MachineFacts], "Finding | None"]

RULES: dict[str, Rule] = {
    module.RULE: module.check
    for module in (
        dataloader_starved, dataloader_cpu_bound, io_bound, small_batch, memory_pressure, fp32_math,
        launch_bound, periodic_stall, pageable_transfer, gpu_throttled, gpu_unused, cpu_contention, gpu_imbalance,
        rank_straggler, ddp_communication, data_parallel, watch_longer,
    )
}
