"""Stack sampler cost: what sampling the watched thread's stack at each tick takes (gpuwidget.probes.stack).

(a) Per tick: thread CPU time (``time.thread_time()``) of ``StackSampler.tick()`` on this thread,
    sampling another thread parked in a function of this file at a given stack depth (an IPython
    kernel's cell runs about 40 frames deep, a framework's fit loop deeper), with the spans a
    0.3 ms-per-step loop records between two ticks written into the Trace untimed: at 4 Hz, ~830
    each of ``step``, ``loader.wait``, ``train.step`` and ``train.between`` (a DataLoader feeding an
    optimizer: the most spans there can be). The tick reads those spans (``Trace.spans_since``), marks
    and decides its pending samples by bisection, and walks the stack.
(b) Per watch: the 0.3 ms-per-step loop of issue 23 (batch 8, an MLP 256-128-10, SGD, one torch
    thread, a ``TensorDataset`` in memory through a ``DataLoader``), watched with
    ``gpuwidget.watch(quiet=True)`` at the default interval, with the stack sampler against the
    same watch without it, in ABBA pairs (about 1.2 s of steps each, after 0.3 s untimed in the same
    block); the median throughput ratio, and the estimate from the parts, which other processes'
    load hardly moves: the stack sampler's CPU time over the timed steps' wall time (with a
    GIL-bound loop, at most what it takes from it).

Target: the stack sampler takes <= 0.1 % of the loop (a tenth of the 1 % overhead budget) at the
default interval.

    .venv/bin/python benchmarks/stack_cost.py [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from _common import median, parse_args, print_header, quartiles, setup_paths, table, verdict, write_json

setup_paths()

TARGET_SHARE = 0.001
STEP_S = 0.0003  # the loop's step, for the spans a tick finds


def parked(depth: int, started: threading.Event, release: threading.Event) -> None:
    if depth > 1:
        parked(depth - 1, started, release)
        return
    started.set()
    release.wait()


@contextlib.contextmanager
def parked_thread(depth: int) -> Iterator[threading.Thread]:
    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=parked, args=(depth, started, release), daemon=True)
    thread.start()
    started.wait(5)
    try:
        yield thread
    finally:
        release.set()
        thread.join(5)


def tick_cost(depth: int, interval: float, ticks: int, kinds: tuple[str, ...]) -> dict[str, float]:
    """CPU per tick with ``depth`` frames to walk and a 0.3 ms loop's spans of ``kinds`` per interval."""
    from gpuwidget.probes.stack import StackSampler
    from gpuwidget.trace import Trace

    per_tick = int(interval / STEP_S) if kinds else 0
    trace = Trace()
    out: list[float] = []
    with parked_thread(depth) as thread:
        sampler = StackSampler(trace, thread.ident)
        t = 0.0
        for _ in range(ticks):
            for kind in kinds:  # what the loop recorded since the last tick (untimed)
                trace.add_spans(kind, [(t + i * STEP_S, t + (i + 0.5) * STEP_S) for i in range(per_tick)])
            t += per_tick * STEP_S
            started = time.thread_time()
            sampler.tick()
            out.append(1e6 * (time.thread_time() - started))
        sampler.close()
    return {"median_us": median(out), "mean_us": sum(out) / len(out), "spans_per_tick": per_tick * len(kinds)}


def make_loop() -> Callable[[int], float]:
    """Issue 23's 0.3 ms-per-step loop; run(steps) -> wall seconds."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,))), batch_size=8,
                        shuffle=True)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def run(steps: int) -> float:
        done = 0
        started = time.perf_counter()
        while done < steps:
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
                done += 1
                if done >= steps:
                    break
        return time.perf_counter() - started

    return run


@contextlib.contextmanager
def without_stack_sampler() -> Iterator[None]:
    import gpuwidget.probes as probes

    original = probes._stack_sampler
    probes._stack_sampler = lambda trace: None
    try:
        yield
    finally:
        probes._stack_sampler = original


def per_watch(pairs: int, block_s: float) -> dict[str, Any]:
    import gpuwidget

    run = make_loop()
    run(2000)
    step = run(2000) / 2000
    steps, warm = max(200, int(block_s / step)), max(50, int(0.3 / step))
    ratios: list[float] = []
    shares: list[float] = []
    ticks_us: list[float] = []

    def block(stack: bool) -> float:
        context = contextlib.nullcontext() if stack else without_stack_sampler()
        with context, gpuwidget.watch(quiet=True) as watched:
            run(warm)
            seconds = run(steps)
        if stack:
            facts = watched.workload["stack_samples"]
            # Ticks over the timed steps at the default interval, each at the measured mean cost.
            shares.append(facts["tick_us"] * 1e-6 * (seconds / 0.25) / seconds)
            ticks_us.append(facts["tick_us"])
        return seconds

    for pair in range(pairs):
        order = (True, False) if pair % 2 else (False, True)
        seconds = {stack: block(stack) for stack in order}
        ratios.append(seconds[False] / seconds[True])  # throughput with / without
    q1, q3 = quartiles(ratios)
    return {"step_ms": 1e3 * step, "steps": steps, "pairs": pairs, "ratio_median": median(ratios), "ratio_q1": q1,
            "ratio_q3": q3, "share_median": median(shares), "tick_us_median": median(ticks_us)}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    info = print_header("Stack sampler cost (gpuwidget.probes.stack)")
    ticks = 60 if args.quick else 400
    from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
    from gpuwidget.probes.stack import BETWEEN_STEPS_SPAN, TRAIN_STEP_SPAN

    every = (STEP_SPAN, DATA_WAIT_SPAN, TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN)
    cases = [("40 frames, no spans", 40, 0.25, ()),
             ("40 frames, 0.3 ms steps at 4 Hz (4 kinds)", 40, 0.25, every),
             ("40 frames, 0.3 ms steps at 10 Hz (4 kinds)", 40, 0.1, every),
             ("120 frames, 0.3 ms steps at 4 Hz (4 kinds)", 120, 0.25, every)]
    rows, figures = [], {}
    for name, depth, interval, kinds in cases:
        cost = tick_cost(depth, interval, ticks, kinds)
        figures[name] = cost
        rows.append((name, cost["spans_per_tick"], cost["median_us"], cost["mean_us"],
                     f"{100 * cost['mean_us'] * 1e-6 / interval:.3f} %"))
    print("\n(a) StackSampler.tick(), thread CPU per tick")
    table(("case", "spans/tick", "median us", "mean us", "share of one core"), rows)
    watch = per_watch(pairs=2 if args.quick else 10, block_s=0.4 if args.quick else 1.2)
    print(f"\n(b) per watch, the 0.3 ms loop (step {watch['step_ms']:.3f} ms, {watch['steps']} timed steps a block)")
    table(("pairs", "throughput with / without (median)", "IQR", "stack sampler share (parts)", "tick us"),
          [(watch["pairs"], watch["ratio_median"], f"{watch['ratio_q1']:.3f} - {watch['ratio_q3']:.3f}",
            f"{100 * watch['share_median']:.3f} %", watch["tick_us_median"])])
    worst = figures["40 frames, 0.3 ms steps at 4 Hz (4 kinds)"]["mean_us"] * 1e-6 / 0.25
    verdicts = [verdict("stack sampler share of the loop at 4 Hz (parts, worst case of spans)", worst, TARGET_SHARE,
                        higher_is_better=False, shown=f"{100 * worst:.3f} %", target_shown="0.1 %"),
                verdict("stack sampler share of the 0.3 ms loop in a watch (parts)", watch["share_median"],
                        TARGET_SHARE, higher_is_better=False, shown=f"{100 * watch['share_median']:.3f} %",
                        target_shown="0.1 %")]
    write_json(args.json, {"machine": info, "ticks": figures, "watch": watch, "verdicts": verdicts})


if __name__ == "__main__":
    main()
