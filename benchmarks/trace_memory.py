"""Trace memory: a simulated 24 h at 10 Hz with 8 GPUs stays within 64 MB.

864,000 rows of a realistic 164-column row (8 GPUs x 17 metrics, a 16-core host, the
process tree, memory, disk, network) are appended to a ``gpuwidget.trace.Trace`` with
default capacities, as the sampler would, plus one ``loader.wait`` and one ``step`` span
per 0.1 s (864,000 of each; the Trace keeps the newest ``DEFAULT_SPAN_CAPACITY`` per kind).
Times are simulated (t = k * 0.1 s); nothing sleeps.

Reported: ``Trace.nbytes()``, the process RSS growth (psutil) around building and filling
the Trace, the peak RSS growth (getrusage ru_maxrss: the high-water mark, reached while the
archive folds and coarsens), the time per append and per span, the
archive bucket width at the end, and whether a one-sample spike written at hour 3 is
still in ``trace.window().max`` (and in the exact whole-run stats). ``--quick`` simulates
1 hour (spike at 7.5 min).

    .venv/bin/python benchmarks/trace_memory.py [--quick] [--json PATH]
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from _common import parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

TARGET_MB = 64.0
RATE_HZ = 10
GPU_METRICS = ("util", "mem_util", "mem_used", "mem_total", "power", "power_limit", "temperature",
               "sm_clock", "sm_clock_max", "slowdown", "power_capped", "pcie_tx", "pcie_rx", "proc_mem",
               "sm_active", "tensor_active", "sm_occupancy", "dram_active")
SPIKE_COLUMN = "gpu3.power"
SPIKE_VALUE = 1234.5  # W: far above any normal reading (<= 700), exact in float32


def realistic_rows(count: int, seed: int = 0) -> list[dict[str, float]]:
    """``count`` distinct rows in SI units, as the sources report them."""
    rng = random.Random(seed)
    gib = 1024**3
    rows = []
    for _ in range(count):
        row: dict[str, float] = {}
        for i in range(8):
            g = f"gpu{i}."
            util = rng.uniform(40, 100)
            row.update({
                g + "util": util, g + "mem_util": rng.uniform(10, 60),
                g + "mem_used": rng.uniform(20, 70) * gib, g + "mem_total": 80.0 * gib,
                g + "power": rng.uniform(150, 650), g + "power_limit": 700.0,
                g + "temperature": rng.uniform(40, 80), g + "sm_clock": rng.choice((1755e6, 1980e6)),
                g + "sm_clock_max": 1980e6, g + "slowdown": rng.choice((0.0, 1.0)),
                g + "power_capped": rng.choice((0.0, 1.0)),
                g + "pcie_tx": rng.uniform(0, 2e9), g + "pcie_rx": rng.uniform(0, 8e9),
                g + "proc_mem": rng.uniform(18, 68) * gib, g + "sm_active": util * 0.8,
                g + "tensor_active": util * 0.4, g + "sm_occupancy": util * 0.3,
                g + "dram_active": rng.uniform(10, 60),
            })
        cores = [rng.uniform(0, 100) for _ in range(16)]
        row["cpu.util"] = sum(cores) / 16
        row["cpu.iowait"] = rng.uniform(0, 5)
        row.update({f"cpu.core{i}.util": c for i, c in enumerate(cores)})
        row.update({
            "proc.cpu": rng.uniform(90, 110), "proc.workers_cpu": rng.uniform(300, 700),
            "proc.workers": 8.0, "proc.rss": rng.uniform(6, 8) * gib, "mem.used": rng.uniform(60, 90) * gib,
            "mem.total": 512.0 * gib, "disk.read": rng.uniform(0, 5e8), "disk.write": rng.uniform(0, 1e7),
            "net.recv": rng.uniform(0, 1e8), "net.sent": rng.uniform(0, 1e7),
        })
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args("Memory of a Trace after a simulated 24 h at 10 Hz with 8 GPUs.")
    info = print_header("Trace memory: a long run at 10 Hz with 8 GPUs, default capacities")
    import resource

    import psutil

    from gpuwidget.trace import DEFAULT_SPAN_CAPACITY, Trace

    hours = 1.0 if args.quick else 24.0
    appends = int(hours * 3600 * RATE_HZ)
    spike_at_s = 3 * 3600.0 if hours >= 6 else hours * 3600 / 8
    spike_index = int(round(spike_at_s * RATE_HZ))
    rows = realistic_rows(256)
    spike_row = dict(rows[spike_index % len(rows)])
    spike_row[SPIKE_COLUMN] = SPIKE_VALUE
    columns = len(rows[0])
    print(f"  {hours:g} h at {RATE_HZ} Hz: {appends:,} appends of {columns} columns, "
          f"{appends:,} spans of each of 2 kinds; spike of {SPIKE_COLUMN}={SPIKE_VALUE} at t={spike_at_s:g} s")

    process = psutil.Process()
    gc.collect()
    rss_before = process.memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    trace = Trace()
    append = trace.append
    add_span = trace.add_span
    clock = time.perf_counter
    append_s = 0.0
    span_s = 0.0
    count = len(rows)
    started = clock()
    for k in range(appends):
        t = k / RATE_HZ
        row = spike_row if k == spike_index else rows[k % count]
        a = clock()
        append(t, row)
        b = clock()
        add_span("loader.wait", t, t + 0.012)
        add_span("step", t + 0.012, t + 0.1)
        span_s += clock() - b
        append_s += b - a
    total_s = clock() - started

    gc.collect()
    rss_after = process.memory_info().rss
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nbytes = trace.nbytes()
    rss_growth = rss_after - rss_before
    peak_growth = max(0, peak_after - max(peak_before, rss_before))

    a = clock()
    frame = trace.window()
    window_ms = 1e3 * (clock() - a)
    a = clock()
    trace.plot_view(["cpu.util", "gpu0.util", "gpu0.mem_used"], max_points=1000)
    plot_view_ms = 1e3 * (clock() - a)
    spike_max = float(max(frame.max[SPIKE_COLUMN]))
    where = int(frame.max[SPIKE_COLUMN].argmax())
    bucket_start = float(frame.t[where])
    width = trace.bucket_width_s
    spike_kept = spike_max == SPIKE_VALUE and bucket_start <= spike_at_s < bucket_start + width
    stats = trace.stats(SPIKE_COLUMN)
    stats_kept = stats is not None and stats.max == SPIKE_VALUE
    step_stats = trace.span_stats("step")
    kept_spans = len(trace.spans("step"))

    mb = 1e6
    print()
    table(["figure", "value"], [
        ["Trace.nbytes()", f"{nbytes / mb:.1f} MB"],
        ["RSS growth (psutil, after - before)", f"{rss_growth / mb:.1f} MB"],
        ["peak RSS growth (getrusage)", f"{peak_growth / mb:.1f} MB"],
        ["time per append", f"{1e6 * append_s / appends:.1f} us"],
        ["time per add_span", f"{1e6 * span_s / (2 * appends):.2f} us"],
        ["wall time of the whole simulation", f"{total_s:.1f} s"],
        ["rows appended / held", f"{trace.rows_total:,} / {len(trace):,}"],
        ["archive bucket width at the end", f"{width:g} s"],
        ["step spans counted / kept", f"{step_stats.count if step_stats else 0:,} / {kept_spans:,} "
                                      f"(capacity {DEFAULT_SPAN_CAPACITY:,} per kind)"],
        [f"spike in window().max[{SPIKE_COLUMN!r}]",
         f"{spike_max:g} in the bucket starting at {bucket_start:g} s" + ("" if spike_kept else " (LOST)")],
        ["spike in stats().max (exact, whole run)", f"{stats.max if stats else float('nan'):g}"],
        ["window() of the whole trace", f"{window_ms:.1f} ms ({len(frame):,} rows)"],
        ["plot_view(3 columns, 1000 points)", f"{plot_view_ms:.1f} ms"],
    ])
    print()
    verdicts = [
        verdict("Trace.nbytes() after the run", nbytes / mb, TARGET_MB, higher_is_better=False,
                shown=f"{nbytes / mb:.1f} MB", target_shown=f"{TARGET_MB:g} MB"),
        verdict("RSS growth around the run", rss_growth / mb, TARGET_MB, higher_is_better=False,
                shown=f"{rss_growth / mb:.1f} MB", target_shown=f"{TARGET_MB:g} MB"),
        verdict("peak RSS growth during the run (informational: transient, archive folds)",
                peak_growth / mb, TARGET_MB, higher_is_better=False, shown=f"{peak_growth / mb:.1f} MB",
                target_shown=f"{TARGET_MB:g} MB"),
    ]
    word = "PASS" if spike_kept and stats_kept else "MISS"
    print(f"{word}  spike at t={spike_at_s:g} s survives downsampling: window().max={spike_max:g}, "
          f"stats().max={stats.max if stats else float('nan'):g} (expected {SPIKE_VALUE:g})")
    verdicts.append({"target": "spike survives", "value": spike_max, "limit": SPIKE_VALUE, "op": "==",
                     "result": word})
    results: dict[str, Any] = {
        "hours": hours, "appends": appends, "columns": columns, "nbytes": nbytes, "rss_growth": rss_growth,
        "peak_rss_growth": peak_growth, "append_us": 1e6 * append_s / appends,
        "span_us": 1e6 * span_s / (2 * appends), "wall_s": total_s, "bucket_width_s": width,
        "rows_held": len(trace), "spike_kept": spike_kept, "window_ms": window_ms,
        "plot_view_ms": plot_view_ms,
    }
    write_json(args.json, {"benchmark": "trace_memory", "machine": info, "quick": args.quick,
                           "results": results, "verdicts": verdicts})


if __name__ == "__main__":
    main()
