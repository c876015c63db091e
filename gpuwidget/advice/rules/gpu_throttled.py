"""gpu-throttled: while busy, the GPU slowed its clocks for power or temperature.

NVML's clock-event reasons say why (software power cap, hardware or software thermal
slowdown, power brake). A GPU capped this way does the same work more slowly whatever the
code does; it is a cooling, power-limit or placement matter for whoever runs the machine.
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "gpu-throttled"
# Share of busy samples with a throttle reason set before it is worth saying.
THROTTLED_SHARE = 0.2
# Or the SM clock averaged below this share of its maximum while busy.
LOW_CLOCK_RATIO = 0.8


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    share = summary.get("gpu_throttle_fraction")
    ratio = summary.get("gpu_clock_ratio_busy")
    if (share is None or share < THROTTLED_SHARE) and (ratio is None or ratio >= LOW_CLOCK_RATIO):
        return None
    bound = round(1.0 / ratio, 2) if ratio and ratio < 1.0 else None
    return Finding(
        rule=RULE,
        severity="warn",
        title="The GPU slowed its clocks for power or temperature",
        evidence={"throttled_share_of_busy_samples": None if share is None else round(share, 2),
                  "sm_clock_over_max_while_busy": None if ratio is None else round(ratio, 2)},
        suggestion=("While busy, the GPU ran below its maximum SM clock because of a power cap or heat. "
                    "Check cooling and the power limit (nvidia-smi -q -d PERFORMANCE,POWER), or ask whoever "
                    "runs the machine; the code cannot fix it."),
        change={},
        code="!nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE",
        expected_speedup=bound if bound and bound >= 1.0 else None,
    )
