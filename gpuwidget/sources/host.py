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

Rates are deltas between ticks, so the first tick reports no rates.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

from gpuwidget.clock import now
from gpuwidget.sources.base import ErrorLog, SourceError


class HostSource:
    """Reads the host and the current process tree; one batched psutil pass per tick."""

    name = "host"

    def __init__(self, pid: int | None = None, per_core: bool = True) -> None:
        self._log = ErrorLog(self.name)
        self.errors: list[SourceError] = self._log.errors
        self._process = psutil.Process(pid if pid is not None else os.getpid())
        self._per_core = per_core
        self._children: dict[int, tuple[psutil.Process, float]] = {}
        self._last_time: float | None = None
        self._last_proc_cpu: float | None = None
        self._last_disk: tuple[float, float] | None = None
        self._last_net: tuple[float, float] | None = None
        # Prime psutil's per-call deltas so the first read reports since construction.
        psutil.cpu_percent(percpu=per_core)
        psutil.cpu_times_percent()
        self._disabled: set[str] = set()

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
        self._read_process(values, elapsed)
        self._read_memory(values)
        self._read_io(values, elapsed)
        return values

    def close(self) -> None:
        self._children.clear()

    # One try per group: a platform without a counter loses that group, not the tick.
    def _guard(self, group: str, exc: BaseException) -> None:
        self._disabled.add(group)
        self._log.record(f"{group} metrics unavailable: {exc}")

    def _read_cpu(self, values: dict[str, float]) -> None:
        if "cpu" in self._disabled:
            return
        try:
            if self._per_core:
                cores = psutil.cpu_percent(percpu=True)
                for i, util in enumerate(cores):
                    values[f"cpu.core{i}.util"] = util
                values["cpu.util"] = sum(cores) / len(cores) if cores else 0.0
            else:
                values["cpu.util"] = psutil.cpu_percent()
            iowait = getattr(psutil.cpu_times_percent(), "iowait", None)
            if iowait is not None:
                values["cpu.iowait"] = iowait
        except Exception as exc:  # noqa: BLE001 - a source never raises into the sampler
            self._guard("cpu", exc)

    def _read_process(self, values: dict[str, float], elapsed: float | None) -> None:
        if "process" in self._disabled:
            return
        try:
            with self._process.oneshot():
                times = self._process.cpu_times()
                values["proc.rss"] = float(self._process.memory_info().rss)
                children = self._process.children(recursive=True)
            own = times.user + times.system
            if elapsed and self._last_proc_cpu is not None:
                values["proc.cpu"] = 100.0 * (own - self._last_proc_cpu) / elapsed
            self._last_proc_cpu = own
            workers_cpu = self._children_cpu(children)
            values["proc.workers"] = float(len(self._children))
            if elapsed:
                values["proc.workers_cpu"] = 100.0 * workers_cpu / elapsed
        except psutil.Error as exc:
            self._guard("process", exc)

    def _children_cpu(self, children: list[psutil.Process]) -> float:
        """CPU seconds the child processes used since the previous tick."""
        used = 0.0
        seen: dict[int, tuple[psutil.Process, float]] = {}
        for child in children:
            known = self._children.get(child.pid)
            # Reuse the Process object we already have: it remembers the create time,
            # so a recycled pid is not mistaken for the old child.
            proc = known[0] if known is not None and known[0].is_running() else child
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue  # exited between listing and reading
            total = times.user + times.system
            previous = known[1] if known is not None and known[0] is proc else 0.0
            used += max(0.0, total - previous)
            seen[child.pid] = (proc, total)
        self._children = seen
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

    def _read_io(self, values: dict[str, float], elapsed: float | None) -> None:
        if "io" in self._disabled:
            return
        try:
            disk = psutil.disk_io_counters()
            net = psutil.net_io_counters()
        except Exception as exc:  # noqa: BLE001
            self._guard("io", exc)
            return
        if disk is not None:
            current = (float(disk.read_bytes), float(disk.write_bytes))
            if elapsed and self._last_disk is not None:
                values["disk.read"] = max(0.0, current[0] - self._last_disk[0]) / elapsed
                values["disk.write"] = max(0.0, current[1] - self._last_disk[1]) / elapsed
            self._last_disk = current
        if net is not None:
            current = (float(net.bytes_recv), float(net.bytes_sent))
            if elapsed and self._last_net is not None:
                values["net.recv"] = max(0.0, current[0] - self._last_net[0]) / elapsed
                values["net.sent"] = max(0.0, current[1] - self._last_net[1]) / elapsed
            self._last_net = current


def _affinity() -> set[int]:
    """The CPUs this process may run on (what DataLoader workers can actually use)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(psutil.cpu_count() or 1))


def usable_cpu_count() -> int:
    """Cores this process may use, honouring affinity masks (containers, taskset)."""
    return max(1, len(_affinity()))
