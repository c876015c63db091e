"""loop-waits: the training loop waits in one function of the user's, outside the model's work.

The evidence is a statistical profile (``probes.stack``): the watched thread's stack, sampled at
each sampler tick, inside ``train.between`` spans (an optimizer step's end to the trained model's
next forward: where the loop fetches its next batch, logs, evaluates) and, inside the step, in a
function the loop called outside torch's work (nanoGPT fetches its next batch between a forward and
its backward), as a share of the samples inside the loop's steps. The function is named where the
user wrote it ("get_batch() (cell In [7], line 26)"), with the change that fits what it does:

* its line copies the same host tensors to the device at every step (``X.to(device)`` of a tensor
  the loop never reassigns): move them once, before the loop (the copies go entirely: at most
  ``1 / (1 - share)`` faster);
* its line copies other tensors to the device: copy from pinned memory with ``non_blocking=True``
  (the copy then overlaps the step);
* a function the user holds a name for: :class:`gpuwidget.prefetch.Prefetcher` rebinds that name to
  the same function run one call ahead on a background thread, same batches in the same order. One
  thread overlaps the fetch with the step but cannot make a step shorter than the longer of the two,
  so the bound is ``1 / max(share, 1 - share)``;
* otherwise (the loop's own line, a function no name of the user's holds): where it is, as a comment.

How it sits with the DataLoader rules: a wait inside a DataLoader's ``next()`` is theirs.
``dataloader-starved``, ``dataloader-cpu-bound`` and ``io-bound`` measure what the batch builders do
while the loop waits (workers, CPU, sleeping) and change the loader's settings, a better change than a
thread around a loader. So a function whose samples fall mostly inside ``loader.wait`` spans
(``in_loader`` at least :data:`IN_LOADER_MAX`) is never named here, whatever its share, and without
optimizer steps (the samples' basis is ``loader.wait`` itself) this rule stays silent: each measured
second gets one explanation. Nor is the wait of a straggling rank that the others wait for
(rank-straggler names it, with the rank). Time between steps outside ``next()`` (a batch function of
the user's, copies, logging) is this rule's, beside a DataLoader as well as without one.

How it sits with ``periodic-stall``: a checkpoint or an evaluation every N steps is also time between
steps, and that rule names it from the step times, as a stall with its period. Its seconds are that
rule's (:func:`stall_waits`: the function the stall spends them in; an evaluation is also the model
run between steps, ``periodic_stall.wait_kind``), and this rule names only waits the stall cannot
hold. A framework that runs the loop (Lightning's ``trainer.fit``, the HF Trainer) does its own work
between steps under the user's ``fit()`` line; those samples (``in_framework``) are no wait of the
user's loop, and that line is not named. Like the loop's other causes, nothing is named from a loop
shorter than the evidence gate (gpuwidget.advice.evidence: MIN_CAUSE_STEPS steady steps, MIN_CAUSE_LOOP_S).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwidget.advice.evidence import MIN_CAUSE_STEPS, enough_evidence
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import STARVED_WAIT_FRACTION
from gpuwidget.advice.rules import periodic_stall, rank_straggler
from gpuwidget.advice.rules.periodic_stall import PeriodicStall
from gpuwidget.facts import LoopWait, MachineFacts, StackFacts, Summary, WorkloadFacts
from gpuwidget.probes.origin import location as origin_location
from gpuwidget.probes.origin import place as origin_place
from gpuwidget.report import fmt_fraction, fmt_seconds

RULE = "loop-waits"
# A function is named when it holds at least this share of the loop's samples: the DataLoader rules'
# threshold for a starved loop (PyTorch's profiler flags DataLoader time above 5% of a step; 10% is
# worth acting on, above the timing noise of short cells), so both kinds of wait are named alike...
MIN_SHARE = STARVED_WAIT_FRACTION
# ...and when the share is at least the profiler's 5% with 95% confidence (the lower end of the
# Wilson interval of a binomial share): a function seen in 6 of 50 samples (12%) is named, in 5 of 50
# (10%, lower end 4.3%) it is not; 5 of 6 is.
PROFILER_SHARE = 0.05
CONFIDENCE_Z = 1.96
# Never from fewer samples in the function than this (a single sample is one tick's coincidence),
# nor from fewer of the loop's steps than any loop cause needs (gpuwidget.advice.evidence).
MIN_SAMPLES = 5
MIN_STEPS = MIN_CAUSE_STEPS
# Samples mostly inside a DataLoader's next() are the DataLoader rules' (see the module docstring).
IN_LOADER_MAX = 0.5
# A wait on the loop's own line with at least this share of its samples in a training framework's code
# (Lightning's loop under ``trainer.fit()``) is the framework's work between steps: no line of the user's.
IN_FRAMEWORK_MAX = 0.5
# At or above this share the finding is critical, as dataloader-starved's.
CRITICAL_SHARE = 0.4
PREFETCH_IMPORT = "from gpuwidget.prefetch import Prefetcher"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    stack = workload.get("stack_samples") or {}
    if (stack.get("steps") or 0) < MIN_STEPS or not enough_evidence(workload):
        return None
    loop_samples = int(stack.get("loop_samples") or 0)
    waits = [wait for wait in workload.get("loop_waits") or [] if (wait.get("in_loader") or 0.0) < IN_LOADER_MAX]
    stall = periodic_stall.find(workload)
    stalls = stall_waits(waits, stall, loop_samples, stack.get("loop_s")) if stall is not None else []
    straggler = rank_straggler.find(workload)
    straggling = straggler[1][straggler[0].index].get("loop_waits") if straggler is not None else None
    for wait in waits:
        if any(wait is theirs for theirs in stalls):
            continue  # a periodic evaluation or checkpoint: periodic-stall's seconds and advice
        if straggling and same_site(wait, straggling[0]):
            continue  # what a straggling rank does that the others wait for: rank-straggler's
        if wait.get("in_loop") and float(wait.get("in_framework") or 0.0) >= IN_FRAMEWORK_MAX:
            continue  # the framework's own loop between steps, under the user's fit() line: nothing to move
        if named(wait, loop_samples):
            return _finding(wait, stack)
    return None


def same_site(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two loop waits name the same function and line."""
    return all(a.get(key) == b.get(key) for key in ("function", "file", "line"))


def stall_waits(waits: Sequence[LoopWait], stall: PeriodicStall, loop_samples: int,
                loop_s: float | None = None) -> list[LoopWait]:
    """The waits that are a periodic stall's own time, which periodic-stall explains (see the module docstring).

    A wait can be the stall's when its samples fell in the slow steps, as the stall's do (``step_ratio``
    at least periodic-stall's OUTLIER_RATIO), or when the stall's seconds can hold it: the lower end of
    its share's confidence interval, over the seconds the samples' loop covers (``loop_s``, the stack
    samples' steps; the stall's own steady steps where not given), is at most the stalls' seconds.
    (Seconds, not shares: the two loops can differ by a stall, as when the last one comes after the
    last optimizer step, which no optimizer step span holds.) The steps come first: ticks at a fixed
    rate beside a stall at a fixed period alias, and a Lightning loop's sampling every 10 steps (74%
    of its time) read 33 of 35 samples in one run and 19 in another, more than the stall's seconds.
    Of those, the ones whose function says what the stall is (a checkpoint's, an evaluation's:
    periodic_stall.wait_kind) are; without such a name, the largest one is: each stall is one piece
    of work between two steps.
    """
    seconds = float(loop_s) if loop_s else stall.loop_s
    holdable = sorted((wait for wait in waits
                       if float(wait.get("step_ratio") or 0.0) >= periodic_stall.OUTLIER_RATIO
                       or share_lower_bound(int(wait.get("samples") or 0), loop_samples) * seconds <= stall.extra_s),
                      key=lambda wait: int(wait.get("samples") or 0), reverse=True)
    kinds = [wait for wait in holdable if periodic_stall.wait_kind(wait) is not None]
    return kinds or holdable[:1]


def named(wait: LoopWait | Mapping[str, Any], loop_samples: int) -> bool:
    """Enough evidence to name this wait: its share, its samples, and the share's lower confidence bound."""
    samples = int(wait.get("samples") or 0)
    return (samples >= MIN_SAMPLES and float(wait.get("share") or 0.0) >= MIN_SHARE
            and share_lower_bound(samples, loop_samples) >= PROFILER_SHARE)


def share_lower_bound(hits: int, total: int, z: float = CONFIDENCE_Z) -> float:
    """The lower end of the Wilson score interval for ``hits`` of ``total`` samples."""
    if total <= 0:
        return 0.0
    p = min(1.0, hits / total)
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return max(0.0, (centre - spread) / (1 + z * z / total))


def _finding(wait: LoopWait, stack: StackFacts) -> Finding:
    share = float(wait["share"])
    place = origin_place(wait)
    function = wait.get("function") or "<module>"
    own_line = function == "<module>" or bool(wait.get("in_loop"))  # a line of the loop itself
    name = None if own_line else wait.get("name")
    copy = wait.get("copy") or {}
    source = wait.get("source")
    measured = (f"Outside the model's forward, backward and optimizer step the loop spent {fmt_fraction(share)} "
                f"of its time "
                f"({fmt_seconds(wait.get('seconds'))} of {fmt_seconds(stack.get('loop_s'))}) "
                f"{place}" + (f": `{source}`" if source else "")
                + f" ({wait.get('samples')} of {stack.get('loop_samples')} stack samples).")
    overlap_bound = 1.0 / max(share, 1.0 - share)
    removal_bound = 1.0 / max(1e-9, 1.0 - share)
    tensors = ", ".join(copy.get("tensors") or [])
    if copy.get("same_each_step") and copy.get("once"):
        title = f"The loop copies {tensors} to the device at every step {place}: {fmt_fraction(share)} of its time"
        suggestion = (f"{measured} The same tensors cross to the device at every step; move them once, "
                      "before the loop (they must fit in the GPU's memory), and the line copies nothing.")
        code = (f"# {tensors} are the same tensors at every step: move them to the device once, before the loop\n"
                f"# (the copy {place} then returns them as they are).\n{copy['once']}")
        change: FindingChange = {"move_to_device_once": list(copy.get("tensors") or [])}
        gain = removal_bound
    elif copy.get("tensors"):
        title = f"The loop waits for copies to the device {place} {fmt_fraction(share)} of the time"
        rewritten = copy.get("rewritten")
        suggestion = (f"{measured} Copy from pinned memory with non_blocking=True, so the copy overlaps the step"
                      + (" instead of holding the loop." if rewritten else "; the line does already: fetch the "
                         "batch ahead, on a background thread."))
        pinned = f"# {place}: copy from pinned memory without blocking:\n#     {rewritten}" if rewritten else ""
        code = "\n".join(part for part in (pinned, _prefetch_code(name, place) if name else "") if part) or \
            f"# {place} waits for copies to the device: fetch the batch ahead, on a background thread."
        change = {"pin_memory": True, "non_blocking": True} if rewritten else {"prefetch": name}
        gain = overlap_bound
    elif name:
        title = f"The loop waits {place} {fmt_fraction(share)} of the time, outside the model's work"
        suggestion = (f"{measured} Fetch the next batch while the step computes: Prefetcher runs {function}() "
                      "one call ahead on a background thread and returns the same batches in the same order. "
                      "It gains where the function waits (storage, network, sleeping, torch's C code); Python "
                      "work inside it shares the interpreter with the loop.")
        code = _prefetch_code(name, place)
        change = {"prefetch": name}
        gain = overlap_bound
    else:
        where = "the loop's own line" if own_line else f"{function}(), which no name of yours holds,"
        title = f"The loop waits {place} {fmt_fraction(share)} of the time, outside the model's work"
        suggestion = (f"{measured} That is {where}: do it less often, or off the loop's thread, or ahead of "
                      "the step that needs it.")
        code = (f"# The loop waits {place} outside the model's work, {fmt_fraction(share)} of its time"
                + (f":\n#     {source}" if source else ".")
                + "\n# Do it less often (every N steps), on a background thread, or before the loop.")
        change = {}
        gain = removal_bound
    return Finding(
        rule=RULE,
        severity="critical" if share >= CRITICAL_SHARE else "warn",
        title=title,
        # Where, in the user's terms (probes.origin.location), as the title says it: not IPython's file names.
        evidence={"function": wait.get("function"), "at": origin_location(wait)}
        | {key: wait.get(key) for key in ("share", "seconds", "samples", "in_loader")}
        | ({"called_from": origin_place(called)} if (called := wait.get("called_from")) else {})
        | {"loop_samples": stack.get("loop_samples"), "basis": stack.get("basis"), "steps": stack.get("steps")},
        suggestion=suggestion,
        change=change,
        code=code,
        expected_speedup=round(max(1.0, gain), 2),
    )


def _prefetch_code(name: str, place: str) -> str:
    return (f"{PREFETCH_IMPORT}\n\n"
            f"# The loop waited {place}: fetch the next batch\n"
            "# on a background thread while the step computes. The same batches in the same order;\n"
            f"# {name}.close() stops it.\n"
            f"{name} = Prefetcher({name})")
