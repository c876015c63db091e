"""rank-straggler: one training process is slower than the others, and in a synchronous step they wait for it.

Data-parallel ranks meet in a collective every step (DDP's gradient all-reduce): the slowest rank sets
everyone's pace and the others spend the difference waiting inside the collective. So each rank's
step time alone looks alike; what differs is the time a rank spends on its *own* work, its step time
less the time it waited for the others:

- where DDP's logging data is there, the waiting is measured: all-reduce time left after backward
  (``_ranks.ddp_exposed_comm_s``; its first iterations, where a rank also waits for the others to
  *start*, are no straggling and are kept out);
- without it, if the ranks ran in lockstep (median step times within ``LOCKSTEP_TOLERANCE``), a rank
  waited at least as long as the slowest loader's extra data wait over its own;
- ranks that do not synchronise (independent processes) waited for nobody: their step times compare
  as they are, and the bound is the contract's current step time over the median step time.

A rank whose own work takes ``1 / RELATIVE_SCORE`` times the others' median, and at least
``MIN_EXTRA_SHARE`` of a step more than they, is named, with its cause
where one was measured: its loader's data wait, its GPU's clock slowdowns (NVML, per GPU), or its
host run delay (waiting for a core).
"""

from __future__ import annotations

from typing import Any

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.loader import CONTENTION_DELAY_FRACTION
from gpuwidget.advice.rules._ranks import ddp_exposed_comm_s, median, rank_label, ranks
from gpuwidget.advice.rules.gpu_throttled import THROTTLED_SHARE
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "rank-straggler"
# NVIDIA's straggler detection (nvidia-resiliency-ext) scores a rank's performance relative to the best
# rank, 1.0 best; its Lightning callback flags a rank below 0.7 by default. Here the reference is the
# other ranks' median, so one fast outlier does not make everyone a straggler.
RELATIVE_SCORE = 0.7
# Ranks whose median step times agree within this share ran in lockstep (a collective every step).
LOCKSTEP_TOLERANCE = 0.1
# Above this gain bound the finding is critical.
CRITICAL_BOUND = 1.5
# The straggler's extra work must be at least this share of its step: differences of a fraction of a
# millisecond on a short step are noise (timer and scheduler jitter), whatever their ratio.
MIN_EXTRA_SHARE = 0.1
# A measured cause is named when it accounts for at least this share of the straggler's extra time
# (the rest is noise of a shared machine or unmeasured work); the suggestion says how much it explains.
CAUSE_SHARE = 1 / 3


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    timed = [rank for rank in ranks(workload)
             if (rank.get("step_time_p50_s") or 0) > 0 and (rank.get("steps") or 0) > 1]
    if len(timed) < 2:
        return None
    steps = [float(rank["step_time_p50_s"]) for rank in timed]
    waits = [_data_wait_s(rank) for rank in timed]
    lockstep = max(steps) <= min(steps) * (1 + LOCKSTEP_TOLERANCE)
    own = [step - _collective_wait_s(rank, step, waits, lockstep) for rank, step in zip(timed, steps)]
    slow = max(range(len(timed)), key=own.__getitem__)
    others = [value for index, value in enumerate(own) if index != slow]
    reference = median(others)
    if own[slow] <= 0 or reference / own[slow] >= RELATIVE_SCORE:
        return None
    if own[slow] - reference < MIN_EXTRA_SHARE * steps[slow]:
        return None
    straggler = timed[slow]
    extra = own[slow] - reference
    current = steps[slow] if not lockstep else max(steps)
    bound = current / max(current - extra, 1e-9)
    who = rank_label(straggler)
    others_wait = median([wait for index, wait in enumerate(waits) if index != slow])
    cause, evidence_cause, advice = _cause(straggler, waits[slow], others_wait, extra, summary, timed)
    evidence: dict[str, Any] = {
        "straggler": straggler.get("rank"), "pid": straggler.get("pid"), "gpu": straggler.get("gpu"),
        "ranks": len(timed), "lockstep": lockstep,
        "own_time_ms_by_rank": {rank_label(rank): round(value * 1e3, 2) for rank, value in zip(timed, own)},
        "step_time_ms_by_rank": {rank_label(rank): round(value * 1e3, 2) for rank, value in zip(timed, steps)},
        "data_wait_ms_by_rank": {rank_label(rank): round(value * 1e3, 2) for rank, value in zip(timed, waits)},
        "relative_score": round(reference / own[slow], 3), **evidence_cause,
    }
    waiting = (f"the other {len(timed) - 1} rank(s) wait about {extra * 1e3:.1f} ms per step for it in the "
               "collective" if lockstep else f"it runs {own[slow] / reference:.1f}x slower than the others")
    return Finding(
        rule=RULE,
        severity="critical" if bound >= CRITICAL_BOUND else "warn",
        title=f"{who.capitalize()} is a straggler: {own[slow] * 1e3:.1f} ms of its own work per step against "
              f"{reference * 1e3:.1f} ms on the others ({cause})",
        evidence=evidence,
        suggestion=f"{who.capitalize()} takes {own[slow] * 1e3:.1f} ms per step for its own work, the others "
                   f"{reference * 1e3:.1f} ms (median), so {waiting}. {advice}",
        change={"rank": straggler.get("rank"), "cause": cause},
        code=_code(who, cause, straggler),
        expected_speedup=round(max(1.0, bound), 2),
    )


def _data_wait_s(rank: dict[str, Any]) -> float:
    """Seconds per step this rank waited for its own loader."""
    return float(rank.get("data_wait_fraction") or 0.0) * float(rank.get("step_time_p50_s") or 0.0)


def _collective_wait_s(rank: dict[str, Any], step: float, waits: list[float], lockstep: bool) -> float:
    """Seconds per step this rank waited for the others (see the module docstring)."""
    exposed = ddp_exposed_comm_s((rank.get("model") or {}).get("ddp"))
    if exposed is not None:
        return min(step, exposed)
    if lockstep:
        return max(waits) - _data_wait_s(rank)
    return 0.0


def _cause(rank: dict[str, Any], wait: float, others_wait: float, extra: float, summary: Summary,
           timed: list[dict[str, Any]]) -> tuple[str, dict[str, Any], str]:
    """(cause, its evidence, what to do), from what was measured for this rank."""
    if extra > 0 and wait - others_wait >= CAUSE_SHARE * extra:
        loader: dict[str, Any] = next(iter(rank.get("loaders") or []), {})
        workers = (loader.get("settings") or {}).get("num_workers")
        name = f" ({loader['name']})" if loader.get("name") else ""
        return ("its data loader", {"data_wait_ms": round(wait * 1e3, 2), "num_workers": workers,
                                    "others_data_wait_ms": round(others_wait * 1e3, 2)},
                f"It waits {wait * 1e3:.1f} ms per step for its DataLoader{name} against {others_wait * 1e3:.1f} ms "
                f"on the others ({(wait - others_wait) * 1e3:.1f} of its {extra * 1e3:.1f} ms extra): give its loader "
                f"more workers (num_workers={workers} now) or check that its shard "
                "is not larger or slower to read than the others' (storage, sample sizes).")
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
    return ("cause not measured", {},
            "Nothing measured here explains it (not its loader's data wait, its GPU's clocks or its host): compare "
            "what it is given (shard size, sequence lengths, a different GPU model) and profile that rank.")


def _code(who: str, cause: str, rank: dict[str, Any]) -> str:
    lines = [f"# {who} is the straggler ({cause})."]
    if cause == "its data loader":
        loader: dict[str, Any] = next(iter(rank.get("loaders") or []), {})
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
