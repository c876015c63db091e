"""A pytest plugin: each test's wall seconds and the CPU seconds of pytest's process tree meanwhile.

The CPU is read from /proc for pytest and every live descendant (their own time and their reaped
children's), so kernels, servers, browsers and the processes a test starts and waits for all count.
One JSON line per test in $SUITE_CPU_OUT (default suite-cpu.jsonl). BENCHMARKS.md section 18 has the
figures; the command:

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -m serial -p _suite_cpu
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

TICK = os.sysconf("SC_CLK_TCK")
ME = os.getpid()
OUT = os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl")


def _tree_cpu() -> float:
    """CPU seconds of this process and its live descendants, each with its reaped children's."""
    children: dict[int, list[int]] = {}
    stats: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                data = stat.read()
        except OSError:
            continue
        rest = data[data.rindex(")") + 2:].split()
        ppid = int(rest[1])
        cpu = sum(int(v) for v in rest[11:15])
        stats[int(name)] = cpu
        children.setdefault(ppid, []).append(int(name))
    total, todo = 0, [ME]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    c0, t0 = _tree_cpu(), time.monotonic()
    yield
    c1, t1 = _tree_cpu(), time.monotonic()
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "wall": round(t1 - t0, 2), "cpu": round(c1 - c0, 2)}) + "\n")
