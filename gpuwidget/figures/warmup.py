"""Warm-up apart: the steps before a training loop's steady state, told from its step times.

Every loop's first steps are slow for reasons that do not recur: CUDA and cuDNN start-up
(context, kernels loaded, cuDNN's benchmark autotuning each new shape), ``torch.compile``
(seconds per graph), DataLoader workers starting, first-epoch caching, lazy imports and
allocator growth. Counted with the rest they distort every step statistic and read as
stalls, so they are split off here, from the start of the run, and reported on their own.

The split is robust to what follows the warm-up (periodic stalls, noise): the steady
reference is the 75th percentile of the run's latter half, which a warm-up shorter than half
the run cannot reach, and only a run of slow steps from the very first one can be warm-up; a stall
later in the run never is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuwidget.facts import LoaderFacts, WorkloadFacts

# A step is slow when it takes more than WARMUP_FACTOR times the typical steady step and more than
# WARMUP_MIN_S beyond it. The factor is periodic-stall's outlier ratio (rules.periodic_stall
# .OUTLIER_RATIO), so every step at the start of a run that could be taken for a stall is
# warm-up instead. It sits far from both sides: steady steps of an in-memory loop on this
# 2-core machine beside other engineers' jobs stay within 2x of their median, while torch's
# first steps take 18-28 ms against a 1.2 ms median (15-25x) and torch.compile's first steps
# take seconds against milliseconds (100-1000x).
WARMUP_FACTOR = 3.0
# The absolute floor: a busy host can take one scheduler time slice (3-4 ms at the kernel's
# defaults) from any step; a step slower by less than that is noise, not warm-up. It is below
# periodic-stall's STALL_MIN_S (20 ms): no slow first step escapes both.
WARMUP_MIN_S = 0.005
# The warm-up ends at the first STEADY_RUN consecutive steps at speed. One fast step between
# slow ones is not yet steady: torch.compile recompiles on the second shape it sees
# ("automatic dynamic" shapes) and cuDNN's benchmark mode autotunes each new shape, so early
# slow steps come interleaved with fast ones. Not more than two: a stall every third step
# stays a stall for periodic-stall rather than becoming an endless warm-up.
STEADY_RUN = 2
# A steady state is longer than its warm-up: a run whose slow start lasts more than this share
# of its steps (or leaves fewer than MIN_STEADY_STEPS after it) never reached one.
MAX_WARMUP_SHARE = 0.5
MIN_STEADY_STEPS = 3

# Causes the panel names, from the workload's facts (warmup_cause).
COMPILATION = "compilation"
CUDA_START = "CUDA start-up"
WORKER_START = "worker start-up"


@dataclass(frozen=True)
class WarmupSplit:
    """The warm-up at the start of a run of step times."""

    steps: int  # warm-up steps (all of them when all_warmup)
    seconds: float  # their total time
    first_steady: int  # index of the first steady step (== steps)
    all_warmup: bool = False  # the run never reached a steady state
    steady_median: float | None = None  # median step time after the warm-up, seconds

    def steady(self, values: Sequence[float]) -> list[float]:
        """The steady part of a series aligned with the step times (the steps themselves, their waits)."""
        return list(values[self.first_steady:])


def split_warmup(step_times: Sequence[float]) -> WarmupSplit:
    """The warm-up of a run from its step times (seconds per step, in order).

    A run with no slow start (or too few steps to judge: under MIN_STEADY_STEPS + 1) has no
    warm-up. Otherwise the warm-up is the steps from the first one up to the first
    STEADY_RUN consecutive steady steps; when that leaves no steady state (more than
    MAX_WARMUP_SHARE of the steps, under MIN_STEADY_STEPS after it, or the last steps still
    far faster than the latter half), the whole run is warm-up.
    """
    times = np.asarray(step_times, dtype=float)
    count = len(times)
    if count <= MIN_STEADY_STEPS:
        median = float(np.median(times)) if count else None
        return WarmupSplit(0, 0.0, 0, steady_median=median)
    # The typical steady step: the latter half's 75th percentile (a step that was taken), not
    # its median, as a steady loop can alternate between fast and slow steps (two workers hand
    # over batches in pairs: 5 ms, 90 ms, 5 ms...) and then its slow steps are typical too.
    reference = float(np.percentile(times[count // 2:], 75, method="lower"))
    slow = _slow(times, reference)
    if not slow[0]:
        if _still_warming(times, reference):
            return _all(times)
        return WarmupSplit(0, 0.0, 0, steady_median=float(np.median(times)))
    first_steady = next((i for i in range(1, count - STEADY_RUN + 1) if not slow[i:i + STEADY_RUN].any()), count)
    if (first_steady > MAX_WARMUP_SHARE * count or count - first_steady < MIN_STEADY_STEPS
            or _still_warming(times, reference)):
        return _all(times)
    return WarmupSplit(first_steady, float(times[:first_steady].sum()), first_steady,
                       steady_median=float(np.median(times[first_steady:])))


def split_run(step_times: Sequence[float], steps: int | None = None) -> WarmupSplit:
    """:func:`split_warmup` of a loop's step times where they start at its first step: a bounded
    history (probes.torch_data.STEP_HISTORY) that lost the first of ``steps`` holds no warm-up
    (its first steps are the middle of the run)."""
    if steps is not None and len(step_times) < steps - 1:  # the open last step may be missing
        return WarmupSplit(0, 0.0, 0, steady_median=float(np.median(step_times)) if len(step_times) else None)
    return split_warmup(step_times)


def _slow(times: np.ndarray, reference: float) -> np.ndarray:
    return (times > WARMUP_FACTOR * reference) & (times - reference > WARMUP_MIN_S)


def _still_warming(times: np.ndarray, reference: float) -> bool:
    """Each of the last MIN_STEADY_STEPS steps is far faster than the latter half's median: the
    latter half was itself still warming up (a warm-up longer than half the run), so no steady
    state was seen. Each, not their median: two workers hand over batches in pairs, so a steady
    loop can alternate between fast and slow steps."""
    tail = float(np.max(times[-MIN_STEADY_STEPS:]))
    return bool(_slow(np.asarray([reference]), tail)[0])


def _all(times: np.ndarray) -> WarmupSplit:
    return WarmupSplit(len(times), float(times.sum()), len(times), all_warmup=True)


def warmup_cause(split: WarmupSplit, workload: WorkloadFacts | None,
                 loader: LoaderFacts | None = None) -> str | None:
    """What the warm-up was, where the facts say (else None: the panel says "warm-up").

    ``model.compiled`` -> compilation; CUDA first used inside the watched cell (its memory
    peaks could not be reset at the start) -> CUDA start-up; a loader with workers whose
    warm-up steps were mostly spent waiting in ``next()`` -> worker start-up.
    """
    if not split.steps:
        return None
    workload = workload or {}
    causes = []
    if (workload.get("model") or {}).get("compiled"):
        causes.append(COMPILATION)
    cuda = workload.get("cuda") or {}
    if cuda.get("devices") and cuda.get("peak_since_cell_start") is False:
        causes.append(CUDA_START)
    if loader is not None and int((loader.get("settings") or {}).get("num_workers") or 0) > 0:
        waits = sum((loader.get("wait_times") or [])[:split.steps])
        if split.seconds > 0 and waits >= 0.5 * split.seconds:
            causes.append(WORKER_START)
    return " and ".join(causes) or None
