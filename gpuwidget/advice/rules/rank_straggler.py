"""rank-straggler: one training process is slower than the others, and in a synchronous step they wait for it.

Data-parallel ranks meet in a collective every step (DDP's gradient all-reduce): the slowest rank sets
everyone's pace and the others spend the difference waiting inside the collective. So each rank's
step time alone looks alike; a straggler shows in what it does before it arrives, and it is named only
where that was measured, step by step or by DDP itself, never from a difference of noisy figures:

- its data wait: every rank's wait for its own loader is timed on every step. The rank that waits
  most is the straggler when its median wait exceeds the others' by a difference noise cannot make
  (``_ranks.MIN_EXTRA_S``, ``_ranks.MIN_EXTRA_SHARE`` of the step) on a consistent majority of its
  steps (a sign test across steps, ``_ranks.SIGNIFICANCE``);
- its own forward and backward passes, as DDP times them (``_ranks.ddp_timings``, which leave
  the waiting out): larger than every other rank's by such a difference, and by more than the
  ranks' step jitter allows (``_ranks.NOISE_MULTIPLE``: DDP's figures are a step or a few), in DDP's
  average *and* in its latest sample, both describing typical steps of every rank
  (``_ranks.ddp_timings``); the difference counts only as far as every other rank's all-reduce ran
  past its backward (they were measured waiting for it: on a clean straggler the two agree up to the
  noise of the ranks' figures, so the smaller is the delay that reached them);
- its own time per step outside the collective: its median step less its data wait and less the
  all-reduce DDP measured after its backward (the time it waited for the others), compared the same
  way in those of its figures that describe typical steps of it (its average is mostly start-up, when
  it may have waited for the others to start), and confirmed by its stack samples (``loop_waits``: a
  wait outside the model's work taking more of its steps than the others' do, by a part of that extra
  time). This is where a rank's work outside the forward and backward shows (a slower node's Python,
  a fetch of its own, logging on one rank): the others wait for it in the all-reduce. DDP times a
  step or a few, and which rank reaches the all-reduce last varies from step to step on a symmetric
  job, so DDP's figures alone are no evidence of it;
- ranks that do not synchronise (independent processes: no DDP model, and median step times apart
  by more than ``LOCKSTEP_TOLERANCE``) waited for nobody: their step times compare as they are, with the same
  tests, and the rank must also score under ``RELATIVE_SCORE`` against the others.

The gain is bounded by what was measured: the job's step time over the step less the straggler's
measured extra time. Its cause, where one was measured: its loader's data wait, its GPU's clock
slowdowns (NVML, per GPU), or its host run delay (waiting for a core).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.loader import CONTENTION_DELAY_FRACTION
from gpuwidget.advice.rules._ranks import (
    MIN_EXTRA_S,
    MIN_EXTRA_SHARE,
    NOISE_MULTIPLE,
    Exceeds,
    ddp_timings,
    median,
    rank_label,
    ranks,
    step_jitter_s,
    step_series,
    worst,
)
from gpuwidget.advice.rules.gpu_throttled import THROTTLED_SHARE
from gpuwidget.facts import LoaderFacts, MachineFacts, RankEntry, Summary, WorkloadFacts
from gpuwidget.probes.origin import place as site_place

RULE = "rank-straggler"
# NVIDIA's straggler detection (nvidia-resiliency-ext) scores a rank's performance relative to the best
# rank, 1.0 best; its Lightning callback flags a rank below 0.7 by default. Here the reference is the
# other ranks' median, so one fast outlier does not make everyone a straggler.
RELATIVE_SCORE = 0.7
# Ranks whose median step times agree within this share ran in lockstep (a collective every step).
LOCKSTEP_TOLERANCE = 0.1
# Above this gain bound the finding is critical.
CRITICAL_BOUND = 1.5
# A measured cause is named when it accounts for at least this share of the straggler's extra time
# (the rest is noise of a shared machine or unmeasured work); the suggestion says how much it explains.
CAUSE_SHARE = 1 / 3
# What was measured, where it is the rank's own time outside the collective (the others' wait, DDP's figures).
OWN_TIME = "own time outside the all-reduce (DDP)"


@dataclass
class Straggler:
    """A straggler and what was measured of it: its extra seconds per step and the job's step."""

    index: int  # among the timed ranks
    extra_s: float
    step_s: float  # the step the gain is judged on: the job's (lockstep) or its own
    measured: str  # what differs: "data wait", "forward and backward (DDP)", "step time"
    mine_s: float
    others_s: float
    evidence: Mapping[str, object] = field(default_factory=dict)


def find(workload: WorkloadFacts) -> tuple[Straggler, list[RankEntry]] | None:
    """The straggler with its measured evidence, and the ranks compared; None where none is measured.

    ``ddp-communication`` calls it too: the seconds the other ranks wait for a straggler are this
    finding's, not the all-reduce's (one explanation per measured second).
    """
    timed = [(rank, series) for rank in ranks(workload) if (series := step_series(rank)) is not None]
    if len(timed) < 2:
        return None
    entries = [rank for rank, _ in timed]
    steps = [median(series[0]) for _, series in timed]
    if synchronous(entries) or max(steps) <= min(steps) * (1 + LOCKSTEP_TOLERANCE):
        waits = [series[1] for _, series in timed]
        found = (_by_data_wait(waits, max(steps)) or _by_ddp_compute(entries, max(steps))
                 or _by_own_time(entries, steps, [median(wait) for wait in waits], max(steps)))
    else:
        found = _by_step_time([series[0] for _, series in timed], steps)
    return (found, entries) if found is not None else None


def synchronous(entries: list[RankEntry]) -> bool:
    """Every rank trains a DistributedDataParallel model: they meet in its all-reduce every step, whatever
    their step-time medians say on a busy host."""
    return all((entry.get("model") or {}).get("ddp") for entry in entries)


def _by_data_wait(waits: list[list[float]], job_step: float) -> Straggler | None:
    compared = worst(waits)
    if compared is None or not compared.holds(job_step):
        return None
    return Straggler(compared.index, compared.extra_s, job_step, "data wait", compared.median_s, compared.others_s,
                     _sign_test(compared))


def _by_ddp_compute(entries: list[RankEntry], job_step: float) -> Straggler | None:
    # Both of DDP's figures (average and latest sample) must describe typical steps on every rank.
    timings = [{timing.which: timing for timing in ddp_timings(entry)} for entry in entries]
    if any(set(timing) != {"average", "latest"} for timing in timings):
        return None
    index = max(range(len(timings)), key=lambda i: timings[i]["average"].compute_s)
    others = [timing for i, timing in enumerate(timings) if i != index]
    mine = timings[index]
    waited = min(timing.exposed_s for other in others for timing in other.values())
    # What reached the others is no more than they were measured waiting for it (see OwnTime.reached_s).
    extra = min(waited, min(mine[which].compute_s - max(other[which].compute_s for other in others)
                            for which in ("average", "latest")))
    if extra < max(MIN_EXTRA_S, MIN_EXTRA_SHARE * job_step, NOISE_MULTIPLE * step_jitter_s(entries)):
        return None
    return Straggler(index, extra, job_step, "forward and backward (DDP)", mine["average"].compute_s,
                     median(other["average"].compute_s for other in others),
                     {"ddp_compute_ms_by_sample": {which: round(mine[which].compute_s * 1e3, 2)
                                                   for which in ("average", "latest")},
                      "others_waited_ms": round(waited * 1e3, 2)})


@dataclass(frozen=True)
class OwnTime:
    """What ``_by_own_time`` judges, each gate's figure beside its bound (``benchmarks/ddp_straggler.py``
    prints them): the rank with the most own time per step outside the collective, by how much, and
    what the others were measured waiting and what its stack samples put outside the model's work."""

    index: int
    extra_s: float  # its own time less the most any other rank spends, in the figures shown
    floor_s: float  # what noise can make: MIN_EXTRA_S, MIN_EXTRA_SHARE of the step, NOISE_MULTIPLE x jitter
    waited_s: float  # the least any other rank was measured in the all-reduce after its backward
    stalled_extra_s: float  # its stack samples' top wait per step less the most of any other rank's
    shown: tuple[str, ...]  # DDP's figures compared ("average", "latest")
    own_s: tuple[dict[str, float], ...]  # every rank's own time by figure

    @property
    def reached_s(self) -> float:
        """The extra time per step that reached the others: its extra, and no more than they were measured
        waiting. The two agree on a clean straggler (one rank's own time is the others' wait) up to the
        noise of the ranks' step medians, so neither alone is the figure: a wait shorter than the extra
        bounds it, a wait that is no straggler's leaves it under the floor."""
        return min(self.extra_s, self.waited_s)

    @property
    def holds(self) -> bool:
        return (self.reached_s >= self.floor_s
                and self.stalled_extra_s >= max(MIN_EXTRA_S, CAUSE_SHARE * self.reached_s))


def own_time(entries: list[RankEntry], steps: list[float], waits: list[float], job_step: float) -> OwnTime | None:
    """Each rank's own time per step outside the collective (step less data wait less the all-reduce DDP
    measured after its backward), in each of DDP's figures (average, latest) that describe a typical step
    of it, for the rank with the most of it against every other rank; None where DDP's figures are missing."""
    # The others' figures all count: a rank that waits for a straggler spends its whole step in the
    # all-reduce, and its sampled steps then read as longer than typical. The straggler's own only where
    # typical: its average is mostly start-up, when it may have waited for the others to start.
    every = [{timing.which: timing for timing in ddp_timings(entry, typical_only=False)} for entry in entries]
    known = [which for which in ("average", "latest") if all(which in timing for timing in every)]
    if not known:
        return None
    # DDP's figures are of a few sampled steps, the median of all of them: the difference can be under 0.
    own = [{which: max(0.0, steps[i] - waits[i] - min(steps[i], every[i][which].exposed_s)) for which in known}
           for i in range(len(entries))]

    def compared(index: int) -> tuple[float, list[str]]:
        typical = {timing.which for timing in ddp_timings(entries[index])}
        shown = [which for which in known if which in typical] or known
        others = [i for i in range(len(own)) if i != index]
        return min(own[index][which] - max(own[i][which] for i in others) for which in shown), shown

    index = max(range(len(own)), key=lambda i: compared(i)[0])
    extra, shown = compared(index)
    others = [i for i in range(len(own)) if i != index]
    stalled = [stalled_s(entry) for entry in entries]
    return OwnTime(
        index=index, extra_s=extra,
        floor_s=max(MIN_EXTRA_S, MIN_EXTRA_SHARE * job_step, NOISE_MULTIPLE * step_jitter_s(entries)),
        waited_s=min(min(steps[i], every[i][which].exposed_s) for i in others for which in shown),
        stalled_extra_s=stalled[index] - max(stalled[i] for i in others),
        shown=tuple(shown), own_s=tuple(own))


def _by_own_time(entries: list[RankEntry], steps: list[float], waits: list[float],
                 job_step: float) -> Straggler | None:
    """The rank whose own time outside the collective exceeds every other rank's, as far as the others
    were measured waiting for it in the all-reduce, by more than noise makes, where its own stack samples
    show it doing that much more outside the model's work (:func:`own_time`)."""
    judged = own_time(entries, steps, waits, job_step)
    if judged is None or not judged.holds:
        return None
    index, shown = judged.index, judged.shown
    others = [i for i in range(len(entries)) if i != index]
    return Straggler(index, judged.reached_s, job_step, OWN_TIME, judged.own_s[index][shown[0]],
                     median(judged.own_s[i][shown[0]] for i in others),
                     {"own_ms_by_sample": {which: round(judged.own_s[index][which] * 1e3, 2) for which in shown},
                      "others_waited_ms": round(judged.waited_s * 1e3, 2)})


def stalled_s(rank: RankEntry) -> float:
    """Seconds per step a rank's stack samples put in its top wait outside the model's work (0: none)."""
    wait = next(iter(rank.get("loop_waits") or []), None)
    return float(wait.get("share") or 0.0) * float(rank.get("step_time_p50_s") or 0.0) if wait else 0.0


def _by_step_time(series: list[list[float]], steps: list[float]) -> Straggler | None:
    compared = worst(series)
    if compared is None or not compared.holds(compared.median_s):
        return None
    if compared.others_s / compared.median_s >= RELATIVE_SCORE:
        return None
    return Straggler(compared.index, compared.extra_s, compared.median_s, "step time", compared.median_s,
                     compared.others_s, {**_sign_test(compared),
                                         "relative_score": round(compared.others_s / compared.median_s, 3)})


def _sign_test(compared: Exceeds) -> dict[str, float]:
    return {"steps_compared": compared.steps, "steps_above_others": compared.above,
            "p_value": float(f"{compared.p_value:.3g}")}


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    found = find(workload)
    if found is None:
        return None
    straggler, timed = found
    rank = timed[straggler.index]
    lockstep = straggler.measured != "step time"
    series = [step_series(entry) for entry in timed]
    steps = [median(s[0]) if s else 0.0 for s in series]
    waits = [median(s[1]) if s else 0.0 for s in series]
    extra = straggler.extra_s
    bound = straggler.step_s / max(straggler.step_s - extra, 1e-9)
    who = rank_label(rank)
    others_wait = median(wait for index, wait in enumerate(waits) if index != straggler.index)
    cause, evidence_cause, advice = _cause(rank, waits[straggler.index], others_wait, extra, summary, timed,
                                           straggler.measured)
    evidence: dict[str, object] = {
        "straggler": rank.get("rank"), "pid": rank.get("pid"), "gpu": rank.get("gpu"),
        "ranks": len(timed), "lockstep": lockstep, "measured": straggler.measured,
        "extra_ms": round(extra * 1e3, 2),
        "step_time_ms_by_rank": {rank_label(entry): round(value * 1e3, 2) for entry, value in zip(timed, steps)},
        "data_wait_ms_by_rank": {rank_label(entry): round(value * 1e3, 2) for entry, value in zip(timed, waits)},
        **straggler.evidence, **evidence_cause,
    }
    what = {"data wait": "it waits {mine} per step for data",
            "forward and backward (DDP)": "its forward and backward take {mine} per step",
            OWN_TIME: "it spends {mine} per step outside the all-reduce",
            "step time": "its steps take {mine}"}[straggler.measured]
    measured = what.format(mine=f"{straggler.mine_s * 1e3:.1f} ms")
    waiting = (f"the other {len(timed) - 1} rank(s) wait about {extra * 1e3:.1f} ms per step for it in the "
               "collective" if lockstep else f"it runs {straggler.mine_s / straggler.others_s:.1f}x slower "
               "than the others")
    return Finding(
        rule=RULE,
        severity="critical" if bound >= CRITICAL_BOUND else "warn",
        title=f"{who.capitalize()} is a straggler: {measured} against {straggler.others_s * 1e3:.1f} ms on the "
              f"others ({cause})",
        evidence=evidence,
        suggestion=f"{who.capitalize()}: {measured}, the others {straggler.others_s * 1e3:.1f} ms (median over "
                   f"their steps), so {waiting}. {advice}",
        change={"rank": rank.get("rank"), "cause": cause},
        code=_code(who, cause, rank),
        expected_speedup=round(max(1.0, bound), 2),
    )


def _cause(rank: RankEntry, wait: float, others_wait: float, extra: float, summary: Summary,
           timed: list[RankEntry], measured: str) -> tuple[str, dict[str, object], str]:
    """(cause, its evidence, what to do), from what was measured for this rank."""
    if extra > 0 and wait - others_wait >= CAUSE_SHARE * extra:
        loader: LoaderFacts = next(iter(rank.get("loaders") or []), LoaderFacts())
        workers = (loader.get("settings") or {}).get("num_workers")
        name = f" ({loader['name']})" if loader.get("name") else ""
        return ("its data loader", {"data_wait_ms": round(wait * 1e3, 2), "num_workers": workers,
                                    "others_data_wait_ms": round(others_wait * 1e3, 2)},
                f"It waits {wait * 1e3:.1f} ms per step for its DataLoader{name} against {others_wait * 1e3:.1f} ms "
                f"on the others ({(wait - others_wait) * 1e3:.1f} of its {extra * 1e3:.1f} ms extra): give its loader "
                f"more workers (num_workers={workers} now) or check that its shard "
                "is not larger or slower to read than the others' (storage, sample sizes).")
    stalled = next(iter(rank.get("loop_waits") or []), None)
    if stalled is not None and extra > 0 and stalled_s(rank) >= CAUSE_SHARE * extra:
        place = site_place(stalled)
        seconds = stalled_s(rank)
        measured_wait = {key: stalled.get(key) for key in ("function", "file", "line", "share")}
        return (f"it waits {place}", {"loop_wait": measured_wait, "loop_wait_ms": round(seconds * 1e3, 2)},
                f"Its stack samples put {seconds * 1e3:.1f} ms of each step {place}"
                + (f" (`{stalled['source']}`)" if stalled.get("source") else "")
                + ", outside the model's work: that is what the others wait for. Make that rank do less there, "
                "or do it on every rank alike, off the step (a background thread, every N steps).")
    gpu = rank.get("gpu")
    throttled = (summary.get("gpu_throttle_fraction_by_gpu") or {}).get(str(gpu)) if gpu is not None else None
    if throttled is not None and throttled >= THROTTLED_SHARE:
        return (f"its GPU {gpu} slowed its clocks", {"gpu_throttle_fraction": round(throttled, 3)},
                f"GPU {gpu} reported a clock slowdown (thermal, hardware or power brake) in {throttled:.0%} of its "
                "busy samples: the same work takes longer there. Have the machine's cooling and power looked at, "
                "or leave that GPU out (CUDA_VISIBLE_DEVICES).")
    delays = [float((r.get("host") or {}).get("run_delay_fraction") or 0.0) for r in timed if r is not rank]
    delay = float((rank.get("host") or {}).get("run_delay_fraction") or 0.0)
    if delay - median(delays) >= CONTENTION_DELAY_FRACTION:
        return ("its host process waited for a CPU", {"run_delay_fraction": round(delay, 3)},
                f"Its process was ready to run but waited for a core {delay:.0%} of the time: other processes hold "
                "its CPUs. Give each rank cores of its own (os.sched_setaffinity, numactl) or move the other jobs.")
    if measured == "forward and backward (DDP)":
        return ("its own forward and backward", {},
                "DDP's own timings show its forward and backward passes taking longer than the others' on the same "
                "model: compare what it is given (sequence lengths, batch contents, a different GPU model) and "
                "profile that rank.")
    return ("cause not measured", {},
            "Nothing measured here explains it (not its loader's data wait, its GPU's clocks or its host): compare "
            "what it is given (shard size, sequence lengths, a different GPU model) and profile that rank.")


def _code(who: str, cause: str, rank: RankEntry) -> str:
    lines = [f"# {who} is the straggler ({cause})."]
    if cause == "its data loader":
        loader: LoaderFacts = next(iter(rank.get("loaders") or []), LoaderFacts())
        workers = int((loader.get("settings") or {}).get("num_workers") or 0)
        lines += ["# In the training script, give every rank's DataLoader more workers, e.g.",
                  f"#     DataLoader(dataset, ..., num_workers={max(2, workers * 2)}, persistent_workers=True)",
                  "# and check each rank reads a shard of the same size (DistributedSampler splits evenly)."]
    elif cause.startswith("its GPU"):
        lines += [f"# Leave GPU {rank.get('gpu')} out until it is fixed, e.g.",
                  "#     CUDA_VISIBLE_DEVICES=<the other GPUs> torchrun --nproc_per_node=<their count> train.py"]
    elif cause.startswith("its host"):
        lines += ["# Give each rank cores of its own at the start of the training function, e.g.",
                  "#     cores = sorted(os.sched_getaffinity(0)); share = len(cores) // world_size",
                  "#     os.sched_setaffinity(0, cores[local_rank * share:(local_rank + 1) * share])",
                  "# or run fewer other jobs on this machine."]
    else:
        lines += ["# Profile that rank alone, e.g. with torch.profiler around a few of its steps."]
    return "\n".join(lines)
