"""periodic-stall: some steps take far longer than the rest, at a regular step interval.

That pattern is a checkpoint, a validation pass or a logging sync every N steps. The
time is spent in the loop's own code, between two ``next()`` calls, so it is never
charged to the DataLoader. The gain is bounded by the share of loop time the stalls take
(if they were made asynchronous or less frequent).

Only the steady steps are read: the warm-up (gpuwidget.figures.warmup) is not a stall, and
counted as one its slow first steps broke the gaps of a real period (a 0.5 s pause every 25
steps agreed with its period only 53% of the time beside 8 warm-up steps). A period needs
regular gaps spread over the run: consecutive slow steps are one stall, not a period of one
step, and the stalls must recur over the run as often as their period says, so a noisy burst
(slow steps 60-75, 77 and 80) is not "every 2 steps".

What the stall is decides the code: the loop's stack samples between steps
(``WorkloadFacts["loop_waits"]``) or, without them, forward passes of the model beyond the
training steps, tell a checkpoint from an evaluation; the suggestion follows the larger
measured share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from gpuwidget.advice.evidence import enough_evidence
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import model_name
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.figures.summary import loop_step_times
from gpuwidget.figures.warmup import split_run
from gpuwidget.probes.origin import place
from gpuwidget.report import fmt_fraction, fmt_seconds

RULE = "periodic-stall"
# A stall is a step longer than OUTLIER_RATIO times the median step and longer than the
# median by STALL_MIN_S (so microsecond jitter in tiny loops never counts).
OUTLIER_RATIO = 3.0
STALL_MIN_S = 0.02
MIN_STALLS = 3
# The gaps between stalls must agree this often, and at least MIN_AGREEING_GAPS times, to
# call them periodic. A gap agrees with a period within PERIOD_SLACK of it (at least exactly):
# +-1 step at 10, +-2 at 25. A stall every N steps lands N steps apart, but a time-based one
# (a log every 30 s) drifts by a step; a fixed +-1 would merge gaps of 1, 2 and 3 into "2".
PERIOD_AGREEMENT = 0.6
MIN_AGREEING_GAPS = 3
PERIOD_SLACK = 0.1
# Periodic stalls recur over the run: at least this share of the stalls a period of N steps
# puts in the steady steps must be there. A burst of slow steps in a few places is not a period.
PERIOD_COVERAGE = 0.5
# On a loaded host (load 9 on this 2-core machine) steps of a 0.5 ms loop spike to 10-50 ms,
# beside stalls of 0.5 s: when all slow steps show no period, the stalls of at least this share
# of the typical large stall are judged alone (real stalls vary by +-50%, the spikes are a tenth).
LARGE_STALL_SHARE = 0.25
# Stalls costing less than this share of the loop are not worth a finding.
MIN_STALL_FRACTION = 0.05
# Suggest doing the periodic work this many times less often.
CHECKPOINT_SPACING = 5
# A loop wait whose samples were mostly (this share) inside torch's work ran the model between steps.
IN_MODEL_SHARE = 0.5

# What a stall's stack samples (loop_waits) say it is: a function whose name holds one of these
# (lower case), or a file of a serialisation library. Names, not paths: a path holds the user's
# folders ("tests/", "samples/") and torch's own data modules ("sampler.py").
CHECKPOINT_MARKS = ("save", "checkpoint", "state_dict", "serializ")
CHECKPOINT_FILES = ("serialization.py", "safetensors")
EVALUATION_MARKS = ("generate", "eval", "valid", "predict", "inference", "sample")
# Without stack samples: this many forward passes of the model with grad disabled per stall say the
# stall ran the model (an evaluation, or sampling with generate()). Where the forwards after the first
# steps were seen only in the windows opened at sampler ticks (training.forwards_sampled), one is enough:
# a window sees an evaluation only when a tick fell in it.
EVAL_FORWARDS_PER_STALL = 1

CHECKPOINT_CODE = """\
import threading

import torch


def save_in_background(module, path="checkpoint.pt", previous=None):
    \"\"\"Copy the weights now and write them from a thread, so the loop goes on meanwhile;
    the previous write is finished first, so no checkpoint is left half-written.\"\"\"
    snapshot = {{k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}}
    if previous is not None:
        previous.join()
    writer = threading.Thread(target=torch.save, args=(snapshot, path))
    writer.start()
    return writer

# In the loop, do the periodic work less often, and save off the training thread:
# if step % {every} == 0:
#     writer = save_in_background({model}, previous=writer)   # writer = None before the loop
# and writer.join() after it."""

EVALUATION_CODE = """\
import torch


def evaluate_without_grad(module, run, *args, **kwargs):
    \"\"\"Run the periodic evaluation (or sampling with generate()) in eval mode and without autograd,
    then put the module back in training mode.\"\"\"
    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode():
            return run(*args, **kwargs)
    finally:
        module.train(was_training)

# In the loop, evaluate {every_text} and on fewer batches or samples (a smaller
# max_new_tokens for generate()):
# if step % {every} == 0:
#     evaluate_without_grad({model}, your_evaluation)   # the function you call there now"""


def find_stalls(step_times: Sequence[float]) -> tuple[list[int], float]:
    """Indices of stalled steps and the median step time."""
    steps = np.asarray(step_times, dtype=float)
    if len(steps) < 2 * MIN_STALLS:
        return [], float(np.median(steps)) if len(steps) else 0.0
    median = float(np.median(steps))
    stalled = np.flatnonzero((steps > OUTLIER_RATIO * median) & (steps - median > STALL_MIN_S))
    return stalled.tolist(), median


def stall_starts(indices: Sequence[int]) -> list[int]:
    """The first step of each stall: consecutive slow steps are one stall (a burst), not a period of 1."""
    return [index for n, index in enumerate(indices) if n == 0 or index - indices[n - 1] > 1]


def agrees(gap: int, period: int) -> bool:
    return abs(gap - period) <= PERIOD_SLACK * period


def dominant_period(indices: Sequence[int]) -> tuple[int, int, float]:
    """The period of the stalls: the gap most others agree with (within PERIOD_SLACK of it), as
    the median of the gaps that agree; how many gaps agree, and their share of all gaps."""
    gaps = [int(g) for g in np.diff(indices)]
    counts = Counter(gaps)
    best, agreeing = 0, 0
    for gap in counts:
        near = sum(count for other, count in counts.items() if agrees(other, gap))
        # Most agreeing gaps; between neighbours (9 and 10 both see the cluster), the exact mode.
        if (near, counts[gap]) > (agreeing, counts.get(best, 0)):
            best, agreeing = gap, near
    if not gaps:
        return 0, 0, 0.0
    period = int(round(float(np.median([gap for gap in gaps if agrees(gap, best)]))))
    return period, agreeing, agreeing / len(gaps)


def periodic(slow: Sequence[int], steps: int) -> tuple[list[int], int, float] | None:
    """(the first step of each stall, the period, the share of gaps agreeing with it) where the
    slow steps recur regularly over the run, else None."""
    stalls = stall_starts(slow)
    if len(stalls) < MIN_STALLS:
        return None
    period, agreeing, agreement = dominant_period(stalls)
    if period < 2 or agreeing < MIN_AGREEING_GAPS or agreement < PERIOD_AGREEMENT:
        return None
    if len(stalls) < PERIOD_COVERAGE * steps / period:
        return None  # a burst in part of the run, not a period over it
    return stalls, period, agreement


def large_stalls(slow: Sequence[int], step_times: Sequence[float], median: float) -> list[int]:
    """The slow steps at least LARGE_STALL_SHARE of the typical large stall (the 75th percentile
    of the slow steps' excess over the median)."""
    if not slow:
        return []
    excess = np.asarray([step_times[i] - median for i in slow])
    typical = float(np.percentile(excess, 75))
    return [i for i, extra in zip(slow, excess.tolist()) if extra >= LARGE_STALL_SHARE * typical]


def wait_kind(wait: Mapping[str, Any]) -> str | None:
    """"checkpoint" or "evaluation" where a loop wait's function or file says so, or, for an evaluation,
    where its samples were mostly inside torch's work between steps (the model ran outside a training
    step: probes.stack's ``in_model``); else None (also what loop-waits reads to leave a stall's own
    waits to this rule)."""
    function, file = str(wait.get("function") or "").lower(), str(wait.get("file") or "").lower()
    if any(mark in function for mark in CHECKPOINT_MARKS) or any(
            file.endswith(name) or f"/{name}/" in file for name in CHECKPOINT_FILES):
        return "checkpoint"
    if any(mark in function for mark in EVALUATION_MARKS) or float(wait.get("in_model") or 0.0) >= IN_MODEL_SHARE:
        return "evaluation"
    return None


def stall_site(workload: WorkloadFacts, kind: str | None) -> str | None:
    """Where the stall's time went, in the user's terms (probes.origin.place): the loop wait of that
    kind with the most seconds, or None where the stack samples name none."""
    waits = [wait for wait in cast(Mapping[str, Any], workload).get("loop_waits") or []
             if kind is not None and wait_kind(wait) == kind and wait.get("file")]
    if not waits:
        return None
    return place(max(waits, key=lambda wait: float(wait.get("seconds") or 0.0)))


def stall_kind(workload: WorkloadFacts, stalls: int, steps: int) -> tuple[str | None, dict[str, float]]:
    """"checkpoint", "evaluation" or None (not measured), and the measurement that says so."""
    waits = cast(Mapping[str, Any], workload).get("loop_waits") or []
    seconds = {"checkpoint": 0.0, "evaluation": 0.0}
    for wait in waits:
        kind = wait_kind(wait)
        if kind is not None:
            seconds[kind] += float(wait.get("seconds") or 0.0)
    if any(seconds.values()):
        kind = max(seconds, key=lambda k: seconds[k])
        return kind, {f"{k}_s": round(v, 3) for k, v in seconds.items()}
    training = cast(Mapping[str, Any], workload).get("training") or {}
    evaluated = training.get("eval_forwards")
    if evaluated is not None and steps:
        needed = 1 if training.get("forwards_sampled") else EVAL_FORWARDS_PER_STALL * stalls
        measured: dict[str, float] = {"eval_forwards": int(evaluated)}
        return ("evaluation" if evaluated >= needed else None), measured
    return None, {}


@dataclass(frozen=True)
class PeriodicStall:
    """A periodic stall as measured over the loop's steady steps (what :func:`check` names)."""

    stalls: int  # stalls counted (consecutive slow steps are one)
    period: int  # steps
    agreement: float  # share of the gaps between stalls agreeing with the period
    extra_s: float  # seconds the slow steps took beyond the median step: the stalls' own time
    loop_s: float  # seconds of the steady steps
    median: float  # the median steady step, seconds
    warmup_steps: int

    @property
    def fraction(self) -> float:
        """The stalls' share of the loop's steady time."""
        return self.extra_s / self.loop_s if self.loop_s > 0 else 0.0

    @property
    def stall_s(self) -> float:
        """Seconds one stall took beyond the usual step."""
        return self.extra_s / self.stalls


def find(workload: WorkloadFacts) -> PeriodicStall | None:
    """The periodic stall of the loop's steady steps, or None: none regular enough, costing less than
    MIN_STALL_FRACTION of the loop, or a loop too short to name a cause (advice.evidence). Also what
    loop-waits reads to leave a stall's seconds to this rule."""
    times, steps = loop_step_times(workload)
    if not times or not enough_evidence(workload):
        return None
    split = split_run(times, steps)
    step_times = split.steady(times)
    slow, median = find_stalls(step_times)
    # Noise spikes among the stalls (a loaded host) break or blur the period: the large stalls
    # alone are judged too, and the more regular of the two wins (all slow steps on a tie).
    candidates = [(found, chosen) for chosen in (slow, large_stalls(slow, step_times, median))
                  if (found := periodic(chosen, len(step_times))) is not None]
    if not candidates:
        return None
    (stalls, period, agreement), slow = max(candidates, key=lambda candidate: candidate[0][2])
    stall = PeriodicStall(stalls=len(stalls), period=period, agreement=agreement,
                          extra_s=float(sum(step_times[i] - median for i in slow)), loop_s=float(sum(step_times)),
                          median=median, warmup_steps=split.steps)
    return stall if stall.fraction >= MIN_STALL_FRACTION else None


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    found = find(workload)
    if found is None:
        return None
    period, median, fraction, stall = found.period, found.median, found.fraction, found.stall_s
    steps = loop_step_times(workload)[1]
    kind, measured = stall_kind(workload, found.stalls, steps)
    every = period * CHECKPOINT_SPACING
    model = model_name(workload) or "model"
    evidence = {"period_steps": period, "stalls": found.stalls, "stall_s": round(stall, 3),
                "median_step_s": round(median, 4), "stall_fraction": round(fraction, 3),
                "period_agreement": round(found.agreement, 2), **measured}
    if found.warmup_steps:
        evidence["warmup_steps"] = found.warmup_steps
    site = stall_site(workload, kind)
    seen = (f"{found.stalls} steps took {fmt_seconds(stall)} longer than the usual {fmt_seconds(median)}, about "
            f"every {period} steps: {fmt_fraction(fraction)} of the loop. That is the loop's own work, not data "
            "loading" + (f" ({site})" if site else ""))
    if kind == "evaluation":
        what = ("most of it evaluation or sampling (the model ran between training steps). Evaluate less "
                "often, on fewer batches or shorter samples, in eval mode under torch.inference_mode().")
        code = EVALUATION_CODE.format(model=model, every=every, every_text=f"every {every} steps")
    elif kind == "checkpoint":
        what = ("most of it saving a checkpoint. Save less often, and write it from a background thread "
                "so the loop goes on meanwhile.")
        code = CHECKPOINT_CODE.format(model=model, every=every)
    else:
        what = ("a checkpoint, an evaluation or a synchronising log call. Save checkpoints less often or "
                "in a background thread, evaluate less often, and log tensors without .item() on every step.")
        code = CHECKPOINT_CODE.format(model=model, every=every)
    return Finding(
        rule=RULE,
        severity="warn" if fraction < 0.25 else "critical",
        title=f"Every {period} steps the loop stalls for {fmt_seconds(stall)}",
        evidence=evidence,
        suggestion=f"{seen}: {what}",
        change={"every_n_steps": every, "off_training_thread": kind != "evaluation", "stall": kind or "unknown"},
        code=code,
        expected_speedup=round(1.0 / (1.0 - fraction), 2),
    )
