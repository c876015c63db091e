"""Facts the multi-process rules share: the training processes of a run and each one's model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from gpuwidget.facts import ModelFacts, RankEntry, Summary, WorkloadFacts
from gpuwidget.figures.summary import paired


def ranks(workload: WorkloadFacts) -> list[RankEntry]:
    """``workload["ranks"]``: one entry per training process (the kernel's own included when it
    trained), as the child probes report them (copies); empty for a single-process run."""
    listed = workload.get("ranks") or []
    return [cast(RankEntry, dict(rank)) for rank in listed if isinstance(rank, Mapping)]


def rank_label(rank: RankEntry) -> str:
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
# Sampled DDP iterations of typical steps whose median stands for a typical step's all-reduce
# (``typical_ddp_step``); with fewer, DDP's average and latest figures do. DDP's first ten sampled
# iterations are start-up (the ranks still arriving, buckets rebuilt) and do not count.
MIN_DDP_ITERATIONS = 3
DDP_STARTUP_ITERATIONS = 10


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median."""
    middle = median(values)
    return median(abs(value - middle) for value in values)


def step_jitter_s(timed: Iterable[RankEntry]) -> float:
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


def step_series(rank: RankEntry) -> tuple[list[float], list[float]] | None:
    """A rank's steady (step seconds, data-wait seconds) pairs, or None with under :data:`MIN_STEPS` of them."""
    steps, waits = paired(rank.get("step_times") or [], rank.get("wait_times") or [])
    steps, waits = steady(steps), steady(waits)
    if len(steps) < MIN_STEPS:
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


@dataclass(frozen=True)
class DdpTiming:
    """One of DDP's figures for a rank: its average over the sampled iterations, its latest sample, or one
    sampled iteration the probe read."""

    which: str  # "average", "latest" or "iteration N"
    compute_s: float  # forward + backward compute (no waiting for the other ranks)
    exposed_s: float  # all-reduce time after backward had finished


def ddp_timings(rank: RankEntry, typical_only: bool = True) -> list[DdpTiming]:
    """A rank's DDP figures that describe a typical step of its run; all of them where its steps are not
    known one by one (a single process's summary).

    DDP's average is mostly its first iterations (start-up, the others still starting) and its latest
    figure is one iteration, possibly a preempted one. A figure whose iteration (forward, backward and
    the all-reduce after it) took longer than the rank's median step and :data:`NOISE_MULTIPLE` times
    its jitter was no typical step of the run, and is not taken as evidence of one.
    """
    ddp = cast(Mapping[str, int], (rank.get("model") or {}).get("ddp"))  # its times under torch's names, in ns
    if not ddp:
        return []
    timings = [timing for which, prefix in (("average", "avg_"), ("latest", ""))
               if (timing := _ddp_timing(which, ddp, prefix)) is not None]
    return _typical(rank, timings) if typical_only else timings


def ddp_iterations(rank: RankEntry) -> list[DdpTiming]:
    """DDP's figures of each sampled iteration after start-up (:data:`DDP_STARTUP_ITERATIONS`) the probe
    read (``DdpFacts.iterations``) that describe a typical step of the rank (as :func:`ddp_timings`
    judges them), oldest first."""
    ddp = (rank.get("model") or {}).get("ddp") or {}
    timings = [timing for sample in ddp.get("iterations") or []
               if int(sample.get("iteration") or 0) > DDP_STARTUP_ITERATIONS
               and (timing := _ddp_timing(f"iteration {sample.get('iteration')}", sample, "")) is not None]
    return _typical(rank, timings)


def typical_ddp_step(rank: RankEntry) -> DdpTiming | None:
    """DDP's figures of a typical step of a rank: its typical sampled iteration of median all-reduce after
    backward where there are :data:`MIN_DDP_ITERATIONS` of them, else the one of its typical average and
    latest figures with the smaller all-reduce (None: no figure describes a typical step)."""
    iterations = sorted(ddp_iterations(rank), key=lambda timing: timing.exposed_s)
    if len(iterations) >= MIN_DDP_ITERATIONS:
        return iterations[(len(iterations) - 1) // 2]
    return min(ddp_timings(rank), key=lambda timing: timing.exposed_s, default=None)


def last_arrivals(entries: Sequence[RankEntry]) -> tuple[int, DdpTiming, int] | None:
    """DDP's figures of a typical step of a synchronous job with the ranks' skew left out: in each sampled
    iteration every rank timed as a typical step of its own (:func:`ddp_iterations`), the rank that
    waited least after its backward (the last to arrive: it waited for no other rank, only for the
    transfer), and of those iterations the one of median wait: (its rank's index in ``entries``, its
    figures, how many iterations were compared). None with fewer than two ranks or fewer than
    :data:`MIN_DDP_ITERATIONS` iterations every rank timed as typical."""
    if len(entries) < 2:
        return None
    by_rank = [{timing.which: timing for timing in ddp_iterations(entry)} for entry in entries]
    common = set(by_rank[0]).intersection(*by_rank[1:])
    if len(common) < MIN_DDP_ITERATIONS:
        return None
    last = sorted((min(((index, timings[which]) for index, timings in enumerate(by_rank)),
                       key=lambda item: item[1].exposed_s) for which in common),
                  key=lambda item: item[1].exposed_s)
    index, timing = last[(len(last) - 1) // 2]
    return index, timing, len(last)


def _ddp_timing(which: str, figures: Mapping[str, int], prefix: str) -> DdpTiming | None:
    if not figures.get(f"{prefix}backward_comm_time") and not figures.get(f"{prefix}backward_compute_time"):
        return None
    compute = (int(figures.get(f"{prefix}forward_compute_time") or 0)
               + int(figures.get(f"{prefix}backward_compute_time") or 0)) * NS
    exposed = max(0.0, (int(figures.get(f"{prefix}backward_comm_time") or 0)
                        - int(figures.get(f"{prefix}backward_compute_comm_overlap_time") or 0)) * NS)
    return DdpTiming(which, compute, exposed)


def _typical(rank: RankEntry, timings: list[DdpTiming]) -> list[DdpTiming]:
    series = step_series(rank)
    if series is None:
        return timings
    typical = median(series[0]) + NOISE_MULTIPLE * mad(series[0])
    return [timing for timing in timings if timing.compute_s + timing.exposed_s <= typical]
