"""Shared helpers for the benchmarks: paths, arguments, statistics, tables, verdicts, JSON.

Benchmarks report figures, they are not tests: a missed target prints ``MISS`` and the
script still exits 0. Every script takes ``--quick`` (a smoke run of a few seconds) and
``--json PATH`` (also write the figures and verdicts as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def setup_paths(fake_nvml: bool = False) -> None:
    """Make ``import gpuwidget`` work from a checkout (and ``import fakenvml`` when asked)."""
    for path in ([ROOT, TESTS] if fake_nvml else [ROOT]):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def parse_args(description: str, extra: Sequence[tuple[str, dict[str, Any]]] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    return parser.parse_args()


def machine() -> dict[str, Any]:
    """What the figures were measured on (noise matters: the load average is included)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    return {
        "code": code_state(),
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": cpus,
        "loadavg": [round(x, 2) for x in load],
    }


def code_state() -> str:
    """The commit measured, and whether gpuwidget/ had uncommitted changes (figures depend on them)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gpuwidget"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} + uncommitted changes in gpuwidget/" if dirty else head


def print_header(title: str) -> dict[str, Any]:
    info = machine()
    print(f"{title}")
    print(f"  {info['date']}, Python {info['python']}, {info['cpus']} CPUs, "
          f"load average {info['loadavg'][0]:.2f} {info['loadavg'][1]:.2f} {info['loadavg'][2]:.2f}; "
          f"code {info['code']}")
    return info


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(Q1, Q3) with the same method as numpy's default (linear interpolation)."""
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a plain-text table; columns are as wide as their widest cell."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  " + "  ".join(text.ljust(width) if i == 0 else text.rjust(width)
                               for i, (text, width) in enumerate(zip(row, widths))))
        if n == 0:
            print("  " + "  ".join("-" * width for width in widths))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def verdict(name: str, value: float, target: float, *, higher_is_better: bool, shown: str,
            target_shown: str) -> dict[str, Any]:
    """Print ``PASS``/``MISS`` for one target and return it as data."""
    ok = value >= target if higher_is_better else value <= target
    word = "PASS" if ok else "MISS"
    op = ">=" if higher_is_better else "<="
    print(f"{word}  {name}: {shown} (target {op} {target_shown})")
    return {"target": name, "value": value, "limit": target, "op": op, "result": word}


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, default=_default) + "\n", encoding="utf-8")
    print(f"(results written to {target})")


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


@contextlib.contextmanager
def strangers(count: int) -> Iterator[list[int]]:
    """``count`` idle processes that are not ours (their parent shell exits at once), as on a
    shared server; all of them are stopped, by pid, when the block ends."""
    pids: list[int] = []
    try:
        if count > 0:
            script = (f"for i in $(seq {count}); do setsid sleep 600 </dev/null >/dev/null 2>&1 & "
                      "echo $!; done")
            out = subprocess.run(["sh", "-c", script], check=True, capture_output=True, text=True).stdout
            pids = [int(line) for line in out.split()]
            time.sleep(0.5)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:  # gone from the process table, not just dying
            pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
            time.sleep(0.05)
