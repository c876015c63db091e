"""Facts the multi-process rules share: the training processes of a run and each one's model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from gpuwidget.facts import ModelFacts, Summary, WorkloadFacts


def ranks(workload: WorkloadFacts) -> list[dict[str, Any]]:
    """``workload["ranks"]``: one dict per training process (the kernel's own included when it
    trained), as the child probes report them; empty for a single-process run."""
    listed = cast(Mapping[str, Any], workload).get("ranks") or []
    return [dict(rank) for rank in listed if isinstance(rank, Mapping)]


def rank_label(rank: dict[str, Any]) -> str:
    """``rank 1`` where torch.distributed (or the launcher) numbered it, else ``pid 4242``."""
    if rank.get("rank") is not None:
        return f"rank {rank['rank']}"
    return f"pid {rank.get('pid')}"


def processes_with_models(summary: Summary, workload: WorkloadFacts) -> list[tuple[ModelFacts, float | None, str]]:
    """(model facts, median step time in s, who) for every process whose model the probes saw: each
    rank's (the watched process's own entry among them when it trained beside children), or the
    watched process's model alone in a single-process run."""
    found: list[tuple[ModelFacts, float | None, str]] = []
    for rank in ranks(workload):
        model = rank.get("model")
        if model:
            found.append((model, rank.get("step_time_p50_s"), rank_label(rank)))
    own = workload.get("model")
    if own and not found:
        found.append((own, summary.get("step_time_p50"), "this process"))
    return found


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


NS = 1e-9


def ddp_exposed_comm_s(ddp: Mapping[str, Any] | None) -> float | None:
    """Seconds per step DDP's all-reduce ran past the end of backward (``backward_comm_time -
    backward_compute_comm_overlap_time``), the smaller of its average over the iterations DDP samples
    and its latest sample: the first iterations, in the average, include waiting for the other ranks
    to start at all (process start-up, imports). None without DDP's timings."""
    estimates = ddp_exposed_estimates_s(ddp)
    return min(estimates) if estimates else None


# ------------------------------------------------------------------ one rank against the others, step by step

# Steps a rank needs before its figures are compared with the others': a median and a sign test
# over fewer steps is decided by a handful of scheduler hiccups.
MIN_STEPS = 20
# The first steps of a rank (process start, first batches, DDP's bucket rebuild, the other ranks still
# starting) are left out of the comparison: this share of them, at least WARMUP_MIN_STEPS.
WARMUP_SHARE = 0.1
WARMUP_MIN_STEPS = 5
# A rank is told apart from the others only when its median exceeds theirs by at least this much:
# the step-to-step jitter of a rank on a shared host (timer, wake-up and scheduling noise, tenths of a
# millisecond: BENCHMARKS) moves single steps, and one preemption costs a time slice (CFS's minimum
# granularity, 0.75 ms and more), so a consistent difference under a millisecond is no evidence.
MIN_EXTRA_S = 1e-3
# ... and by at least this share of its step (differences of a few percent are what ranks on
# different cores, sockets and cache states show as a matter of course).
MIN_EXTRA_SHARE = 0.1
# The sign test across steps: the chance that ranks of one kind would show a difference at least
# this consistent (after a Bonferroni correction for choosing the worst of the ranks) must be below this:
# one symmetric job in a thousand may show a straggler by chance, never one in a handful of runs.
SIGNIFICANCE = 1e-3


# DDP times itself on a sample of iterations (the first ten, then every hundredth): its average is
# mostly start-up and its latest figure is one step. A difference or a wait it shows is evidence only
# beyond this many times the ranks' step-to-step jitter (the largest median absolute deviation of
# their steady step times; three of them are about two standard deviations of normal noise).
NOISE_MULTIPLE = 3.0


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median."""
    middle = median(values)
    return median(abs(value - middle) for value in values)


def step_jitter_s(timed: Iterable[Mapping[str, Any]]) -> float:
    """The ranks' step-to-step jitter: the largest MAD of their steady step times (0 where none is known)."""
    return max([mad(series[0]) for rank in timed if (series := step_series(rank)) is not None], default=0.0)


@dataclass(frozen=True)
class Exceeds:
    """One rank's per-step figure against the other ranks': by how much its median exceeds theirs,
    on how many steps, and how unlikely that consistency would be between ranks of one kind."""

    index: int  # which of the compared ranks
    median_s: float  # its median
    others_s: float  # the median of the others' medians
    extra_s: float  # median_s - others_s
    steps: int  # its latest steps compared, each with the same step of every other rank
    above: int  # of those, the fewest it exceeded against any one other rank
    p_value: float  # the sign tests' largest p, Bonferroni-corrected for choosing it among the ranks

    def holds(self, step_s: float) -> bool:
        """Measured evidence: a difference noise cannot make, on a step of ``step_s`` seconds."""
        return (self.extra_s >= max(MIN_EXTRA_S, MIN_EXTRA_SHARE * step_s) and self.p_value < SIGNIFICANCE)


def steady(values: Sequence[float]) -> list[float]:
    """A rank's per-step figures without its first steps (see :data:`WARMUP_SHARE`)."""
    skip = max(WARMUP_MIN_STEPS, math.ceil(WARMUP_SHARE * len(values)))
    return [float(value) for value in values[skip:]]


def step_series(rank: Mapping[str, Any]) -> tuple[list[float], list[float]] | None:
    """A rank's steady (step seconds, data-wait seconds) pairs, or None with under :data:`MIN_STEPS` of them."""
    steps, waits = steady(rank.get("step_times") or []), steady(rank.get("wait_times") or [])
    if len(steps) < MIN_STEPS or len(waits) != len(steps):
        return None
    return steps, waits


def worst(series: Sequence[Sequence[float]]) -> Exceeds | None:
    """The rank whose figure is largest (by median), against the others, with a sign test.

    Its latest steps are paired with the same steps of each other rank (the ranks of a synchronous
    job take their steps together; for independent ones any pairing will do). If every rank's steps
    came from one distribution, it would exceed another rank's step with probability 1/2 on each
    pair that differs; it must do so consistently against *every* other rank (the largest of those
    p-values counts), and that p is multiplied by the number of ranks, as it was chosen among them.
    """
    if len(series) < 2 or any(len(values) < MIN_STEPS for values in series):
        return None
    medians = [median(values) for values in series]
    index = max(range(len(series)), key=medians.__getitem__)
    count = min(len(values) for values in series)
    mine = series[index][len(series[index]) - count:]
    fewest, p_value = count, 0.0
    for other, values in enumerate(series):
        if other == index:
            continue
        pairs = list(zip(mine, values[len(values) - count:]))
        above = sum(a > b for a, b in pairs)
        differ = sum(a != b for a, b in pairs)
        fewest, p_value = min(fewest, above), max(p_value, binomial_tail(above, differ))
    others = median(value for other, value in enumerate(medians) if other != index)
    return Exceeds(index, medians[index], others, medians[index] - others, count, fewest,
                   min(1.0, len(series) * p_value))


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly."""
    if k <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / (1 << n)


def ddp_compute_s(ddp: Mapping[str, Any] | None) -> tuple[float, float] | None:
    """Seconds per step of a rank's own forward and backward passes as DDP timed them: (its average
    over the iterations DDP sampled, its latest sample); None without them. Unlike the all-reduce's
    times these do not include waiting for the other ranks."""
    if not ddp or not ddp.get("avg_backward_compute_time"):
        return None
    average = (int(ddp.get("avg_forward_compute_time") or 0) + int(ddp["avg_backward_compute_time"])) * NS
    latest = (int(ddp.get("forward_compute_time") or 0) + int(ddp.get("backward_compute_time") or 0)) * NS
    return average, latest if ddp.get("backward_compute_time") else average


def ddp_exposed_estimates_s(ddp: Mapping[str, Any] | None) -> list[float]:
    """Seconds per step DDP's all-reduce ran past the end of backward: its average and latest sample."""
    if not ddp:
        return []
    return [max(0.0, (int(ddp[f"{prefix}backward_comm_time"])
                      - int(ddp.get(f"{prefix}backward_compute_comm_overlap_time") or 0)) * NS)
            for prefix in ("avg_", "") if ddp.get(f"{prefix}backward_comm_time")]
