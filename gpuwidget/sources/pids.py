"""Which of the processes a GPU driver lists are ours, and whose numbering its pids are in.

This process's pids in nested PID namespaces, whether a driver's list is another namespace's (a
container seeing the host's numbering), and :class:`OwnProcesses`, "is this pid ours?" per tick.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

from gpuwidget.sources.lineage import ancestors

# A caller's ``pids`` function may walk the process table; ask it at most this often.
PIDS_REFRESH_S = 1.0
# Pids walked up from a GPU process (itself included) looking for this one: workers of workers.
ANCESTRY_DEPTH = 65

# This process's pid in each PID namespace it is nested in, outermost first ("NSpid:" line).
PROC_SELF_STATUS = "/proc/self/status"
# The process whose GPU memory is "ours" where it is not this one: the reader process
# (gpuwidget.sources.reader) reads the GPUs for its parent, and sets this to its pid.
WATCHED_PID: int | None = None


def namespace_pids(status_path: str | None = None) -> list[int]:
    """This process's pids from the NSpid line, outermost namespace first; [] where Linux doesn't say.

    More than one entry: this process runs in a nested PID namespace and the first entry is its pid
    where /proc was mounted from, the numbering a GPU driver uses when that is the host's.
    """
    try:
        with open(status_path or PROC_SELF_STATUS) as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def pid_visible(pid: int) -> bool:
    """Whether ``pid`` exists in this process's PID namespace (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's process: there, but not ours to signal
    return True


def foreign_pid_namespace(listed_pids: Iterable[int]) -> bool:
    """True when the driver's pids are not this namespace's: none of the processes it lists on a GPU
    exists here. GPU drivers (NVML, AMD's KFD) have no PID-namespace support: in a container they report
    host pids, so the container's own processes (this one included) are not recognisable by pid."""
    pids = [pid for pid in listed_pids if pid > 0]
    return bool(pids) and not any(pid_visible(pid) for pid in pids)


class OwnProcesses:
    """Answers "is this pid ours?" cheaply enough to ask every tick."""

    def __init__(self, pids: Callable[[], Iterable[int]] | None, report: Callable[[str], None]) -> None:
        self._pids = pids
        self._report = report
        self._given: frozenset[int] = frozenset()
        self._given_time = -math.inf
        watched = WATCHED_PID
        self._own = watched if watched is not None else os.getpid()
        # In a nested PID namespace whose outer /proc we see, the driver's number for us is the outermost.
        status = None if watched is None else f"/proc/{watched}/status"
        self._own_pids = {self._own, *namespace_pids(status)[:1]}
        self._verdicts: dict[int, bool] = {}

    def refresh(self, now: float) -> None:
        if self._pids is None:
            if len(self._verdicts) > 1024:  # pids get reused; forget old verdicts now and then
                self._verdicts.clear()
            return
        if now - self._given_time < PIDS_REFRESH_S:
            return
        self._given_time = now
        try:
            self._given = frozenset(int(pid) for pid in self._pids())
        except Exception as error:
            self._report(f"pids() raised {type(error).__name__}: {error}; keeping the last set")

    def __contains__(self, pid: int) -> bool:
        if self._pids is not None:
            return pid in self._given
        verdict = self._verdicts.get(pid)
        if verdict is None:
            verdict = self._verdicts[pid] = self._descends_from_us(pid)
        return verdict

    def _descends_from_us(self, pid: int) -> bool:
        """True for this process and its descendants (DataLoader workers and their children).

        Walking up from the few pids the driver lists is far cheaper than listing our descendants, which
        scans the whole process table.
        """
        return pid in self._own_pids or self._own in ancestors(pid, ANCESTRY_DEPTH)
