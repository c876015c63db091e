"""What a Python wrapper of the DataLoader's ``next()`` costs the 0.3 ms loop, in instructions and cache misses.

Wall-clock arms of a few us a step are below what this VM resolves (loop_thread_cost.py's blocks of one arm
spread by +-10 %), and a wrapper costs the loop several times its isolated time: the loop's own work evicts
the wrapper's code and data between calls. valgrind's cachegrind, with its cache simulation, counts both in
a way the neighbours cannot move: instructions (``I refs``), first-level instruction and data misses (``I1``,
``D1``) per step of issue 23's loop (benchmarks/_loops.py, ``fast``), each arm in a process of its own:

* ``bare``: the loop alone;
* ``pass``: a wrapper that only calls torch's ``next()``;
* ``time``: one that reads the clock before and after and extends a list by the two readings;
* ``time+shape``: the same, with the loader's slot and the batch's first dimension (``batch[0].shape[0]``)
  in the record, as the DataLoader probe's wrapper did for every batch before 35be919;
* ``probe``: the DataLoader probe itself (``torch_data.DataLoaderProbe``, its sampled calls off), its flush
  run on the loop's thread every ``TICK_STEPS`` steps (a watch runs it on the sampler thread).

Each arm runs ``WARMUP`` steps, then N steps, for two values of N; the difference over the difference in steps
is the arm's cost per step, with start-up cancelled out. ``--code DIR`` also runs the ``probe`` arm against
another checkout (``git worktree add``). Two processes at a time, about 3 minutes each.

    .venv/bin/python benchmarks/next_wrapper_cost.py [--quick] [--json PATH] [--code DIR ...] [--arm NAME ...]
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_header, table, write_json

ARMS = ("bare", "pass", "time", "time+shape", "probe")
WARMUP = 600
TICK_STEPS = 800  # 0.25 s of 0.31 ms steps
COUNTERS = {"instructions": r"I\s+refs:\s+([\d,]+)", "I1 misses": r"I1\s+misses:\s+([\d,]+)",
            "D1 misses": r"D1\s+misses:\s+([\d,]+)"}


def next_wrappers(original: Callable[[Any], Any], records: list[Any]) -> dict[str, Callable[[Any], Any]]:
    """Wrappers of torch's ``original`` DataLoader ``next()`` other than the probe's, by arm: the floor of any
    Python run at every ``next()`` (also loop_thread_cost.py's arms). They extend ``records``."""
    clock = time.perf_counter
    push = records.extend

    def passing(iterator: Any) -> Any:
        return original(iterator)

    def timing(iterator: Any) -> Any:
        started = clock()
        batch = original(iterator)
        push((started, clock()))
        return batch

    def timing_shape(iterator: Any) -> Any:
        started = clock()
        batch = original(iterator)
        push((0, started, clock(), batch[0].shape[0]))
        return batch

    return {"pass": passing, "time": timing, "time+shape": timing_shape}


def child(arm: str, steps: int) -> None:
    """Run in the measured process: the loop under one arm."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _loops import make_loop

    run = make_loop("fast")
    flush: Any = None
    if arm == "probe":
        from gpuwidget.clock import now
        from gpuwidget.probes import torch_data
        from gpuwidget.trace import Trace

        torch_data.CPU_SAMPLE_EVERY = 1 << 62  # one sampled call (the second), then none
        trace = Trace()
        trace.start_clock = now()
        probe = torch_data.DataLoaderProbe(trace)
        probe.install()
        flush = probe.flush
    elif arm != "bare":
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        records: list[Any] = []
        _BaseDataLoaderIter.__next__ = next_wrappers(_BaseDataLoaderIter.__next__, records)[arm]  # type: ignore

        def flush() -> None:
            records.clear()

    done, total, frozen = 0, WARMUP + steps, False
    while done < total:
        if done >= WARMUP and not frozen:  # what start-up made is left out of every later collection: a full
            gc.collect()  # collection of it (torch's modules) falling in one run's steps and not the other's
            gc.freeze()  # moved the per-step figures by thousands of instructions between processes
            frozen = True
        block = min(TICK_STEPS - done % TICK_STEPS, total - done)
        run(block)
        done += block
        if flush is not None and done % TICK_STEPS == 0:
            flush()


def counters(arm: str, steps: int, code: Path) -> dict[str, int]:
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--cachegrind-out-file=/dev/null",
               sys.executable, __file__, "--child", arm, str(steps)]
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    found = {name: re.search(pattern, result.stderr) for name, pattern in COUNTERS.items()}
    if result.returncode != 0 or not all(found.values()):
        raise RuntimeError(f"{arm} {steps}: valgrind failed ({result.returncode}): {result.stderr[-2000:]}")
    return {name: int(match.group(1).replace(",", "")) for name, match in found.items() if match}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    args = parse_args(__doc__.splitlines()[0], [
        ("--code", {"action": "append", "metavar": "DIR", "help": "also measure the probe arm of this checkout"}),
        ("--arm", {"action": "append", "choices": ARMS, "help": "only this arm (and bare); repeat for several"}),
    ])
    if shutil.which("valgrind") is None:
        print("SKIP  next_wrapper_cost: valgrind is not installed (apt-get install valgrind)")
        return
    arms = ["bare", *(arm for arm in ARMS[1:] if not args.arm or arm in args.arm)]
    codes = [ROOT, *(Path(code).resolve() for code in args.code or ())]
    short, long = (TICK_STEPS, 3 * TICK_STEPS) if not args.quick else (TICK_STEPS // 4, TICK_STEPS // 2)
    jobs = [(code, arm, steps) for code in codes for arm in (arms if code == ROOT else ["probe"])
            for steps in (short, long)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: counters(job[1], job[2], job[0]), jobs)))
    per_step = {(code, arm): {name: (counts[(code, arm, long)][name] - counts[(code, arm, short)][name])
                              / (long - short) for name in COUNTERS}
                for code, arm, _ in jobs}
    bare = per_step[(ROOT, "bare")]
    info = print_header("A DataLoader next() wrapper's cost per step of the 0.3 ms loop (cachegrind)")
    rows, results = [], []
    for (code, arm), figures in per_step.items():
        label = arm if code == ROOT else f"{arm} ({code.name})"
        extra = {name: figures[name] - bare[name] for name in COUNTERS}
        rows.append([label, *(f"{figures[name]:,.0f}" if arm == "bare" else f"+{extra[name]:,.0f}"
                              for name in COUNTERS)])
        results.append({"arm": arm, "code": str(code), "per_step": figures, "beyond_bare": extra})
    print(f"  per step; arms beyond the bare loop ({short} and {long} steps after {WARMUP})")
    table(["arm", *COUNTERS], rows)
    write_json(args.json, {"benchmark": "next_wrapper_cost", "machine": info, "arms": results})


if __name__ == "__main__":
    main()
