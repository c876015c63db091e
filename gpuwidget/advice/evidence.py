"""Enough evidence before a cause: how long a loop must run at its steady state before its idle time is explained.

The loop's causes (a starved loader and why, contention for the cores, periodic stalls, a
batch too small) rest on figures that need time to mean anything, so none is named from a
loop shorter than these; the advisor says instead how long to watch (rule ``watch-longer``).
Warm-up steps (gpuwidget.figures.warmup) do not count: they are not the loop's steady state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwidget.facts import WorkloadFacts
from gpuwidget.figures.summary import loop_step_times
from gpuwidget.figures.warmup import WarmupSplit, split_run

# Steady steps a cause needs. The loop's own CPU and run delay while it is blocked in next()
# are read on one step in eight (probes.torch_data.CPU_SAMPLE_EVERY, never the first) where the
# loop waits on its loader, so 16 steps give two readings; periodic-stall needs three stalls at
# least two steps apart and the steps between them to take its median from.
MIN_CAUSE_STEPS = 16
# Seconds of steady steps a cause needs. The host figures behind the loader's causes (CPU of
# the process and its workers, run delay, other processes' CPU) are rates between sampler
# ticks, 0.25 s apart by default, from counters that advance in 10 ms clock ticks: a second
# holds four such rates. A second is also what a loader change must have to pay back: starting
# workers took 31 ms (1) to 211 ms (8) on the 2-vCPU test VM (advice.loader.WORKER_START_S), so
# in a shorter loop the start-up of the advised workers is a good part of the loop itself. The
# 0.23 s cell of 32 in-memory batches once called io-bound held a single sampler tick.
MIN_CAUSE_LOOP_S = 1.0


@dataclass(frozen=True)
class LoopEvidence:
    """How much of the loop's steady state was seen."""

    steps: int  # steps counted, warm-up included
    steady_steps: int
    steady_s: float  # seconds of the steady steps
    warmup: WarmupSplit

    @property
    def enough(self) -> bool:
        return (not self.warmup.all_warmup and self.steady_steps >= MIN_CAUSE_STEPS
                and self.steady_s >= MIN_CAUSE_LOOP_S)

    @property
    def step_s(self) -> float | None:
        """The typical steady step, seconds (the median; over every step when all was warm-up)."""
        return self.warmup.steady_median

    def steps_to_watch(self) -> int:
        """Steady steps that meet both thresholds at the typical step time."""
        step = self.step_s
        by_time = math.ceil(MIN_CAUSE_LOOP_S / step) if step and step > 0 else MIN_CAUSE_STEPS
        return max(MIN_CAUSE_STEPS, by_time)

    def seconds_to_watch(self) -> float:
        """Seconds of loop to watch: the warm-up, then :meth:`steps_to_watch` steady steps."""
        step = self.step_s or 0.0
        return (0.0 if self.warmup.all_warmup else self.warmup.seconds) + max(
            MIN_CAUSE_LOOP_S, self.steps_to_watch() * step)


def loop_evidence(workload: WorkloadFacts | None) -> LoopEvidence | None:
    """What was seen of the loop the summary describes (summary.loop_step_times), None without steps."""
    times, steps = loop_step_times(workload)
    if not steps or not times:
        return None
    split = split_run(times, steps)
    if split.all_warmup:
        median = float(sorted(times)[len(times) // 2])
        split = WarmupSplit(split.steps, split.seconds, split.first_steady, True, median)
        return LoopEvidence(steps, 0, 0.0, split)
    steady = split.steady(times)
    # A bounded history holds the latest steps: the steps before it were steady too.
    steady_steps = max(len(steady), steps - split.steps)
    steady_s = sum(steady) * steady_steps / max(1, len(steady))
    return LoopEvidence(steps, steady_steps, steady_s, split)


def enough_evidence(workload: WorkloadFacts | None) -> bool:
    """The loop ran long enough at its steady state for a cause to be named (False without a loop)."""
    evidence = loop_evidence(workload)
    return evidence is not None and evidence.enough
