"""Host metrics from psutil and the kernel: CPU (total, per core, iowait), the process tree, pressure, memory, I/O.

Names and units (one flat mapping per tick):

===========================  ====================================================================
``cpu.util``                 all cores, percent 0-100
``cpu.core{i}.util``         one core, percent 0-100
``cpu.iowait``               share of CPU time waiting on I/O, percent (Linux)
``cpu.others``               other processes (outside this process tree) on the CPUs this process
                             may use, percent of one core (200 = two cores' worth)
``proc.cpu``                 this process, percent of one core (up to 100 x its usable CPUs)
``proc.run_delay``           this process's main thread (where a notebook cell's loop runs):
                             share of wall time it was runnable but waiting for a core, percent
``proc.workers_cpu``         its child processes (DataLoader workers), percent of one core
``proc.workers_run_delay``   the same children: time runnable but waiting for a core, summed,
                             percent of one core (300 = three workers each waiting all the time)
``proc.workers``             number of live child processes
``proc.rss``                 this process's resident memory, bytes
``psi.cpu_some``             pressure stall information: share of wall time some runnable task
                             on the host waited for a CPU, percent (/proc/pressure/cpu)
``psi.io_some``              likewise, some task waited on I/O, percent (/proc/pressure/io)
``psi.cgroup_cpu_some``      ``psi.cpu_some`` of this process's own cgroup (v2 ``cpu.pressure``)
``mem.used``                 host memory in use, bytes; ``mem.total`` bytes
``disk.read``                bytes/s, all disks; ``disk.write`` likewise
``net.recv``                 bytes/s, all interfaces; ``net.sent`` likewise
===========================  ====================================================================

What the process tree did comes from the kernel's per-task counters, not host totals:
time on a core (CPU) and time runnable but queued for a core (run delay, from
``/proc/<pid>/schedstat``; see gpuwidget.sources.schedstat); the rest of wall time it slept
or was blocked. Where a platform lacks a counter (no schedstat, no PSI) its figure is
absent, never 0.

Rates are deltas between readings, so the first tick reports no rates; process rates are
only formed over at least MIN_RATE_INTERVAL_S (CPU times advance in 10 ms clock ticks, so a
rate over 1 ms could read 1000% of a core), and never exceed what the usable CPUs allow.
Some reads are costly on a busy machine and change slowly, so they are refreshed less often
than every tick: the list of child processes (psutil walks every process on the host to find
them), the disk/network counters (every disk is read), memory and pressure. Between
refreshes the last value is reported again, so series stay continuous.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from gpuwidget.clock import now
from gpuwidget.facts import MachineFacts
from gpuwidget.sources import procfs
from gpuwidget.sources.base import ErrorLog, SourceError
from gpuwidget.sources.cgroup import CgroupLimits, read_limits, usable_cpus
from gpuwidget.sources.schedstat import read_schedstat, schedstat_path

# Seconds between scans for new child processes (their CPU is still read every tick).
CHILDREN_REFRESH_S = 1.0
# ...except during the first seconds of a watch, when a cell's loader starts its workers:
# then every tick, so that a worker's start-up (seconds of CPU for a spawned one importing
# torch) is reported while it happens, not in one late lump after the first batch.
CHILDREN_EARLY_S = 2.0
# Where the kernel keeps no children lists (CONFIG_PROC_CHILDREN off: minimal VM kernels, gVisor),
# finding descendants means reading every process's parent from /proc/<pid>/stat. psutil's pass took
# ~25 us a process (10-15 ms a tick with 567 processes, BENCHMARKS.md section 2); a tick of the
# H200 machine took ~12 ms of CPU (section 8a), most of it probably that. ProcScan keeps each pid's
# parent between listings (a listing then costs about a listdir), and a listing is repeated no sooner
# than keeps its cost under this share of a core, and not every early tick unless it costs under
# LISTING_EARLY_MAX_S.
LISTING_BUDGET_SHARE = 0.002
LISTING_EARLY_MAX_S = 0.002
# Seconds between disk/network counter reads (rates are averaged over this span), and between
# reads of host memory (which changes slowly and costs a parse of /proc/meminfo).
IO_REFRESH_S = 0.5
# Shortest interval a process rate is formed over: the kernel's CPU times advance in clock
# ticks of 10 ms (USER_HZ = 100), so over 50 ms a rate is within 20% of a core.
MIN_RATE_INTERVAL_S = 0.05
# gpuwidget's own processes below a watched one (the reader process, gpuwidget.sources.reader): never
# counted as its workers.
HIDDEN_PIDS: set[int] = set()
# Pressure stall information, host-wide (Linux 4.20+; absent where the kernel lacks PSI).
PSI_FILES = {"psi.cpu_some": "/proc/pressure/cpu", "psi.io_some": "/proc/pressure/io"}


@dataclass
class _ProcessTotals:
    """Cumulative counters of the process tree at one reading (seconds)."""

    t: float
    own_cpu: float
    workers_cpu: float  # live children plus children already reaped
    main_delay: float | None  # main thread's run delay; None without schedstat
    workers_delay: float | None


class HostDescription(MachineFacts, total=False):
    """What :meth:`HostSource.describe` says: its machine facts, and the CPUs this process's affinity allows."""

    name: str
    available: bool
    cpu_affinity: int


class HostSource:
    """Reads the host and the current process tree: Linux's /proc files kept open (procfs), else psutil."""

    name = "host"

    def __init__(self, pid: int | None = None, per_core: bool = True, process: bool = True) -> None:
        self._log = ErrorLog(self.name)
        self.errors: list[SourceError] = self._log.errors
        self._process = psutil.Process(pid if pid is not None else os.getpid())
        self._per_core = per_core
        self._with_process = process
        self._workers = 0  # live child processes at the last reading
        self._children_listed = -float("inf")
        self._early_until = now() + CHILDREN_EARLY_S
        self._listing_every = CHILDREN_REFRESH_S  # seconds between listings, longer where one costs more
        self._listing_cheap = True  # a listing cheap enough to repeat every early tick
        self.listing_cpu_s = 0.0  # this thread's CPU in the last listing of the children
        self._scan = ProcScan()  # where the kernel keeps no children lists
        self._listed: list[psutil.Process] = []
        self._base: _ProcessTotals | None = None  # counters at the start of the current rate interval
        limits = self._limits = read_limits()
        self._affinity = sorted(_affinity())
        self._usable = usable_cpus(limits, set(self._affinity))
        self._schedstat = read_schedstat(schedstat_path(self._process.pid)) is not None
        self._child_delay: dict[int, float] = {}  # last run delay of each live child
        self._gone_delay = 0.0  # run delay of children no longer listed
        self._our_cores_busy: float | None = None  # busy cores among this process's CPUs, last tick
        psi = dict(PSI_FILES)
        if limits.cpu_pressure is not None:
            psi["psi.cgroup_cpu_some"] = limits.cpu_pressure
        self._psi_files = psi
        self._last_psi: dict[str, tuple[float, float]] = {}
        self._last_io: tuple[float, tuple[float, float] | None, tuple[float, float] | None] | None = None
        self._slow_values: dict[str, float] = {}  # I/O rates and memory, refreshed every IO_REFRESH_S
        self._last_cores: list[tuple[float, float, float]] | None = None
        self._cores_in_ticks = True
        self._disabled: set[str] = set()
        pid = self._process.pid
        self._files = {name: procfs.ProcFile(path) for name, path in (
            ("stat", "/proc/stat"), ("process", f"/proc/{pid}/stat"), ("schedstat", schedstat_path(pid)),
            ("meminfo", "/proc/meminfo"), ("diskstats", "/proc/diskstats"), ("net", "/proc/net/dev"),
            *((name, path) for name, path in psi.items()))}
        self._disks: tuple[int, frozenset[str]] = (-1, frozenset())  # diskstats' line count, the whole disks
        # Prime the CPU counters so the first read reports utilisation since construction.
        self._read_cpu({})

    def describe(self) -> HostDescription:
        return {"name": self.name, "available": True, "cpu_affinity": len(self._affinity), **self.machine_facts()}

    def machine_facts(self) -> MachineFacts:
        """The host facts a run is judged against (the host's part of MachineFacts): CPUs, those
        the watched process may keep busy within its cgroup's limits, memory, the process."""
        return {
            "cpu_count": psutil.cpu_count(logical=True),
            "usable_cpus": self._usable,
            "cpu_limit": self._limits.cpu_limit,
            "mem_limit": self._limits.mem_limit,
            "mem_total": psutil.virtual_memory().total,
            "pid": self._process.pid,
        }

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        t = now()
        self._read_cpu(values)
        if self._with_process:
            self._read_process(values, t)
            if self._our_cores_busy is not None and "proc.cpu" in values:
                ours = values["proc.cpu"] + values.get("proc.workers_cpu", 0.0)
                values["cpu.others"] = max(0.0, 100.0 * self._our_cores_busy - ours)
        self._read_io(values, t)
        return values

    def close(self) -> None:
        self._listed = []
        for file in self._files.values():
            file.close()

    # One try per group: a platform without a counter loses that group, not the tick.
    def _guard(self, group: str, exc: BaseException) -> None:
        self._disabled.add(group)
        self._log.record(f"{group} metrics unavailable: {exc}")

    def _read_cpu(self, values: dict[str, float]) -> None:
        """Utilisation per core and in all, and iowait, from one read of the CPU counters."""
        if "cpu" in self._disabled:
            return
        try:
            cores = procfs.cpu_times(self._files["stat"].read(stop=b"\nintr"))
            ticks = cores is not None  # clock ticks from /proc; psutil's are seconds
            if cores is None:
                cores = [_cpu_split(times) for times in psutil.cpu_times(percpu=True)]
        except Exception as exc:  # noqa: BLE001 - a source never raises into the sampler
            self._guard("cpu", exc)
            return
        previous, self._last_cores = self._last_cores, cores
        same_units, self._cores_in_ticks = self._cores_in_ticks == ticks, ticks
        if previous is None or len(previous) != len(cores) or not same_units:
            return  # the first read (or a CPU came online, or /proc went): no interval to divide by yet
        total_busy = total_wait = total_all = 0.0
        ours = set(self._affinity)
        our_cores_busy = 0.0
        for i, ((busy, wait, everything), (busy0, wait0, everything0)) in enumerate(zip(cores, previous)):
            span = everything - everything0
            if span > 0:
                if self._per_core:
                    values[f"cpu.core{i}.util"] = 100.0 * max(0.0, busy - busy0) / span
                if i in ours:
                    our_cores_busy += max(0.0, busy - busy0) / span
            total_busy += max(0.0, busy - busy0)
            total_wait += max(0.0, wait - wait0)
            total_all += max(0.0, span)
        self._our_cores_busy = our_cores_busy if total_all > 0 else None
        if total_all > 0:
            values["cpu.util"] = 100.0 * total_busy / total_all
            values["cpu.iowait"] = 100.0 * total_wait / total_all

    def _read_process(self, values: dict[str, float], t: float) -> None:
        if "process" in self._disabled:
            return
        try:
            own, reaped, values["proc.rss"] = self._process_times()
            if t - self._children_listed >= self._listing_every or (t < self._early_until and self._listing_cheap):
                self._children_listed = t
                started = time.thread_time()
                self._listed = self._list_children()
                self.listing_cpu_s = cost = time.thread_time() - started
                self._listing_every = max(CHILDREN_REFRESH_S, cost / LISTING_BUDGET_SHARE)
                self._listing_cheap = cost <= LISTING_EARLY_MAX_S
            live_cpu, workers_delay = self._children_counters(self._listed)
            values["proc.workers"] = float(self._workers)
        except psutil.Error as exc:
            self._guard("process", exc)
            return
        main = procfs_schedstat(self._files["schedstat"]) if self._schedstat else None
        totals = _ProcessTotals(t, own, live_cpu + reaped,
                                None if main is None else main[1], workers_delay)
        base = self._base
        if base is None:
            self._base = totals
            return
        span = t - base.t
        if span < MIN_RATE_INTERVAL_S:
            return  # too short to tell a rate from the counters' granularity: keep the interval open
        cores = 100.0 * self._usable  # no process tree runs on more cores than it may use
        self._base = _ProcessTotals(
            t,
            _rate(values, "proc.cpu", totals.own_cpu, base.own_cpu, span, cores) or 0.0,
            _rate(values, "proc.workers_cpu", totals.workers_cpu, base.workers_cpu, span, cores) or 0.0,
            _rate(values, "proc.run_delay", totals.main_delay, base.main_delay, span, 100.0),
            _rate(values, "proc.workers_run_delay", totals.workers_delay, base.workers_delay, span,
                  100.0 * max(1, self._workers)),
        )

    def _process_times(self) -> tuple[float, float, float]:
        """(own CPU seconds, CPU seconds of the children already reaped, resident bytes).

        Children that ended (DataLoader workers at the end of an epoch) are not listed any more,
        but the kernel adds their whole CPU time to ours once they are reaped."""
        read = procfs.process_times(self._files["process"].read())
        if read is not None:
            return read
        with self._process.oneshot():
            times = self._process.cpu_times()
            rss = float(self._process.memory_info().rss)
        reaped = getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
        return times.user + times.system, reaped, rss

    def _list_children(self) -> list[psutil.Process]:
        """This process's descendants, reusing the Process objects already known.

        On Linux the kernel lists each thread's children in /proc/<pid>/task/<tid>/children,
        so finding them costs a few reads; without those lists, each process's parent, kept
        between listings (:class:`ProcScan`); without /proc, psutil's.
        """
        pids = _descendants(self._process.pid)
        if pids is None:
            pids = self._scan.descendants(self._process.pid)
        if pids is None:
            return [child for child in self._process.children(recursive=True) if child.pid not in HIDDEN_PIDS]
        if HIDDEN_PIDS:
            pids = [pid for pid in pids if pid not in HIDDEN_PIDS]
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

    def _children_counters(self, children: list[psutil.Process]) -> tuple[float, float | None]:
        """(CPU seconds the live children used so far, run-delay seconds of all children so far).

        Added to the kernel's count for children that ended and were waited for (``reaped``
        in the caller), the CPU total only grows by what was really used: when a worker ends
        its time moves from the live part to the reaped part, and a child too short-lived to be
        listed still counts. The kernel keeps no such count for run delay, so the last delay
        seen of each child that disappears is kept here. One read per child: its schedstat
        (both figures) where the kernel has it, else psutil's CPU times and no delay.
        """
        live = 0.0
        running = 0
        delays: dict[int, float] = {}
        for child in children:
            counters = read_schedstat(schedstat_path(child.pid)) if self._schedstat else None
            if counters is not None:
                # A pid reused by an unrelated process within a listing interval (1 s) would be
                # counted here; pids are handed out in order, so that needs a wrap-around.
                live += counters[0]
                delays[child.pid] = counters[1]
            else:
                try:
                    if self._schedstat or not child.is_running():
                        continue  # ended (its schedstat is gone), or its pid was reused
                    times = child.cpu_times()
                except psutil.Error:
                    continue  # ended between listing and reading
                live += times.user + times.system
            running += 1
        self._workers = running
        if not self._schedstat:
            return live, None
        self._gone_delay += sum(delay for pid, delay in self._child_delay.items() if pid not in delays)
        self._child_delay = delays
        return live, self._gone_delay + sum(delays.values())

    def _read_memory(self, values: dict[str, float]) -> None:
        if "memory" in self._disabled:
            return
        try:
            read = procfs.memory(self._files["meminfo"].read())
            if read is None:
                memory = psutil.virtual_memory()
                read = float(memory.total - memory.available), float(memory.total)
            values["mem.used"], values["mem.total"] = read
        except Exception as exc:  # noqa: BLE001
            self._guard("memory", exc)

    def _read_io(self, values: dict[str, float], t: float) -> None:
        if "io" in self._disabled:
            return
        if self._last_io is None or t - self._last_io[0] >= IO_REFRESH_S:
            self._read_memory(self._slow_values)
            self._read_pressure(self._slow_values, t)
            try:
                current = (t, self._disk_bytes(), self._net_bytes())
            except Exception as exc:  # noqa: BLE001
                self._guard("io", exc)
                return
            if self._last_io is not None:
                span = t - self._last_io[0]
                for names, new, old in ((("disk.read", "disk.write"), current[1], self._last_io[1]),
                                        (("net.recv", "net.sent"), current[2], self._last_io[2])):
                    if new is not None and old is not None:
                        for name, a, b in zip(names, new, old):
                            self._slow_values[name] = max(0.0, a - b) / span
            self._last_io = current
        values.update(self._slow_values)


    def _disk_bytes(self) -> tuple[float, float] | None:
        """(read, written) bytes of all disks so far; None where the host has no disk counters."""
        data = self._files["diskstats"].read()
        if data is not None:
            lines = data.count(b"\n")
            if lines != self._disks[0]:  # a disk came or went: which names are whole disks
                self._disks = (lines, procfs.whole_disks())
            read = procfs.disk_bytes(data, self._disks[1])
            if read is not None:
                return read
        disk = psutil.disk_io_counters()
        return None if disk is None else (float(disk.read_bytes), float(disk.write_bytes))

    def _net_bytes(self) -> tuple[float, float] | None:
        """(received, sent) bytes of all interfaces so far."""
        read = procfs.net_bytes(self._files["net"].read())
        if read is not None:
            return read
        net = psutil.net_io_counters()
        return None if net is None else (float(net.bytes_recv), float(net.bytes_sent))

    def _read_pressure(self, values: dict[str, float], t: float) -> None:
        """PSI "some" shares since the previous read, from the cumulative ``total=`` microseconds."""
        for name in self._psi_files:
            total = psi_some(self._files[name].read())
            if total is None:
                continue
            previous = self._last_psi.get(name)
            self._last_psi[name] = (t, total)
            if previous is not None and t > previous[0]:
                values[name] = min(100.0, max(0.0, total - previous[1]) / (t - previous[0]) * 100.0)


def _rate(values: dict[str, float], name: str, total: float | None, base: float | None, span: float,
          cap: float) -> float | None:
    """Put the rate of a cumulative counter since ``base`` into ``values`` (percent of one core,
    at most ``cap``) and return the counter's new base.

    A child found by the once-a-second scan brings all the time it used since it started
    into one tick; reporting it at once would read as more cores than the machine has, and
    clipping it would lose it from the run's means. What is over the cap is carried into
    the following ticks instead (the base only advances by what was reported). The base
    never moves back: a child's time that leaves the live part before the kernel adds it to
    the reaped part is not counted twice when it arrives there.
    """
    if total is None or base is None:
        return total
    used = max(0.0, total - base)
    reported = min(used, cap / 100.0 * span)
    values[name] = 100.0 * reported / span
    return base + reported


def psi_some_total(path: str) -> float | None:
    """Seconds some task stalled, from a PSI file's ``some ... total=<us>`` line; None where absent.

    Reading a PSI file raises EOPNOTSUPP where the kernel was booted with psi=0.
    """
    try:
        with open(path, "rb") as fh:
            return psi_some(fh.read())
    except OSError:
        return None


def psi_some(text: bytes | None) -> float | None:
    """:func:`psi_some_total` of a PSI file's contents."""
    for line in (text or b"").splitlines():
        if line.startswith(b"some "):
            for field in line.split():
                if field.startswith(b"total="):
                    try:
                        return int(field[6:]) * 1e-6
                    except ValueError:
                        return None
    return None


def procfs_schedstat(file: procfs.ProcFile) -> tuple[float, float] | None:
    """:func:`read_schedstat` of a file kept open."""
    fields = (file.read() or b"").split()
    return (int(fields[0]) * 1e-9, int(fields[1]) * 1e-9) if len(fields) >= 2 else None


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


class ProcScan:
    """A process's descendants where the kernel keeps no children lists: each process's parent, the
    4th field of /proc/<pid>/stat (after the command name's closing parenthesis), kept between
    listings. A listing reads the stat of new pids only, and again of the descendants it found last
    time (whose parent changes when theirs ends), so after the first one it costs about a listdir.
    A pid reused by another process between two listings keeps its old parent here until it is
    listed as a descendant; pids are handed out in order, so that needs a wrap-around."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self.parents: dict[int, int] = {}
        self._last: set[int] = set()
        self.stat_reads = 0  # stats read so far (what a listing costs beyond the listdir)

    def descendants(self, pid: int) -> list[int] | None:
        """Pids below ``pid``; None where there is no /proc to read."""
        try:
            names = os.listdir(self.proc)
        except OSError:
            return None
        known, last = self.parents, self._last
        parents: dict[int, int] = {}
        for name in names:
            if not name.isdigit():
                continue
            number = int(name)
            parent = known.get(number)
            if parent is None or number in last:
                parent = self._parent(name)
                if parent is None:
                    continue  # ended meanwhile
            parents[number] = parent
        self.parents = parents
        children: dict[int, list[int]] = {}
        for number, parent in parents.items():
            children.setdefault(parent, []).append(number)
        found: list[int] = []
        stack = [pid]
        while stack:
            below = children.get(stack.pop(), ())
            found.extend(below)
            stack.extend(below)
        self._last = set(found)
        return found

    def _parent(self, name: str) -> int | None:
        self.stat_reads += 1
        try:
            fd = os.open(f"{self.proc}/{name}/stat", os.O_RDONLY)
        except OSError:
            return None
        try:
            data = os.read(fd, 4096)
        except OSError:
            return None
        finally:
            os.close(fd)
        fields = data[data.rfind(b")") + 2:].split(b" ", 2)
        return int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else None


def _descendants_by_scan(pid: int, proc: str = "/proc") -> list[int] | None:
    """Pids below ``pid`` from every process's parent, in one pass (:class:`ProcScan`, from scratch)."""
    return ProcScan(proc).descendants(pid)


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


def usable_cpu_count(limits: CgroupLimits | None = None) -> int:
    """Cores this process may use: its affinity mask (taskset) within its cgroup's limits
    (containers; see gpuwidget.sources.cgroup), read now unless ``limits`` are given."""
    return usable_cpus(read_limits() if limits is None else limits, _affinity())
