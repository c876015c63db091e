"""Linux's ``/proc`` counters for the host source, read the cheap way: each file opened once and read
again from its start with one ``pread``, and only the fields used parsed.

psutil opens, reads and closes a file per call, parses every field and builds named tuples. The
sampler reads the same few files on every tick of a watch, on a thread of the user's process: the
cost is the user's (BENCHMARKS.md, sampler cost). A ``pread`` of a file kept open skips the path
lookup and the open and close (a third of the time), and the figures are psutil's: the same
files, the same fields, the same sums.

Every parser returns None where the file is absent or does not read as expected; the host source
then asks psutil, as it does on every other platform.
"""

from __future__ import annotations

import contextlib
import os

# Enough for every line this module reads at once (the CPU lines of /proc/stat for about 800
# cores come first); a longer file is read on in further chunks.
CHUNK = 1 << 16
# psutil's unit for the sector counts of /proc/diskstats (the kernel's, whatever the disk's sectors).
SECTOR_BYTES = 512
try:
    CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
    PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # not a POSIX system: nothing here is read there
    CLOCK_TICKS, PAGE_BYTES = 100, 4096


class ProcFile:
    """One file kept open and read again from its start; None once it cannot be read."""

    __slots__ = ("_fd", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self, stop: bytes | None = None) -> bytes | None:
        """The file's contents (up to the first chunk holding ``stop``, where given), or None."""
        fd = self._fd
        try:
            if fd is None:
                fd = self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            data = os.pread(fd, CHUNK, 0)
            if len(data) < CHUNK or (stop is not None and stop in data):
                return data
            parts = [data]
            while len(data) == CHUNK:
                data = os.pread(fd, CHUNK, CHUNK * len(parts))
                parts.append(data)
            return b"".join(parts)
        except OSError:
            self.close()
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    __del__ = close


def cpu_times(data: bytes | None) -> list[tuple[float, float, float]] | None:
    """Per core, (busy, iowait, total) clock ticks from ``/proc/stat``: psutil's ``cpu_times(percpu=True)``
    as the host source counts them (guest time is already in user time; iowait is not busy). Whole
    ticks, not seconds: their differences are exact, so a share of them is never above 100 %."""
    if not data:
        return None
    cores = []
    for line in data.split(b"\n")[1:]:  # the first line is all cores together
        if not line.startswith(b"cpu"):
            break
        fields = line.split()
        try:
            user, nice, system, idle, iowait, *rest = map(int, fields[1:9])
        except ValueError:
            return None
        total = user + nice + system + idle + iowait + sum(rest)
        cores.append((float(total - idle - iowait), float(iowait), float(total)))
    return cores or None


def process_times(data: bytes | None) -> tuple[float, float, float] | None:
    """(own CPU seconds, reaped children's CPU seconds, resident bytes) from ``/proc/<pid>/stat``:
    psutil's ``cpu_times()`` user + system, children_user + children_system, and ``memory_info().rss``."""
    if not data:
        return None
    fields = data[data.rfind(b")") + 2:].split()  # the command name may hold spaces and brackets
    try:
        utime, stime, cutime, cstime = (int(field) for field in fields[11:15])
        rss = int(fields[21])
    except (ValueError, IndexError):
        return None
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS, float(rss * PAGE_BYTES)


def memory(data: bytes | None) -> tuple[float, float] | None:
    """(used, total) bytes from ``/proc/meminfo``: psutil's ``total - available``, with the kernel's
    MemAvailable (Linux 3.14+; psutil estimates it on older kernels, and is asked there)."""
    if not data:
        return None
    total = available = None
    for line in data.split(b"\n"):
        if line.startswith(b"MemTotal:"):
            total = line.split()[1]
        elif line.startswith(b"MemAvailable:"):
            available = line.split()[1]
            break
    if total is None or available is None:
        return None
    try:
        return (int(total) - int(available)) * 1024.0, int(total) * 1024.0
    except ValueError:
        return None


def disk_bytes(data: bytes | None, disks: frozenset[str]) -> tuple[float, float] | None:
    """(read, written) bytes of the whole disks in ``disks`` from ``/proc/diskstats`` (psutil leaves
    out partitions: their bytes are their disk's already)."""
    if not data:
        return None
    read = written = 0
    for line in data.split(b"\n"):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 14 and len(fields) < 18:
            return None  # Linux 2.4's layout, or a partition's line of 2.6: psutil reads those
        if fields[2].decode(errors="replace").replace("/", "!") in disks:
            read += int(fields[5])
            written += int(fields[9])
    return float(read * SECTOR_BYTES), float(written * SECTOR_BYTES)


def whole_disks() -> frozenset[str]:
    """The names ``/sys/block`` lists: whole disks (and virtual ones), as psutil tells them from partitions."""
    try:
        return frozenset(os.listdir("/sys/block"))
    except OSError:
        return frozenset()


def net_bytes(data: bytes | None) -> tuple[float, float] | None:
    """(received, sent) bytes of every interface from ``/proc/net/dev``, as psutil sums them."""
    if not data:
        return None
    received = sent = 0
    for line in data.split(b"\n")[2:]:
        _, colon, counters = line.rpartition(b":")
        if not colon:
            continue
        fields = counters.split()
        try:
            received += int(fields[0])
            sent += int(fields[8])
        except (ValueError, IndexError):
            return None
    return float(received), float(sent)
