"""gpu-throttled: while busy, the GPU slowed its clocks for heat, a hardware signal or a lowered power limit.

The GPU source's flags say why (NVML's clock-event reasons, AMD's violation status). Thermal
slowdown (software or hardware), hardware slowdown and the power brake are faults of cooling or
power delivery. The software power cap alone is not: a
busy H100 at its default power limit sits there as designed, so it counts only when the enforced
limit is below the board's default (``nvmlDeviceGetPowerManagementDefaultLimit``). A GPU slowed
this way does the same work more slowly whatever the code does; it is a matter for whoever runs
the machine.
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import gpu_measured, vendor
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "gpu-throttled"
# Share of busy samples with a slowdown reason (thermal, hardware, power brake) worth saying.
THROTTLED_SHARE = 0.2
# Or the SM clock averaged below this share of its maximum while busy, with no power cap to explain it.
LOW_CLOCK_RATIO = 0.8
# An enforced power limit below this share of the default was lowered on purpose (limits are set in
# whole watts; the margin keeps a rounding difference from counting).
LOWERED_LIMIT_RATIO = 0.99
# Where the user reads the clocks' reasons and the power limit: the vendor's own tool.
TOOL = {"nvidia": ("nvidia-smi -q -d PERFORMANCE,POWER", "nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE"),
        "amd": ("amd-smi metric --power --clock", "amd-smi metric --power --clock --temperature")}


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine):
        return None
    share = summary.get("gpu_throttle_fraction")
    capped = summary.get("gpu_power_capped_fraction") or 0.0
    limit = summary.get("gpu_power_limit_ratio")
    ratio = summary.get("gpu_clock_ratio_busy")
    slowed = share is not None and share >= THROTTLED_SHARE
    lowered = capped >= THROTTLED_SHARE and limit is not None and limit < LOWERED_LIMIT_RATIO
    # Low clocks at the default power cap are how a busy GPU runs; unexplained low clocks are not.
    unexplained = ratio is not None and ratio < LOW_CLOCK_RATIO and capped < THROTTLED_SHARE
    if not (slowed or lowered or unexplained):
        return None
    bound = round(1.0 / ratio, 2) if ratio and ratio < 1.0 else None
    if lowered and not slowed:
        title = f"The GPU's power limit was lowered to {100 * (limit or 0):.0f}% of its default"
        why = "its enforced power limit is below the board's default and the GPU sat at that cap"
    else:
        title = "The GPU slowed its clocks for heat or a hardware signal"
        why = "of heat, a hardware slowdown or the power brake"
    look, command = TOOL[vendor(machine)]
    return Finding(
        rule=RULE,
        severity="warn",
        title=title,
        evidence={"slowdown_share_of_busy_samples": None if share is None else round(share, 2),
                  "power_capped_share_of_busy_samples": round(capped, 2),
                  "power_limit_over_default": None if limit is None else round(limit, 2),
                  "sm_clock_over_max_while_busy": None if ratio is None else round(ratio, 2)},
        suggestion=(f"While busy, the GPU ran below its maximum SM clock because {why}. Check cooling and "
                    f"the power limit ({look}), or ask whoever runs the machine; the code cannot fix it."),
        change={},
        code=f"!{command}",
        expected_speedup=bound if bound and bound >= 1.0 else None,
    )
