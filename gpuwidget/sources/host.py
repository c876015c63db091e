"""Host metrics from psutil: CPU (total, per core, iowait), the kernel process tree, memory, disk, network.

Names and units (one flat mapping per tick):

=====================  ==========================================================
``cpu.util``           all cores, percent 0-100
``cpu.core{i}.util``   one core, percent 0-100
``cpu.iowait``         share of CPU time waiting on I/O, percent (Linux)
``proc.cpu``           this process, percent of one core (can exceed 100)
``proc.workers_cpu``   its child processes (DataLoader workers), percent of one core
``proc.workers``       number of live child processes
``proc.rss``           this process's resident memory, bytes
``mem.used``           host memory in use, bytes; ``mem.total`` bytes
``disk.read``          bytes/s, all disks; ``disk.write`` likewise
``net.recv``           bytes/s, all interfaces; ``net.sent`` likewise
=====================  ==========================================================

Rates are deltas between readings, so the first tick reports no rates. Two reads are
costly on a busy machine and change slowly, so they are refreshed less often than every
tick: the list of child processes (psutil walks every process on the host to find them)
and the disk/network counters (every disk is read). Between refreshes the last value is
reported again, so series stay continuous.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

from gpuwidget.clock import now
from gpuwidget.sources.base import ErrorLog, SourceError

# Seconds between scans for new child processes (their CPU is still read every tick).
CHILDREN_REFRESH_S = 1.0
# Seconds between disk/network counter reads (rates are averaged over this span), and between
# reads of host memory (which changes slowly and costs a parse of /proc/meminfo).
IO_REFRESH_S = 0.5


class HostSource:
    """Reads the host and the current process tree; one batched psutil pass per tick."""

    name = "host"

    def __init__(self, pid: int | None = None, per_core: bool = True, process: bool = True) -> None:
        self._log = ErrorLog(self.name)
        self.errors: list[SourceError] = self._log.errors
        self._process = psutil.Process(pid if pid is not None else os.getpid())
        self._per_core = per_core
        self._with_process = process
        self._workers = 0  # live child processes at the last reading
        self._children_listed = -float("inf")
        self._listed: list[psutil.Process] = []
        self._last_time: float | None = None
        self._last_proc_cpu: float | None = None
        self._children_total: float | None = None
        self._last_io: tuple[float, tuple[float, float] | None, tuple[float, float] | None] | None = None
        self._slow_values: dict[str, float] = {}  # I/O rates and memory, refreshed every IO_REFRESH_S
        self._last_cores: list[tuple[float, float, float]] | None = None
        self._disabled: set[str] = set()
        # Prime the CPU counters so the first read reports utilisation since construction.
        self._read_cpu({})

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": True,
            "cpu_count": psutil.cpu_count(logical=True),
            "cpu_affinity": len(_affinity()),
            "mem_total": psutil.virtual_memory().total,
            "pid": self._process.pid,
        }

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        t = now()
        elapsed = None if self._last_time is None else t - self._last_time
        self._last_time = t
        self._read_cpu(values)
        if self._with_process:
            self._read_process(values, elapsed, t)
        self._read_io(values, t)
        return values

    def close(self) -> None:
        self._listed = []

    # One try per group: a platform without a counter loses that group, not the tick.
    def _guard(self, group: str, exc: BaseException) -> None:
        self._disabled.add(group)
        self._log.record(f"{group} metrics unavailable: {exc}")

    def _read_cpu(self, values: dict[str, float]) -> None:
        """Utilisation per core and in all, and iowait, from one read of the CPU counters."""
        if "cpu" in self._disabled:
            return
        try:
            cores = [_cpu_split(times) for times in psutil.cpu_times(percpu=True)]
        except Exception as exc:  # noqa: BLE001 - a source never raises into the sampler
            self._guard("cpu", exc)
            return
        previous, self._last_cores = self._last_cores, cores
        if previous is None or len(previous) != len(cores):
            return  # the first read (or a CPU came online): no interval to divide by yet
        total_busy = total_wait = total_all = 0.0
        for i, ((busy, wait, everything), (busy0, wait0, everything0)) in enumerate(zip(cores, previous)):
            span = everything - everything0
            if self._per_core and span > 0:
                values[f"cpu.core{i}.util"] = 100.0 * max(0.0, busy - busy0) / span
            total_busy += max(0.0, busy - busy0)
            total_wait += max(0.0, wait - wait0)
            total_all += max(0.0, span)
        if total_all > 0:
            values["cpu.util"] = 100.0 * total_busy / total_all
            values["cpu.iowait"] = 100.0 * total_wait / total_all

    def _read_process(self, values: dict[str, float], elapsed: float | None, t: float) -> None:
        if "process" in self._disabled:
            return
        try:
            with self._process.oneshot():
                times = self._process.cpu_times()
                values["proc.rss"] = float(self._process.memory_info().rss)
            if t - self._children_listed >= CHILDREN_REFRESH_S:
                self._children_listed = t
                self._listed = self._list_children()
            children = self._listed
            own = times.user + times.system
            if elapsed and self._last_proc_cpu is not None:
                values["proc.cpu"] = 100.0 * (own - self._last_proc_cpu) / elapsed
            self._last_proc_cpu = own
            # Children that ended (DataLoader workers at the end of an epoch) are not listed any
            # more, but the kernel adds their whole CPU time to ours once they are reaped.
            reaped = getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
            workers_cpu = self._children_cpu(children, reaped)
            values["proc.workers"] = float(self._workers)
            if elapsed:
                values["proc.workers_cpu"] = 100.0 * workers_cpu / elapsed
        except psutil.Error as exc:
            self._guard("process", exc)

    def _list_children(self) -> list[psutil.Process]:
        """This process's descendants, reusing the Process objects already known.

        On Linux the kernel lists each thread's children in /proc/<pid>/task/<tid>/children,
        so finding them costs a few reads, where psutil reads every process on the host.
        """
        pids = _descendants(self._process.pid)
        if pids is None:
            return self._process.children(recursive=True)
        known = {p.pid: p for p in self._listed}
        listed = []
        for pid in pids:
            process = known.get(pid)
            if process is None:
                try:
                    process = psutil.Process(pid)
                except psutil.Error:
                    continue
            listed.append(process)
        return listed

    def _children_cpu(self, children: list[psutil.Process], reaped: float) -> float:
        """CPU seconds the child processes used since the previous tick.

        The children's total is what the live ones have used so far plus ``reaped``, the
        kernel's count for children that ended and were waited for. When a worker ends, its
        time moves from the first part to the second, so the total only grows by what was
        really used; a child too short-lived to be listed still counts, through ``reaped``.
        """
        live = 0.0
        running = 0
        for child in children:
            try:
                if not child.is_running():  # ended, or its pid was reused by another process
                    continue
                times = child.cpu_times()
            except psutil.Error:
                continue  # ended between listing and reading
            live += times.user + times.system
            running += 1
        self._workers = running
        total = live + reaped
        used = 0.0 if self._children_total is None else max(0.0, total - self._children_total)
        self._children_total = total
        return used

    def _read_memory(self, values: dict[str, float]) -> None:
        if "memory" in self._disabled:
            return
        try:
            memory = psutil.virtual_memory()
            values["mem.used"] = float(memory.total - memory.available)
            values["mem.total"] = float(memory.total)
        except Exception as exc:  # noqa: BLE001
            self._guard("memory", exc)

    def _read_io(self, values: dict[str, float], t: float) -> None:
        if "io" in self._disabled:
            return
        if self._last_io is None or t - self._last_io[0] >= IO_REFRESH_S:
            self._read_memory(self._slow_values)
            try:
                disk = psutil.disk_io_counters()
                net = psutil.net_io_counters()
            except Exception as exc:  # noqa: BLE001
                self._guard("io", exc)
                return
            current = (
                t,
                None if disk is None else (float(disk.read_bytes), float(disk.write_bytes)),
                None if net is None else (float(net.bytes_recv), float(net.bytes_sent)),
            )
            if self._last_io is not None:
                span = t - self._last_io[0]
                for names, new, old in ((("disk.read", "disk.write"), current[1], self._last_io[1]),
                                        (("net.recv", "net.sent"), current[2], self._last_io[2])):
                    if new is not None and old is not None:
                        for name, a, b in zip(names, new, old):
                            self._slow_values[name] = max(0.0, a - b) / span
            self._last_io = current
        values.update(self._slow_values)


def _descendants(pid: int) -> list[int] | None:
    """Pids below ``pid`` from /proc/<pid>/task/*/children, or None where that file is missing."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # ended meanwhile
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children", "rb") as fh:
                    children = [int(child) for child in fh.read().split()]
            except OSError:
                continue
            found.extend(children)
            stack.extend(children)
    return found


def _cpu_split(times: Any) -> tuple[float, float, float]:
    """(busy, iowait, total) seconds of one core, counted as psutil.cpu_percent counts them:
    guest time is already inside user time, and iowait is not busy."""
    total = sum(times)
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    wait = getattr(times, "iowait", 0.0)
    return total - times.idle - wait, wait, total


def _affinity() -> set[int]:
    """The CPUs this process may run on (what DataLoader workers can actually use)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(psutil.cpu_count() or 1))


def usable_cpu_count() -> int:
    """Cores this process may use, honouring affinity masks (containers, taskset)."""
    return max(1, len(_affinity()))
