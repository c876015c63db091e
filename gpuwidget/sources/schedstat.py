"""Scheduler counters of one thread or process: time on a core and time runnable but waiting for one.

Linux keeps, per task, the nanoseconds it ran and the nanoseconds it sat in a run queue
waiting for a core (``/proc/<pid>/schedstat``, present where the kernel has
CONFIG_SCHED_INFO, i.e. every mainstream distribution; its fields are documented in the
kernel's Documentation/scheduler/sched-stats.rst). The rest of wall time the task slept
or was blocked (storage, network, a lock). ``/proc/<pid>/schedstat`` counts the process's
main thread; ``/proc/thread-self/schedstat`` the calling thread.

Each read is one small file: cheap enough for every sampler tick and for one DataLoader
step in eight. Where the file is missing (not Linux) the reader returns None: the figure is
absent, never 0.
"""

from __future__ import annotations

import os
import time

THREAD_SELF = "/proc/thread-self/schedstat"


def schedstat_path(pid: int) -> str:
    """The counters of ``pid``'s main thread."""
    return f"/proc/{pid}/schedstat"


def read_schedstat(path: str = THREAD_SELF) -> tuple[float, float] | None:
    """(seconds on a core, seconds runnable but waiting for a core) since the task started, or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 128).split()
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(fields) < 2:
        return None
    return int(fields[0]) * 1e-9, int(fields[1]) * 1e-9


def thread_counters() -> tuple[float, float | None]:
    """The calling thread's (CPU seconds, run-delay seconds); the delay is None where the
    kernel has no schedstat (then the CPU time is ``time.thread_time()``)."""
    counters = read_schedstat(THREAD_SELF)
    if counters is None:
        return time.thread_time(), None
    return counters
