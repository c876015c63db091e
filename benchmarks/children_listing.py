"""Finding the watched process's children: the kernel's lists, one pass over /proc, and psutil's.

The host source lists the watched process's descendants (DataLoader workers, ranks) about once a
second, and every tick in a watch's first seconds. Where the kernel keeps children lists
(``/proc/<pid>/task/<tid>/children``, CONFIG_PROC_CHILDREN) that is a few reads. Where it does not
(minimal VM kernels, gVisor) it was psutil's ``children(recursive=True)``, which reads every
process on the host; it is now ``gpuwidget.sources.host.ProcScan``, which keeps each pid's parent
between listings and reads the stat of new pids and of the last descendants only (its first
listing reads every stat, one ``os.read`` each: shown apart). Measured side by side in one process, on the
host as found and with ``--strangers`` extra idle processes that are not ours: the thread CPU of
one listing (median of ``--repeats``), for each way, in rotating order. The watched process has
two children (a forked worker and its own child), which every way must find.

    .venv/bin/python benchmarks/children_listing.py [--quick] [--json PATH] [--strangers N]
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable

from _common import median, parse_args, print_header, setup_paths, strangers, table, verdict, write_json

setup_paths()

from gpuwidget.sources import host  # noqa: E402


def _parent_of_a_sleeper() -> None:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    child.join()


def cpu_of(listing: Callable[[], object], repeats: int) -> float:
    """Median thread CPU seconds of one call."""
    spent = []
    for _ in range(repeats):
        started = time.thread_time()
        listing()
        spent.append(time.thread_time() - started)
    return median(spent)


def main() -> None:
    import psutil

    args = parse_args(__doc__.splitlines()[0], [
        ("--strangers", {"type": int, "default": 500, "help": "extra idle processes for the second row"}),
        ("--repeats", {"type": int, "default": 30}),
    ])
    info = print_header("Listing the watched process's children: thread CPU of one listing")
    repeats = 5 if args.quick else args.repeats
    me = os.getpid()
    kept = host.ProcScan()
    ways: dict[str, Callable[[], object]] = {
        "kernel's children lists": lambda: host._descendants(me),
        "ProcScan, parents kept between listings (now)": lambda: kept.descendants(me),
        "one pass over every stat (ProcScan's first)": lambda: host._descendants_by_scan(me),
        "psutil children(recursive=True) (before)": lambda: psutil.Process(me).children(recursive=True),
    }
    worker = multiprocessing.get_context("fork").Process(target=_parent_of_a_sleeper, daemon=False)
    worker.start()
    rows, results = [], []
    try:
        time.sleep(0.5)
        expected = {child.pid for child in psutil.Process(me).children(recursive=True)}
        for name in list(ways)[:3]:
            pids = ways[name]()
            assert pids is None or set(pids) == expected, f"{name} found {pids}, psutil {sorted(expected)}"
        for extra in (0, 0 if args.quick else args.strangers):
            with strangers(extra):
                processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
                spent: dict[str, list[float]] = {name: [] for name in ways}
                for round_ in range(3):
                    order = list(ways)[round_ % len(ways):] + list(ways)[:round_ % len(ways)]
                    for name in order:
                        if name.startswith("kernel") and host._descendants(me) is None:
                            continue
                        spent[name].append(cpu_of(ways[name], repeats))
                for name, values in spent.items():
                    us = 1e6 * median(values) if values else float("nan")
                    every = max(host.CHILDREN_REFRESH_S, us / 1e6 / host.LISTING_BUDGET_SHARE)
                    schedule = ("1 s, every tick early" if name.startswith("psutil") else f"{every:.2f} s"
                                + ("" if us / 1e6 > host.LISTING_EARLY_MAX_S else ", every tick early"))
                    rows.append((processes, name, us, schedule if values else "-"))
                    results.append({"processes": processes, "way": name, "us": us})
            if args.quick:
                break
    finally:
        for child in psutil.Process(me).children(recursive=True):
            child.kill()
        worker.join()
    table(["processes on the host", "listing", "us of thread CPU", "listed at most every"], rows)
    scan = [r["us"] for r in results if r["way"].startswith("ProcScan")]
    old = [r["us"] for r in results if r["way"].startswith("psutil")]
    verdicts = [verdict("ProcScan against psutil's listing, most processes", old[-1] / scan[-1], 5.0,
                        higher_is_better=True, shown=f"{old[-1] / scan[-1]:.1f}x less CPU", target_shown="5x")]
    write_json(args.json, {"benchmark": "children_listing", "machine": info, "rows": results, "verdicts": verdicts})


if __name__ == "__main__":
    main()
