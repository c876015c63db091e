"""Host memory for a measurement on the CPU: how much a trial took at its peak, and how much is left.

A batch-size search on the CPU has no out-of-memory error to stop it: Linux overcommits,
so a size that does not fit is met by swapping or the OOM killer, not an exception. The
search therefore predicts each size's memory from the trials before it and stops short of
what the machine (or the container's memory limit) still has.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from gpuwidget.sources.cgroup import read_limits

STATUS = "/proc/self/status"
# Writing "5" here resets the process's peak resident set size (VmHWM) to its current size
# (Linux 4.0+, proc(5)), so each trial's own peak can be read back.
CLEAR_REFS = "/proc/self/clear_refs"


def available_bytes() -> int:
    """Memory this process may still take: what the OS has available, within the cgroup's limit."""
    available = int(psutil.virtual_memory().available)
    limit = read_limits().mem_limit
    if limit is not None:
        available = min(available, max(0, limit - resident_bytes()))
    return available


def resident_bytes() -> int:
    """This process's resident memory now."""
    return int(psutil.Process().memory_info().rss)


@dataclass
class PeakResident:
    """A block's resident memory: when it began, and at its peak (bytes; set when the block ends)."""

    before: int
    peak: int = 0


@contextmanager
def peak_resident() -> Iterator[PeakResident]:
    """Measure the block's peak resident memory.

    Where the peak cannot be reset (not Linux), the process's lifetime peak is used: an
    over-estimate, which only makes a search stop earlier.
    """
    with contextlib.suppress(OSError), open(CLEAR_REFS, "w", encoding="ascii") as refs:
        refs.write("5")
    growth = PeakResident(resident_bytes())
    try:
        yield growth
    finally:
        growth.peak = max(growth.before, _peak_rss())


def _peak_rss() -> int:
    try:
        with open(STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
