"""periodic-stall: some steps take far longer than the rest, at a regular step interval.

That pattern is a checkpoint, a validation pass or a logging sync every N steps. The
time is spent in the loop's own code, between two ``next()`` calls, so it is never
charged to the DataLoader. The gain is bounded by the share of loop time the stalls take
(if they were made asynchronous or less frequent).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import model_name
from gpuwidget.advice.summary import primary_loader
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "periodic-stall"
# A stall is a step longer than OUTLIER_RATIO times the median step and longer than the
# median by STALL_MIN_S (so microsecond jitter in tiny loops never counts).
OUTLIER_RATIO = 3.0
STALL_MIN_S = 0.02
MIN_STALLS = 3
# The gaps between stalls must agree (within one step) this often, and at least
# MIN_AGREEING_GAPS times, to call them periodic.
PERIOD_AGREEMENT = 0.6
MIN_AGREEING_GAPS = 3
# Stalls costing less than this share of the loop are not worth a finding.
MIN_STALL_FRACTION = 0.05
# Suggest doing the periodic work this many times less often.
CHECKPOINT_SPACING = 5

CODE = """\
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


def find_stalls(step_times: list[float]) -> tuple[list[int], float]:
    """Indices of stalled steps and the median step time."""
    steps = np.asarray(step_times, dtype=float)
    if len(steps) < 2 * MIN_STALLS:
        return [], float(np.median(steps)) if len(steps) else 0.0
    median = float(np.median(steps))
    stalled = np.flatnonzero((steps > OUTLIER_RATIO * median) & (steps - median > STALL_MIN_S))
    return stalled.tolist(), median


def dominant_period(indices: list[int]) -> tuple[int, int, float]:
    """The most common gap between consecutive stalls (merging gaps within one step), how many
    gaps agree with it, and their share of all gaps."""
    gaps = np.diff(indices)
    counts = Counter(int(g) for g in gaps)
    best, agreeing = 0, 0
    for gap in counts:
        near = counts[gap] + counts.get(gap - 1, 0) + counts.get(gap + 1, 0)
        # Most agreeing gaps; between neighbours (9 and 10 both see the cluster), the exact mode.
        if (near, counts[gap]) > (agreeing, counts.get(best, 0)):
            best, agreeing = gap, near
    return best, agreeing, agreeing / len(gaps) if len(gaps) else 0.0


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    loader = primary_loader(workload)
    if loader is None:
        return None
    step_times = loader.get("step_times") or []
    stalls, median = find_stalls(step_times)
    if len(stalls) < MIN_STALLS:
        return None
    period, agreeing, agreement = dominant_period(stalls)
    if period < 2 or agreeing < MIN_AGREEING_GAPS or agreement < PERIOD_AGREEMENT:
        return None
    extra = float(sum(step_times[i] - median for i in stalls))
    loop = float(sum(step_times))
    fraction = extra / loop if loop > 0 else 0.0
    if fraction < MIN_STALL_FRACTION:
        return None
    stall = extra / len(stalls)
    return Finding(
        rule=RULE,
        severity="warn" if fraction < 0.25 else "critical",
        title=f"Every {period} steps the loop stalls for {stall:.2f} s",
        evidence={"period_steps": period, "stalls": len(stalls), "stall_s": round(stall, 3),
                  "median_step_s": round(median, 4), "stall_fraction": round(fraction, 3),
                  "period_agreement": round(agreement, 2)},
        suggestion=(f"{len(stalls)} steps took {stall:.2f} s longer than the usual {1000 * median:.1f} ms, about "
                    f"every {period} steps: {100 * fraction:.0f}% of the loop. That is the loop's own work "
                    "(a checkpoint, an evaluation or a synchronising log call), not data loading. Save "
                    "checkpoints less often or in a background thread, evaluate less often, and log "
                    "tensors without .item() on every step."),
        change={"every_n_steps": period * CHECKPOINT_SPACING, "off_training_thread": True},
        code=CODE.format(model=model_name(workload) or "model",
                         every=period * CHECKPOINT_SPACING),
        expected_speedup=round(1.0 / (1.0 - fraction), 2),
    )
