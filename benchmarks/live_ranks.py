"""Per-rank strip of the live views: CPU time per update with 8 ranks of 10,000 steps each.

The live views (gpuwidget.ui.live, gpuwidget.ui.static) bring their per-rank strip up to date
on the sampler thread, every push of the Bokeh plot (0.25 s) or redraw of the static chart
(1 s): ``RankStrip.update()`` takes in the spans recorded since the last update and recomputes
each rank's window (data wait share, median step time) and the straggler. Here 8 ranks run
until each has taken 10,000 steps, their spans arriving as children send them (a batch per
rank every 0.3 s, gpuwidget.children.protocol.FLUSH_INTERVAL_S), one rank's loader slower; the
strip is updated every 0.25 s of the simulated run. Cases: steps of 20, 5 and 1 ms (10,000
steps in 200, 50 and 10 s). Also: the first update of a strip built over a Trace already full
(the Trace keeps the newest 20,000 spans of each kind), which a watch does not do (its Trace
starts empty), and the Bokeh view's whole ``LiveView.push()`` (outside a kernel) with the per-rank
table (brought up to date once a second) against the same spans from one process (no table).

Measured as thread CPU time (``time.thread_time()``), so other processes' load changes it
little. Target: < 2 ms per update.

    .venv/bin/python benchmarks/live_ranks.py [--quick] [--json PATH]
"""

from __future__ import annotations

import time
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN  # noqa: E402
from gpuwidget.trace import Trace  # noqa: E402
from gpuwidget.ui.rank_strip import RankStrip  # noqa: E402

TARGET_MS = 2.0
RANKS = 8
STEPS = 10_000
FLUSH_S = 0.3
UPDATE_S = 0.25
SLOW_RANK = 3


def deliver(trace: Trace, t0: float, t1: float, step_s: float, one_process: bool = False) -> None:
    """Each rank's spans that ended in [t0, t1), sent as one batch per kind (as a child's agent does);
    ``one_process``: the same spans as the watch's own process records them (no attrs, no strip)."""
    for rank in range(RANKS):
        attrs = None if one_process else {"pid": 10_000 + rank, "rank": rank}
        wait_share = 0.5 if rank == SLOW_RANK else 0.05
        k0, k1 = int(t0 / step_s), min(int(t1 / step_s), STEPS)
        if k1 <= k0:
            continue
        steps = [(k * step_s, (k + 1) * step_s) for k in range(k0, k1)]
        trace.add_spans(STEP_SPAN, steps, attrs)
        trace.add_spans(DATA_WAIT_SPAN, [(start, start + wait_share * step_s) for start, _ in steps], attrs)


def steady_state(step_s: float) -> dict[str, Any]:
    trace = Trace(start_clock=0.0)
    strip = RankStrip(trace)
    run_s = STEPS * step_s
    costs: list[float] = []
    sent, t = 0.0, 0.0
    while t < run_s + 2 * FLUSH_S:
        t += UPDATE_S
        while sent + FLUSH_S <= t:
            deliver(trace, sent, sent + FLUSH_S, step_s)
            sent += FLUSH_S
        started = time.thread_time()
        strip.update(now=t)
        costs.append((time.thread_time() - started) * 1000)
    rows = strip.rows
    ordered = sorted(costs)
    return {"step_ms": step_s * 1000, "run_s": run_s, "updates": len(costs), "median_ms": median(costs),
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": max(costs),
            "steps_per_rank": [row.steps for row in rows],
            "straggler": [row.label for row in rows if row.straggler]}


def catch_up(step_s: float) -> float:
    trace = Trace(start_clock=0.0)
    deliver(trace, 0.0, STEPS * step_s, step_s)
    strip = RankStrip(trace)
    started = time.thread_time()
    strip.update(now=STEPS * step_s)
    return (time.thread_time() - started) * 1000


def live_push(step_s: float, pushes: int, one_process: bool = False) -> float:
    """LiveView.push() (the plot's increment, the header and the per-rank table), median ms."""
    from gpuwidget.clock import now
    from gpuwidget.ui.live import LiveView

    trace = Trace(start_clock=now() - 1.0)
    view = LiveView(trace, {"gpus": [], "gpu_message": "no NVIDIA GPU found"})
    costs = []
    for k in range(pushes):
        t = trace.now()
        trace.append(t, {"cpu.util": 50.0, "proc.cpu": 90.0})
        deliver(trace, max(0.0, t - UPDATE_S), t, step_s, one_process)
        started = time.thread_time()
        view.push()
        costs.append((time.thread_time() - started) * 1000)
        time.sleep(0.01 if k else 3.1)  # past the first seconds, when every push resends the whole run
    view.close()
    return median(costs[1:])


def main() -> None:
    global STEPS
    args = parse_args(__doc__.splitlines()[0])
    if args.quick:
        STEPS = 1000
    header = print_header(f"Per-rank strip: CPU per update, {RANKS} ranks x {STEPS:,} steps")
    cases = [steady_state(step) for step in (0.020, 0.005, 0.001)]
    print("(a) RankStrip.update() every 0.25 s of the run, ms of thread CPU")
    table(["step", "run", "updates", "median", "p99", "max", "steps shown", "marked"],
          [[f"{c['step_ms']:g} ms", f"{c['run_s']:.0f} s", c["updates"], f"{c['median_ms']:.3f}",
            f"{c['p99_ms']:.3f}", f"{c['max_ms']:.3f}", min(c["steps_per_rank"]), ", ".join(c["straggler"]) or "-"]
           for c in cases])
    first = catch_up(0.005)
    print(f"(b) first update of a strip over a full Trace ({RANKS} x {STEPS:,} steps sent, 20,000 kept per "
          f"kind): {first:.1f} ms")
    push = live_push(0.005, 20 if args.quick else 80)
    alone = live_push(0.005, 20 if args.quick else 80, one_process=True)
    print(f"(c) LiveView.push() with the per-rank table, {RANKS} ranks at 5 ms steps: median {push:.2f} ms; "
          f"the same spans from one process (no table): {alone:.2f} ms")
    worst = max(c["median_ms"] for c in cases)
    p99 = max(c["p99_ms"] for c in cases)
    results = [verdict("strip update, 8 ranks, slowest case (median)", worst, TARGET_MS, higher_is_better=False,
                       shown=f"{worst:.3f} ms", target_shown=f"{TARGET_MS:g} ms"),
               verdict("strip update, 8 ranks, slowest case (p99)", p99, TARGET_MS, higher_is_better=False,
                       shown=f"{p99:.3f} ms", target_shown=f"{TARGET_MS:g} ms")]
    write_json(args.json, {**header, "steady_state": cases, "catch_up_ms": first, "live_push_ms": push,
                           "live_push_one_process_ms": alone,
                           "verdicts": results})


if __name__ == "__main__":
    main()
