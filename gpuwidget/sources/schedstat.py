"""Scheduler counters of one thread or process: time on a core and time runnable but waiting for one.

Linux keeps, per task, the nanoseconds it ran and the nanoseconds it sat in a run queue
waiting for a core (``/proc/<pid>/schedstat``, present where the kernel has
CONFIG_SCHED_INFO, i.e. every mainstream distribution; its fields are documented in the
kernel's Documentation/scheduler/sched-stats.rst). The rest of wall time the task slept
or was blocked (storage, network, a lock). ``/proc/<pid>/schedstat`` counts the process's
main thread; ``/proc/thread-self/schedstat`` the calling thread.

Each read is one small file: cheap enough for every sampler tick and for one DataLoader
step in eight. The figures of another task, read by the sampler thread over its interval, are as
fresh as that task's last scheduler event; a thread's own CPU across a short wait is read from its
CPU clock instead (:func:`thread_run_delay` says why). Where the file is missing (not Linux) the
reader returns None: the figure is absent, never 0.
"""

from __future__ import annotations

import contextlib
import os
import threading

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


class _OwnCounters:
    """The calling thread's schedstat file, kept open: it is read on the DataLoader probe's
    path, and a ``pread`` of the open file takes 2.5 us a call where opening, reading and
    closing it took 6.4 us (measured here; BENCHMARKS.md, overhead). Closed when its thread ends."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open(THREAD_SELF, os.O_RDONLY)
        except OSError:
            self.fd = None

    def __del__(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


_own = threading.local()


def _forget_in_child() -> None:
    """A forked child must not read its parent thread's file: the next read opens the child's own.
    (Checked at fork rather than with a getpid() on every read: a system call, 0.2 us here.)"""
    _own.__dict__.pop("counters", None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def thread_run_delay() -> float | None:
    """The calling thread's run delay in seconds (time runnable but waiting for a core), or None where
    the kernel has no schedstat. The kernel adds to it when the thread gets a core back: exact.

    Not its CPU time: schedstat's on-CPU figure, for the thread reading it, is brought up to date only
    at scheduler events, and the read itself is one, after the figure is printed, so each read returns
    the CPU time as of the thread's previous event. Two reads around a wait then measure the work
    *before* it: measured here (BENCHMARKS.md section 20k), a thread that slept 100 us between two
    reads, after 300 us of work, read 310 us of CPU; one that worked 100 us read 303 us. A thread's
    CPU across a wait is read from its own CPU clock (``time.thread_time()``), exact at the call."""
    counters = own_schedstat()
    return None if counters is None else counters[1]


def own_schedstat() -> tuple[float, float] | None:
    """The calling thread's schedstat, from its file kept open: (seconds on a core as of the thread's last
    scheduler event, seconds of run delay), or None where the kernel has none."""
    own: _OwnCounters | None = getattr(_own, "counters", None)
    if own is None:
        own = _own.counters = _OwnCounters()
    if own.fd is not None:
        try:
            fields = os.pread(own.fd, 128, 0).split(maxsplit=2)
        except OSError:
            return None
        if len(fields) >= 2:
            return int(fields[0]) * 1e-9, int(fields[1]) * 1e-9
    return None
