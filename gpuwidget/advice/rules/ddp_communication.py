"""ddp-communication: DistributedDataParallel's gradient all-reduce is not hidden behind the backward pass.

DDP groups gradients into buckets and all-reduces each bucket as soon as its gradients are ready,
so communication runs while backward still computes (Li et al., "PyTorch Distributed", VLDB 2020).
Its own logging data (``model._get_ddp_logging_data()``) times both: the all-reduce that runs past
the end of backward (``backward_comm_time - backward_compute_comm_overlap_time``, see
``_ranks.ddp_timings``) is time every step waits on the network. Many tiny buckets pay a
fixed latency per all-reduce; fewer all-reduces per optimizer step (``no_sync()`` with gradient
accumulation) pay it less often.

With several ranks the rule judges the rank that waited least: a straggler's late arrival shows up
as communication time on every *other* rank (that is ``rank-straggler``'s finding), while the
straggler itself waits only for the transfer. Where ``rank-straggler`` measured a straggler, only the
straggler is judged, and never for more than the step less the straggler's extra time: each measured
second has one explanation.

DDP times its all-reduce on a sample of iterations (the first ten, then every hundredth). The probe
keeps each sampled iteration's figures, and a typical step's all-reduce is the median of those that
describe typical steps (``_ranks.typical_ddp_step``); one iteration alone is a noisy figure. An
exposed all-reduce within the ranks' own step-to-step jitter (``SKEW_MULTIPLE`` times
``_ranks.step_jitter_s``) is the early rank waiting for the late one's random delay, which no bucket
setting removes, and is not named. Where every rank's figures of the same sampled iterations are known
(three or more typical ones after start-up), the skew is left out instead of guarded against: in each
iteration the rank that waited least after its backward arrived last and waited for no other rank,
only for the transfer, so the rule judges that rank's wait in the iteration of median wait
(``_ranks.last_arrivals``), whatever the jitter. On a loaded host, a job whose step is almost all
all-reduce has steps as jittery as its all-reduce; the jitter then says nothing about skew.
"""

from __future__ import annotations

import math
from typing import TypedDict, cast

from gpuwidget.advice.code import model_code
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.rules._ranks import (
    DdpTiming,
    last_arrivals,
    processes_with_models,
    rank_label,
    ranks,
    step_jitter_s,
    typical_ddp_step,
)
from gpuwidget.advice.rules.rank_straggler import find as find_straggler
from gpuwidget.facts import DdpFacts, MachineFacts, ModelFacts, RankEntry, Summary, WorkloadFacts

RULE = "ddp-communication"
# All-reduce left exposed after backward, as a share of the step, worth saying: PyTorch's profiler
# flags DataLoader time above 5% of a step; communication counts from twice that, as some exposed
# all-reduce (the last bucket's) is unavoidable.
EXPOSED_COMM_SHARE = 0.10
# Above this share of the step the finding is critical.
CRITICAL_COMM_SHARE = 0.30
# torch's default bucket_cap_mb (torch.nn.parallel.DistributedDataParallel).
DEFAULT_BUCKET_CAP_MB = 25
# Buckets smaller than this on average mean many all-reduces each paying its latency.
SMALL_BUCKET_BYTES = 1 << 20
# Gradient accumulation: sync once every K micro-batches, K chosen to bring the exposed share under
# this target, at most MAX_ACCUMULATION (larger K changes the optimisation more than the speed).
ACCUMULATION_TARGET_SHARE = 0.05
MAX_ACCUMULATION = 8
# Two ranks whose arrival at the all-reduce varies independently by a median absolute deviation m
# (a standard deviation of about 1.5 m) arrive apart by a standard deviation of about 2.1 m, and the
# early one waits for the late one about 0.84 m on average: an exposed all-reduce of at most the
# jitter itself is what random skew alone makes.
SKEW_MULTIPLE = 1.0
NS = 1e-9


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    processes = _processes(summary, workload)
    if any(timing is None for _, _, _, timing in processes):
        return None  # a rank whose DDP figures describe no typical step: nothing to judge it by
    step_jitter = step_jitter_s(ranks(workload))
    judged = [figures for figures in (_figures(model.get("ddp"), step, who, step_jitter, timing)
                                      for model, step, who, timing in processes) if figures is not None]
    straggler = find_straggler(workload)
    arrivals = last_arrivals([rank for rank in ranks(workload) if (rank.get("model") or {}).get("ddp")])
    compared = 0
    if straggler is not None:  # the others' waiting is the straggler's; it waited for nobody
        found, timed = straggler
        who = rank_label(timed[found.index])
        judged = [_capped(figures, found.step_s - found.extra_s) for figures in judged if figures["who"] == who]
    elif arrivals is not None:  # the last rank to arrive in each timed iteration: no skew in its wait
        index, timing, compared = arrivals
        model, step, who, _ = processes[index]
        figures = _figures(model.get("ddp"), step, who, step_jitter, timing)
        judged = [{**figures, "skew_free": True}] if figures is not None else []
    if not judged:
        return None
    figures = min(judged, key=lambda f: f["exposed_share"])  # the rank that waited least (see above)
    share = figures["exposed_share"]
    if share < EXPOSED_COMM_SHARE:
        return None
    if not figures["skew_free"] and figures["exposed_s"] < SKEW_MULTIPLE * figures["noise_s"]:
        return None
    ddp: DdpFacts = figures["ddp"]
    names = [model.get("name") for model, _, _ in processes_with_models(summary, workload) if model.get("ddp")]
    name = names[0] if names and all(n == names[0] for n in names) else None
    keywords, reasons = _changes(ddp, figures)
    accumulate = min(MAX_ACCUMULATION, max(2, math.ceil(share / ACCUMULATION_TARGET_SHARE)))
    step, exposed = figures["step_s"], figures["exposed_s"]
    exposed_ms, step_ms = exposed * 1e3, step * 1e3
    evidence: dict[str, object] = {
        "judged": figures["who"], "world_size": ddp.get("world_size"),
        "exposed_comm_ms": round(exposed_ms, 2), "step_time_ms": round(step_ms, 2),
        "exposed_comm_share": round(share, 3),
        "backward_comm_ms": round(int(ddp.get("avg_backward_comm_time", 0)) * NS * 1e3, 2),
        "backward_compute_ms": round(int(ddp.get("avg_backward_compute_time", 0)) * NS * 1e3, 2),
        "forward_compute_ms": round(int(ddp.get("avg_forward_compute_time", 0)) * NS * 1e3, 2),
        "buckets": figures["buckets"], "bucket_cap_mb": round(int(ddp.get("bucket_cap_bytes", 0)) / 2**20, 3),
        "mean_bucket_kb": round(figures["mean_bucket_bytes"] / 1024, 1),
        "gradient_as_bucket_view": ddp.get("gradient_as_bucket_view"), "static_graph": ddp.get("static_graph"),
        "find_unused_parameters": ddp.get("find_unused_parameters"),
        "step_jitter_ms": round(figures["noise_s"] * 1e3, 3), "iterations_compared": compared,
    }
    who = (f"{figures['who']}, the last rank to arrive, in the median of {compared} iterations DDP timed"
           if compared else figures["who"])
    sentences = [f"{exposed_ms:.1f} ms of each {step_ms:.1f} ms step ({share:.0%}) waits for DDP's gradient "
                 f"all-reduce after backward has finished ({who}, world size {ddp.get('world_size')})."]
    sentences += reasons
    if ddp.get("world_size") == 1:
        sentences.append("With a world size of 1 there is no other rank to exchange gradients with: until more "
                         "processes are launched, training the unwrapped module (model.module) skips this cost.")
    sentences.append(f"With gradient accumulation, skip the all-reduce on {accumulate - 1} of every {accumulate} "
                     f"micro-batches with model.no_sync(): the exposed {exposed_ms:.1f} ms is then paid once "
                     f"per {accumulate} batches (keep the effective batch size in mind for the learning rate).")
    return Finding(
        rule=RULE,
        severity="critical" if share >= CRITICAL_COMM_SHARE else "warn",
        title=f"{share:.0%} of each step waits for DDP's gradient all-reduce",
        evidence=evidence,
        suggestion=" ".join(sentences),
        change={**keywords, "no_sync_accumulation_steps": accumulate},
        code=_code(name, keywords, accumulate),
        expected_speedup=round(max(1.0, step / max(step - exposed, 1e-9)), 2),
    )


class DdpFigures(TypedDict):
    """One process's all-reduce per step, as judged (:func:`_figures`): seconds, and its buckets' sizes."""

    ddp: DdpFacts
    who: str
    exposed_s: float  # all-reduce after backward had finished
    step_s: float
    exposed_share: float  # exposed_s / step_s
    noise_s: float  # the ranks' step jitter
    skew_free: bool  # the wait of the last rank to arrive: no other rank's delay in it
    buckets: int
    mean_bucket_bytes: float
    total_bytes: int


def _processes(summary: Summary, workload: WorkloadFacts
               ) -> list[tuple[ModelFacts, float | None, str, DdpTiming | None]]:
    """(model, median step s, who, DDP's figures of a typical step) of every process whose DDP model the
    probes saw (``_ranks.typical_ddp_step``; None: no figure describes a typical step)."""
    listed = [rank for rank in ranks(workload) if (rank.get("model") or {}).get("ddp")]
    if not listed and (workload.get("model") or {}).get("ddp"):
        listed = [RankEntry(model=workload.get("model"), step_time_p50_s=summary.get("step_time_p50"))]
    found: list[tuple[ModelFacts, float | None, str, DdpTiming | None]] = []
    for rank in listed:
        who = rank_label(rank) if "pid" in rank or "rank" in rank else "this process"
        found.append((cast(ModelFacts, rank["model"]), rank.get("step_time_p50_s"), who, typical_ddp_step(rank)))
    return found


def _figures(ddp: DdpFacts | None, step_s: float | None, who: str, noise_s: float,
             timing: DdpTiming | None) -> DdpFigures | None:
    """Per-step figures of one process, in seconds; None without DDP's timings."""
    if ddp is None or timing is None:
        return None
    exposed = timing.exposed_s
    if step_s and exposed >= step_s:
        # More all-reduce than its median step holds (a sampled iteration DDP timed past its steps'
        # median, on a busy host): a typical step waits at most the step less its compute.
        exposed = step_s - timing.compute_s
        if exposed <= 0:
            return None
    step = step_s if step_s else timing.compute_s + exposed
    if step <= 0:
        return None
    sizes = list(ddp.get("rebuilt_bucket_sizes") or ddp.get("bucket_sizes") or [])
    total = int(ddp.get("total_parameter_size_bytes") or sum(sizes))
    return {"ddp": ddp, "who": who, "exposed_s": exposed, "step_s": step, "exposed_share": exposed / step,
            "noise_s": noise_s, "skew_free": False, "buckets": len(sizes),
            "mean_bucket_bytes": total / len(sizes) if sizes else 0.0, "total_bytes": total}


def _capped(figures: DdpFigures, most_s: float) -> DdpFigures:
    """The figures with the exposed all-reduce no longer than ``most_s`` (the rest is explained elsewhere)."""
    exposed = max(0.0, min(figures["exposed_s"], most_s))
    return {**figures, "exposed_s": exposed, "exposed_share": exposed / figures["step_s"]}


def _changes(ddp: DdpFacts, figures: DdpFigures) -> tuple[FindingChange, list[str]]:
    """The DDP(...) keywords to change, and why, in figures."""
    keywords: FindingChange = {}
    reasons: list[str] = []
    cap_mb = int(ddp.get("bucket_cap_bytes", 0)) / 2**20
    if figures["buckets"] > 1 and figures["mean_bucket_bytes"] < SMALL_BUCKET_BYTES and cap_mb < DEFAULT_BUCKET_CAP_MB:
        after = max(1, math.ceil(figures["total_bytes"] / (DEFAULT_BUCKET_CAP_MB * 2**20)))
        keywords["bucket_cap_mb"] = DEFAULT_BUCKET_CAP_MB
        reasons.append(f"Its {figures['buckets']} buckets hold {figures['mean_bucket_bytes'] / 1024:.0f} KB each "
                       f"(bucket_cap_mb={cap_mb:g}): every all-reduce pays its own latency; bucket_cap_mb="
                       f"{DEFAULT_BUCKET_CAP_MB} (torch's default) makes {after} of them.")
    if not ddp.get("gradient_as_bucket_view"):
        keywords["gradient_as_bucket_view"] = True
        reasons.append(f"gradient_as_bucket_view=True lets gradients live in the buckets, saving a copy of all "
                       f"{figures['total_bytes'] / 2**20:.1f} MB of gradients each step (and that memory).")
    if ddp.get("find_unused_parameters") and not ddp.get("unused_parameter_size"):
        keywords["find_unused_parameters"] = False
        reasons.append("find_unused_parameters=True walks the autograd graph every step, yet no parameter went "
                       "unused: turn it off.")
    if not ddp.get("static_graph"):
        keywords["static_graph"] = True
        reasons.append("If every step uses the same parameters in the same order, static_graph=True lets DDP "
                       "fix the bucket order and skip per-step bookkeeping.")
    return keywords, reasons


def _code(name: str | None, keywords: FindingChange, accumulate: int) -> str:
    listed = "".join(f", {key}={value!r}" for key, value in keywords.items())
    lines = ["from torch.nn.parallel import DistributedDataParallel",
             model_code(name, "{model} = DistributedDataParallel({model}.module, device_ids={model}.device_ids"
                        + listed + ")  # on every rank",
                        "where you wrap the model in DistributedDataParallel")] if keywords else []
    lines += [f"# Gradient accumulation: all-reduce once every {accumulate} micro-batches.",
              "# import contextlib",
              "# for i, (x, y) in enumerate(loader):",
              f"#     sync = (i + 1) % {accumulate} == 0",
              f"#     with contextlib.nullcontext() if sync else {name or 'model'}.no_sync():",
              f"#         loss_fn({name or 'model'}(x), y).backward()",
              "#     if sync:",
              "#         optimizer.step()",
              "#         optimizer.zero_grad()"]
    return "\n".join(lines)
