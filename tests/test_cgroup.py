"""Usable CPUs and memory from the cgroup: fake v1 and v2 trees, and a real cgroup where the test may make one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuwidget.sources.cgroup import CgroupLimits, parse_cpu_list, read_limits, usable_cpus
from gpuwidget.sources.host import usable_cpu_count

GIB = 2**30
NODE = set(range(64))  # a 64-core node


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def membership(tmp_path: Path, text: str) -> str:
    path = tmp_path / "self-cgroup"
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def test_v2_pod_limited_to_one_and_a_half_cpus_is_judged_as_two_with_the_float_kept(tmp_path):
    root = tree(tmp_path / "fs", {
        "cgroup.controllers": "cpuset cpu io memory pids",
        "kubepods/cpu.max": "max 100000",
        "kubepods/memory.max": str(8 * GIB),
        "kubepods/pod1/cpu.max": "150000 100000",
        "kubepods/pod1/memory.max": str(4 * GIB),
        "kubepods/pod1/cpuset.cpus.effective": "0-15",
        "kubepods/pod1/cpu.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0",
    })
    limits = read_limits(str(root), membership(tmp_path, "0::/kubepods/pod1\n"))
    assert limits.version == 2
    assert limits.cpu_limit == pytest.approx(1.5)
    assert limits.mem_limit == 4 * GIB
    assert limits.cpuset == frozenset(range(16))
    assert limits.cpu_pressure == str(root / "kubepods/pod1/cpu.pressure")
    assert usable_cpus(limits, NODE) == 2


def test_v2_limit_on_a_parent_applies_to_the_child(tmp_path):
    root = tree(tmp_path / "fs", {
        "cgroup.controllers": "cpu memory",
        "user.slice/cpu.max": "200000 100000",
        "user.slice/memory.max": str(GIB),
        "user.slice/session/cpu.max": "max 100000",
        "user.slice/session/memory.max": "max",
    })
    limits = read_limits(str(root), membership(tmp_path, "0::/user.slice/session\n"))
    assert limits.cpu_limit == pytest.approx(2.0) and limits.mem_limit == GIB
    assert usable_cpus(limits, NODE) == 2


def test_v2_container_that_sees_its_own_cgroup_as_the_root_reads_the_mount(tmp_path):
    # Without a cgroup namespace /proc/self/cgroup names the host's path, absent in the container.
    root = tree(tmp_path / "fs", {"cgroup.controllers": "cpu memory", "cpu.max": "400000 100000",
                                  "memory.max": str(16 * GIB)})
    limits = read_limits(str(root), membership(tmp_path, "0::/kubepods/burstable/pod-abc/123\n"))
    assert limits.cpu_limit == pytest.approx(4.0) and limits.mem_limit == 16 * GIB
    assert usable_cpus(limits, NODE) == 4  # a pod limited to 4 CPUs on a 64-core node
    assert limits.cpu_pressure is None  # the root's pressure is the host's, not the pod's


def test_v2_without_limits_leaves_the_node_figures(tmp_path):
    root = tree(tmp_path / "fs", {"cgroup.controllers": "cpu memory", "cpu.max": "max 100000",
                                  "memory.max": "max"})
    limits = read_limits(str(root), membership(tmp_path, "0::/\n"))
    assert (limits.version, limits.cpu_limit, limits.mem_limit) == (2, None, None)
    assert usable_cpus(limits, NODE) == 64


def test_v1_docker_cpus_memory_and_cpuset_with_co_mounted_controllers(tmp_path):
    root = tree(tmp_path / "fs", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "memory/docker/abc/memory.limit_in_bytes": str(2 * GIB),
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "cpuset/cpuset.cpus": "0-7",
        "cpuset/docker/abc/cpuset.cpus": "",  # a v1 child may leave its list empty: the parent's holds
    })
    limits = read_limits(str(root), membership(tmp_path, """
        5:memory:/docker/abc
        4:cpu,cpuacct:/docker/abc
        3:cpuset:/docker/abc
        0::/
    """))
    assert limits.version == 1
    assert limits.cpu_limit == pytest.approx(2.5)
    assert limits.mem_limit == 2 * GIB
    assert limits.cpuset == frozenset(range(8))
    assert usable_cpus(limits, NODE) == 3
    assert usable_cpus(limits, {0, 1}) == 2  # affinity (taskset) narrower than the cgroup


def test_v1_without_a_quota_is_unlimited(tmp_path):
    root = tree(tmp_path / "fs", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": "9223372036854771712",
    })
    limits = read_limits(str(root), membership(tmp_path, "2:cpu:/\n1:memory:/\n"))
    assert (limits.version, limits.cpu_limit, limits.mem_limit, limits.cpuset) == (1, None, None, None)


def test_no_cgroup_filesystem_gives_no_limits(tmp_path):
    assert read_limits(str(tmp_path), str(tmp_path / "missing")) == CgroupLimits()
    assert usable_cpus(CgroupLimits(), {0, 1, 2}) == 3


def test_cpu_lists_in_the_kernels_format():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == frozenset() and parse_cpu_list("zero") == frozenset()


def test_usable_cpu_count_honours_a_quota_below_the_affinity():
    assert usable_cpu_count(CgroupLimits(version=2, cpu_limit=0.5)) == 1
    assert 1 <= usable_cpu_count() <= len(os.sched_getaffinity(0))


def test_a_process_moved_into_a_real_cgroup_with_a_quota_sees_it():
    """As root on a cgroup v1 host (or v2 with the cpu controller delegated), make a cgroup
    with half a CPU of quota, move a child process into it, and let it read its own limits."""
    host = read_limits()
    if host.version == 1:
        base, files = Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000"}
    elif host.version == 2:
        base, files = Path("/sys/fs/cgroup"), {"cpu.max": "50000 100000"}
    else:
        pytest.skip("no cgroup filesystem here")
    group = base / f"gpuwidget-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    child = None
    try:
        try:
            for name, value in files.items():
                (group / name).write_text(value)
        except OSError as exc:
            pytest.skip(f"cannot set a CPU quota here: {exc}")
        code = ("import sys; sys.stdin.readline()\n"
                "from gpuwidget.sources.cgroup import read_limits\n"
                "from gpuwidget.sources.host import usable_cpu_count\n"
                "print(read_limits().cpu_limit, usable_cpu_count())\n")
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        (group / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate("go\n", timeout=60)
        assert out.split() == ["0.5", "1"]
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        group.rmdir()
