"""The CPUs and memory this process may really use: its cgroup's limits (containers, pods, batch jobs).

Inside a container (JupyterHub on Kubernetes, ``docker run --cpus``, a Slurm job) the node's
core count and memory say nothing about what the notebook may use: a pod limited to 4 CPUs on
a 64-core node runs 4 cores' worth of work at most, and more DataLoader workers than that only
queue for them. The limits come from the cgroup filesystem:

===============  ===========================================  ==========================================
limit            cgroup v2 (unified)                          cgroup v1
===============  ===========================================  ==========================================
CPU time quota   ``cpu.max`` ("max 100000" or "150000 100000") ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
CPUs allowed     ``cpuset.cpus.effective``                    ``cpuset.effective_cpus``, ``cpuset.cpus``
memory           ``memory.max`` ("max" or bytes)              ``memory.limit_in_bytes``
===============  ===========================================  ==========================================

The process's own cgroup is read from ``/proc/self/cgroup`` and every ancestor up to the
mount point is considered (a limit set on a parent applies to its children); the tightest
wins. When the listed path does not exist under the mount (a container that sees its own
cgroup as the root), the mount point itself is read. No cgroup filesystem, or no limit: the
fields are None and the node's figures stand.

Rounding: a quota of 1.5 CPUs allows ``usable_cpus`` = 2 (the ceiling) and keeps
``cpu_limit`` = 1.5. Worker counts are whole processes, and two workers at 75% of a core each
use the quota fully where one would leave half a core unused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
# cgroup v1 reports "no memory limit" as the largest page-aligned 63-bit value
# (9223372036854771712); anything at or above 2**62 bytes is no limit in practice.
UNLIMITED_BYTES = 2**62

_Number = TypeVar("_Number", int, float)


@dataclass(frozen=True)
class CgroupLimits:
    """What the cgroup allows this process; None where it sets no limit."""

    version: int | None = None  # 1 or 2; None where no cgroup filesystem was found
    cpu_limit: float | None = None  # CPU-time quota in cores (quota / period)
    cpuset: frozenset[int] | None = None  # the CPUs it may run on
    mem_limit: int | None = None  # bytes
    cpu_pressure: str | None = None  # path of the cgroup's cpu.pressure (PSI), v2 only


def read_limits(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CgroupLimits:
    """The limits of the cgroup that ``proc_cgroup`` names, read under ``root``; never raises."""
    try:
        memberships = _memberships(proc_cgroup)
    except OSError:
        memberships = {}
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return _read_v2(root, memberships.get("", "/"))
    if any(os.path.isdir(os.path.join(root, name)) for name in ("cpu", "cpuset", "memory")):
        return _read_v1(root, memberships)
    return CgroupLimits()


def usable_cpus(limits: CgroupLimits, affinity: set[int]) -> int:
    """CPUs a process with this ``affinity`` may keep busy under ``limits`` (at least 1)."""
    count = len(affinity)
    if limits.cpuset:
        count = min(count, len(limits.cpuset))
    if limits.cpu_limit is not None:
        count = min(count, math.ceil(limits.cpu_limit))
    return max(1, count)


# ------------------------------------------------------------------ v2


def _read_v2(root: str, path: str) -> CgroupLimits:
    own = _own_dir(root, path)
    quota: float | None = None
    memory: int | None = None
    for directory in _up_to(own, root):
        quota = _tighter(quota, _cpu_max(os.path.join(directory, "cpu.max")))
        memory = _tighter(memory, _bytes(os.path.join(directory, "memory.max")))
    pressure = os.path.join(own, "cpu.pressure")
    return CgroupLimits(
        version=2, cpu_limit=quota, mem_limit=memory,
        cpuset=_first_cpuset(own, root, ("cpuset.cpus.effective",)),
        cpu_pressure=pressure if own != root and os.path.exists(pressure) else None,
    )


def _cpu_max(path: str) -> float | None:
    text = _text(path)
    if text is None:
        return None
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = float(parts[1]) if len(parts) > 1 else 100_000.0
    return float(parts[0]) / period if period > 0 else None


# ------------------------------------------------------------------ v1


def _read_v1(root: str, memberships: dict[str, str]) -> CgroupLimits:
    quota: float | None = None
    memory: int | None = None
    cpuset = None
    cpu_mount = _controller_mount(root, "cpu")
    if cpu_mount is not None:
        for directory in _up_to(_own_dir(cpu_mount, memberships.get("cpu", "/")), cpu_mount):
            quota = _tighter(quota, _cfs_quota(directory))
    memory_mount = _controller_mount(root, "memory")
    if memory_mount is not None:
        for directory in _up_to(_own_dir(memory_mount, memberships.get("memory", "/")), memory_mount):
            memory = _tighter(memory, _bytes(os.path.join(directory, "memory.limit_in_bytes")))
    cpuset_mount = _controller_mount(root, "cpuset")
    if cpuset_mount is not None:
        own = _own_dir(cpuset_mount, memberships.get("cpuset", "/"))
        cpuset = _first_cpuset(own, cpuset_mount, ("cpuset.effective_cpus", "cpuset.cpus"))
    # A hybrid host mounts the v2 hierarchy (which alone has pressure files) at unified/.
    unified = os.path.join(root, "unified")
    pressure = None
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        own = _own_dir(unified, memberships.get("", "/"))
        candidate = os.path.join(own, "cpu.pressure")
        pressure = candidate if own != unified and os.path.exists(candidate) else None
    return CgroupLimits(version=1, cpu_limit=quota, mem_limit=memory, cpuset=cpuset, cpu_pressure=pressure)


def _cfs_quota(directory: str) -> float | None:
    quota = _text(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _text(os.path.join(directory, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # -1: no quota


def _controller_mount(root: str, controller: str) -> str | None:
    """The v1 hierarchy holding ``controller``: ``cpu``, or a co-mount such as ``cpu,cpuacct``."""
    direct = os.path.join(root, controller)
    if os.path.isdir(direct):
        return direct
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        if controller in name.split(",") and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    return None


# ------------------------------------------------------------------ shared


def _memberships(proc_cgroup: str) -> dict[str, str]:
    """controller -> cgroup path, from lines ``id:controllers:path`` ("" is the v2 hierarchy)."""
    found: dict[str, str] = {}
    with open(proc_cgroup) as fh:
        for line in fh:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            for controller in parts[1].split(",") if parts[1] else [""]:
                found[controller] = parts[2]
    return found


def _own_dir(mount: str, path: str) -> str:
    """The directory of the process's cgroup, or the mount itself when the path is not visible
    (a container whose cgroup namespace shows its own cgroup as the root)."""
    candidate = os.path.normpath(os.path.join(mount, path.lstrip("/")))
    inside = candidate == mount or candidate.startswith(mount.rstrip("/") + "/")
    return candidate if inside and os.path.isdir(candidate) else mount


def _up_to(directory: str, mount: str) -> Iterator[str]:
    """``directory`` and its parents up to and including ``mount``."""
    while True:
        yield directory
        if directory == mount or len(directory) <= len(mount):
            return
        directory = os.path.dirname(directory)


def _first_cpuset(own: str, mount: str, names: tuple[str, ...]) -> frozenset[int] | None:
    """The nearest CPU list at or above ``own`` (v1 children may leave theirs empty)."""
    for directory in _up_to(own, mount):
        for name in names:
            cpus = parse_cpu_list(_text(os.path.join(directory, name)) or "")
            if cpus:
                return cpus
    return None


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's list format); empty on nonsense."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            cpus.update(range(int(low), int(high or low) + 1))
        except ValueError:
            return frozenset()
    return frozenset(cpus)


def _bytes(path: str) -> int | None:
    text = _text(path)
    if text is None or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < UNLIMITED_BYTES else None


def _tighter(current: _Number | None, new: _Number | None) -> _Number | None:
    if new is None:
        return current
    return new if current is None else min(current, new)


def _text(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


# ------------------------------------------------------------------ usage


@dataclass(frozen=True)
class CgroupUsage:
    """What the process's own cgroup has used: None where its files are absent."""

    cpu_seconds: float | None = None  # CPU time of every task in the cgroup since it was created
    mem_bytes: int | None = None  # memory charged to it now (page cache included, as the limit counts it)


def read_usage(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CgroupUsage:
    """CPU time and memory of the cgroup that ``proc_cgroup`` names, read under ``root``; never raises.

    v2: ``cpu.stat`` (``usage_usec``) and ``memory.current``; v1: ``cpuacct.usage`` (ns) and
    ``memory.usage_in_bytes``. Read in the process's own cgroup (usage is not inherited).
    """
    try:
        memberships = _memberships(proc_cgroup)
    except OSError:
        memberships = {}
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        own = _own_dir(root, memberships.get("", "/"))
        usec = None
        for line in (_text(os.path.join(own, "cpu.stat")) or "").splitlines():
            name, _, value = line.partition(" ")
            if name == "usage_usec" and value.strip().isdigit():
                usec = int(value)
        return CgroupUsage(None if usec is None else usec / 1e6, _bytes(os.path.join(own, "memory.current")))
    cpu_seconds = None
    cpuacct = _controller_mount(root, "cpuacct")
    if cpuacct is not None:
        own = _own_dir(cpuacct, memberships.get("cpuacct", "/"))
        ns = _text(os.path.join(own, "cpuacct.usage"))
        cpu_seconds = int(ns) / 1e9 if ns is not None and ns.isdigit() else None
    memory = None
    memory_mount = _controller_mount(root, "memory")
    if memory_mount is not None:
        memory = _bytes(os.path.join(_own_dir(memory_mount, memberships.get("memory", "/")), "memory.usage_in_bytes"))
    return CgroupUsage(cpu_seconds, memory)
