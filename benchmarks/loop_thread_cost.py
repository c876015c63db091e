"""What a watch costs the loop's own thread on the 0.3 ms loop, arm by arm, in one process.

The wall-clock ratio (overhead.py) says how much slower a watched loop runs; this says where the time
goes. Each arm wraps ``--steps`` steps of issue 23's 0.3 ms loop (benchmarks/_loops.py), the arms in
a new random order each round (so no arm always follows the same other), ``--rounds`` times, all in one
process, a full collection before each block. For each block the loop thread's own user and
system CPU (``getrusage(RUSAGE_THREAD)``) and its voluntary context switches (each one a wait for the
GIL, or a sleep) are read, per step, against the bare loop's in the same rounds:

* ``watch``: ``gpuwidget.watch(quiet=True)``, entered ``--settle`` steps before the block (past a
  watch's first steps and first ticks: see ``first steps`` below);
* ``watch, reader process``: the same with ``GPUWIDGET_READER=process``; ``watch, as in a long cell``:
  the same with its loader's sampled waits already enough, as a cell is past its first seconds of
  training (the sampled next() calls then spaced: torch_data.sample_stride);
* ``watch without its probes`` (the sampler thread, its sources and the stack sampler), ``... without
  its stack sampler``, ``... without the prompt GIL`` (the switch interval never lowered before a tick):
  what each part of the watch costs, by difference with ``watch``;
* ``probes``: the DataLoader and step probes alone (no sampler thread, no watch), past their first
  steps and flushes; ``DataLoader probe``, ``... its waits sampled enough`` (as after a long run's
  first seconds: its sampled next() calls spaced, torch_data.sample_stride), ``... never sampled`` (no
  next() read with its CPU and run delay), ``... one in eight sampled`` (throughout, as in a loop's first
  sampled waits) and ``... without the CPU clock reads`` (the two schedstat reads only, as before
  ef5d704), ``step probe``: each alone;
* the floor of any Python run at each ``next()``: ``a next() wrapper that only calls torch's``, and
  ``... with two clock reads and a two-number record`` (no loader, no samples, no sampled calls);
* threads that take the GIL but add nothing to the loop's thread: ``a thread waking 70 times a
  second`` (20 us of Python each), ``a thread holding the GIL 1.5 ms 4 times a second``.

``first steps`` times fresh watches' first 2,000 steps in blocks of 250 against the bare loop's (each
watch beside a bare run of as many steps, ``--first-rounds`` of each, medians per block): a watch's first
steps run with torch's global module hooks until the step probe has read what they are for
(probes.torch_steps), and its first ticks set up the Trace. ``--first-only`` runs that alone.

    .venv/bin/python benchmarks/loop_thread_cost.py [--quick] [--json PATH] [--rounds N] [--steps N] [--arm NAME ...]
        [--first-rounds N] [--first-only]
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, write_json

setup_paths()

from _loops import make_loop  # noqa: E402

import gpuwidget  # noqa: E402
from gpuwidget.trace import Trace  # noqa: E402

Arm = Callable[[], contextlib.AbstractContextManager[Any]]


def thread_usage() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime, usage.ru_nvcsw


def arms(run: Callable[[int], Any], settle: int) -> dict[str, Arm]:
    @contextlib.contextmanager
    def watch(reader: str = "thread", enough: bool = False) -> Iterator[None]:
        saved = os.environ.get("GPUWIDGET_READER")
        os.environ["GPUWIDGET_READER"] = reader
        try:
            with gpuwidget.watch(quiet=True):
                run(settle)  # past the first tick: the step probe lean
                if enough:  # as a long cell is after its loaders' first seconds (torch_data.sample_stride)
                    from gpuwidget import session
                    from gpuwidget.probes import torch_data

                    data = session._active._probes._data  # type: ignore[union-attr]
                    for stats in data.stats:
                        stats.wait_sampled += torch_data.SAMPLED_WAIT_ENOUGH_S
                yield
        finally:
            if saved is None:
                os.environ.pop("GPUWIDGET_READER", None)
            else:
                os.environ["GPUWIDGET_READER"] = saved

    @contextlib.contextmanager
    def watch_without(part: str) -> Iterator[None]:
        """A watch with one of its parts left out: ``probes`` (no DataLoader, step or model probe: the
        sampler thread, its sources and the stack sampler only), ``stack`` (no stack sampler), ``prompt``
        (the stack sample's prompt GIL off: the switch interval never lowered)."""
        import gpuwidget.probes as probes_module
        import gpuwidget.sampler as sampler_module

        saved_init, saved_stack = probes_module.Probes.__init__, probes_module._stack_sampler
        saved_switch = sampler_module.PROMPT_SWITCH_S
        if part == "probes":
            def closed(self: Any, trace: Trace) -> None:
                saved_init(self, trace)
                self._closed = True
            probes_module.Probes.__init__ = closed  # type: ignore[method-assign]
        elif part == "stack":
            probes_module._stack_sampler = lambda trace: None
        elif part == "prompt":
            sampler_module.PROMPT_SWITCH_S = 1.0  # above any switch interval: never lowered
        try:
            with watch():
                yield
        finally:
            probes_module.Probes.__init__ = saved_init  # type: ignore[method-assign]
            probes_module._stack_sampler = saved_stack
            sampler_module.PROMPT_SWITCH_S = saved_switch

    @contextlib.contextmanager
    def probes(data_on: bool = True, steps_on: bool = True, sampled: bool = True,
               enough: bool = False, eighth: bool = False, cpu_clock: bool = True) -> Iterator[None]:
        from gpuwidget.probes import torch_data
        from gpuwidget.probes.torch_data import DataLoaderProbe
        from gpuwidget.probes.torch_model import ModelProbe
        from gpuwidget.probes.torch_steps import StepProbe

        every, stride, clock = torch_data.CPU_SAMPLE_EVERY, torch_data.sample_stride, torch_data.cpu_clock
        if not sampled:
            torch_data.CPU_SAMPLE_EVERY = 1 << 62
        if eighth:  # one next() in CPU_SAMPLE_EVERY sampled throughout, as in a loop's first sampled waits
            torch_data.sample_stride = lambda *args: every
        if not cpu_clock:  # the two schedstat reads only, as before ef5d704
            torch_data.cpu_clock = lambda: 0.0
        trace = Trace()
        data = DataLoaderProbe(trace) if data_on else None
        model = ModelProbe()
        steps = StepProbe(trace, model, data) if steps_on else None
        if data is not None:
            data.install()
        if steps is not None:
            model.install()
            steps.install()
        try:
            run(200)
            for _ in range(3):  # what the sampler's first ticks do: the step probe goes lean
                if data is not None:
                    data.flush()
                if steps is not None:
                    steps.flush()
                    steps.prepare()
                run(100)
            if enough and data is not None:  # as after a long run's first seconds (torch_data.sample_stride)
                for stats in data.stats:
                    stats.wait_sampled += torch_data.SAMPLED_WAIT_ENOUGH_S
            yield
        finally:
            torch_data.CPU_SAMPLE_EVERY, torch_data.sample_stride, torch_data.cpu_clock = every, stride, clock
            if steps is not None:
                steps.flush()
                steps.uninstall()
                model.uninstall()
            if data is not None:
                data.uninstall()

    @contextlib.contextmanager
    def wrapper(kind: str) -> Iterator[None]:
        """A next() wrapper of torch's DataLoader iterators other than the probe's (next_wrapper_cost.py's)."""
        from next_wrapper_cost import next_wrappers
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original = _BaseDataLoaderIter.__next__
        _BaseDataLoaderIter.__next__ = next_wrappers(original, [])[kind]  # type: ignore[method-assign]
        try:
            yield
        finally:
            _BaseDataLoaderIter.__next__ = original  # type: ignore[method-assign]

    @contextlib.contextmanager
    def thread(wakes: float, work_s: float) -> Iterator[None]:
        stop = threading.Event()

        def body() -> None:
            while not stop.wait(1.0 / wakes):
                end = time.thread_time() + work_s
                while time.thread_time() < end:
                    pass

        worker = threading.Thread(target=body, daemon=True)
        worker.start()
        try:
            yield
        finally:
            stop.set()
            worker.join()

    return {
        "bare": contextlib.nullcontext,
        "watch": watch,
        "watch, reader process": lambda: watch("process"),
        "watch without its probes": lambda: watch_without("probes"),
        "watch without its stack sampler": lambda: watch_without("stack"),
        "watch without the prompt GIL": lambda: watch_without("prompt"),
        "watch, as in a long cell (its loader's waits sampled enough)": lambda: watch(enough=True),
        "probes (DataLoader + step)": probes,
        "DataLoader probe": lambda: probes(steps_on=False),
        "DataLoader probe, its waits sampled enough": lambda: probes(steps_on=False, enough=True),
        "DataLoader probe, never sampled": lambda: probes(steps_on=False, sampled=False),
        "DataLoader probe, one in eight sampled": lambda: probes(steps_on=False, eighth=True),
        "... without the CPU clock reads": lambda: probes(steps_on=False, eighth=True, cpu_clock=False),
        "step probe": lambda: probes(data_on=False),
        "a next() wrapper that only calls torch's": lambda: wrapper("pass"),
        "a next() wrapper with two clock reads and a two-number record": lambda: wrapper("time"),
        "a thread waking 70 times a second": lambda: thread(70, 20e-6),
        "a thread holding the GIL 1.5 ms 4 times a second": lambda: thread(4, 1.5e-3),
    }


def first_steps(run: Callable[[int], Any], blocks: int, size: int, watched: bool = True) -> list[float]:
    """Wall us a step of a fresh watch's first ``blocks`` x ``size`` steps (or of as many bare steps)."""
    times = []
    with gpuwidget.watch(quiet=True) if watched else contextlib.nullcontext():
        for _ in range(blocks):
            started = time.perf_counter()
            run(size)
            times.append(1e6 * (time.perf_counter() - started) / size)
    return times


def first_steps_rounds(run: Callable[[int], Any], rounds: int) -> dict[str, list[float]]:
    """Medians per block of ``rounds`` fresh watches' first steps and as many bare runs, alternated."""
    watched, bare = [], []
    first_steps(run, 8, 250)  # the process's first watch loads what every later one reuses (the FLOP counter)
    for round_ in range(rounds):
        for is_watched in ((True, False) if round_ % 2 else (False, True)):
            (watched if is_watched else bare).append(first_steps(run, 8, 250, watched=is_watched))
    return {"watched": [median(list(block)) for block in zip(*watched)],
            "bare": [median(list(block)) for block in zip(*bare)]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [
        ("--rounds", {"type": int, "default": 8}),
        ("--steps", {"type": int, "default": 5000, "help": "steps a block (0.3 ms each on a quiet VM)"}),
        ("--settle", {"type": int, "default": 1500, "help": "watched steps before a watch's block"}),
        ("--arm", {"action": "append", "metavar": "NAME",
                   "help": "only this arm (and the bare loop); repeat for several; default: every arm"}),
        ("--first-rounds", {"type": int, "default": 3, "help": "fresh watches (and bare runs) for first steps"}),
        ("--first-only", {"action": "store_true", "help": "only the first steps"}),
    ])
    info = print_header("The loop thread's own CPU under each part of a watch, 0.3 ms loop")
    rounds, steps = (2, 1000) if args.quick else (args.rounds, args.steps)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run = make_loop("fast")
    run(3000)
    if args.first_only:
        report_first_steps(run, 1 if args.quick else args.first_rounds, args.json, info)
        return
    table_arms = arms(run, args.settle)
    unknown = set(args.arm or ()) - set(table_arms)
    if unknown:
        raise SystemExit(f"no arm {sorted(unknown)}; the arms: {list(table_arms)}")
    names = ["bare", *(name for name in table_arms if name != "bare" and (not args.arm or name in args.arm))]
    blocks: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    shuffle = random.Random(23)
    for _ in range(rounds):
        # A new order each round: rotating one order gave every arm the same predecessor in every round,
        # so what one arm leaves behind (its garbage, its threads' last wakes) fell on the same other arm.
        order = names[:]
        shuffle.shuffle(order)
        for name in order:
            gc.collect()
            with table_arms[name]():
                user, system, switches = thread_usage()
                started = time.perf_counter()
                run(steps)
                wall = time.perf_counter() - started
                user2, system2, switches2 = thread_usage()
            blocks[name].append((1e6 * wall / steps, 1e6 * (user2 - user) / steps, 1e6 * (system2 - system) / steps,
                                 1e3 * (switches2 - switches) / steps))
    bare = [median([b[i] for b in blocks["bare"]]) for i in range(4)]
    rows, results = [], {}
    for name in names:
        figures = [median([b[i] for b in blocks[name]]) for i in range(4)]
        cpu = figures[1] + figures[2]
        extra = cpu - (bare[1] + bare[2])
        extra_wall = figures[0] - bare[0]
        results[name] = {"wall_us": figures[0], "user_us": figures[1], "system_us": figures[2],
                         "voluntary_switches_per_1000_steps": figures[3], "extra_cpu_us": extra,
                         "extra_wall_us": extra_wall,
                         "blocks": blocks[name]}
        rows.append((name, figures[0], figures[1], figures[2], figures[3],
                     "-" if name == "bare" else f"{extra:+.1f} us ({100 * extra / (bare[1] + bare[2]):+.1f} %)",
                     "-" if name == "bare" else f"{extra_wall:+.1f} us ({100 * extra_wall / bare[0]:+.1f} %)"))
    print(f"\n  {rounds} rounds of {steps} steps an arm (medians); the loop thread's own CPU a step")
    table(["arm", "wall us a step", "user us", "system us", "voluntary switches / 1000 steps",
           "CPU beyond the bare loop's", "wall beyond the bare loop's"], rows)
    early = report_first_steps(run, 1 if args.quick else args.first_rounds)
    write_json(args.json, {"machine": info, "rounds": rounds, "steps": steps, "arms": results, "first_steps_us": early})


def report_first_steps(run: Callable[[int], Any], rounds: int, json_path: str | None = None,
                       info: dict[str, Any] | None = None) -> dict[str, list[float]]:
    early = first_steps_rounds(run, rounds)
    extra = [1e-3 * 250 * (w - b) for w, b in zip(early["watched"], early["bare"])]
    print(f"\n  first steps: fresh watches' first 2,000 steps against bare runs ({rounds} of each, medians),"
          " us a step per 250:")
    print("    watched:", " ".join(f"{value:.0f}" for value in early["watched"]))
    print("    bare:   ", " ".join(f"{value:.0f}" for value in early["bare"]))
    print(f"    the watch's extra wall time over those 2,000 steps: {sum(extra):.1f} ms"
          f" (first 500 steps: {sum(extra[:2]):.1f} ms)")
    if json_path is not None:
        write_json(json_path, {"machine": info, "first_steps_us": early})
    return early


if __name__ == "__main__":
    main()
