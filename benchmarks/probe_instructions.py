"""The watch's cost per training step in CPU instructions: a figure the machine's load cannot move.

Timing ratios on a shared 2-core VM move by several percent between runs (BENCHMARKS.md section 20:
A/A controls from 0.95 to 1.0), more than the 1 % the design allows the watch. Instructions executed
do not depend on the neighbours: this script counts them with valgrind's cachegrind (``I refs``, no
cache simulation) for the 0.3 ms loop (benchmarks/_loops.py, ``fast``) in three arms, each in a
process of its own:

* ``bare``: the loop alone;
* ``probes``: the watch's workload probes installed (``gpuwidget.probes.Probes``), what the loop's own
  thread runs: the DataLoader probe's ``next()`` wrapper, the optimizer's post hook, the step probe's
  windows;
* ``watch``: ``probes`` plus what the sampler thread does at each tick (a :class:`gpuwidget.sampler.Sampler`
  with the host source and the probes' listeners, ticked synchronously every ``TICK_STEPS`` steps:
  as many steps as a 0.25 s tick spans on this loop): the host readings, the stack sampler, the
  probes' flushes and the Trace's row. Run synchronously, its instructions are counted where they
  would take the GIL from the loop.

Each arm runs ``WARMUP`` steps (the probes' first steps, the FLOP-counted one, the model probe's
calls), then ``N`` timed steps, for two values of N; the difference divided by the difference in
steps is the arm's instructions per step, with start-up (imports, warm-up) cancelled out. The
watch's cost is each arm's figure over the bare one's. ``--code DIR`` runs the arms against another
checkout (``git worktree add``), to compare versions in one run.

    .venv/bin/python benchmarks/probe_instructions.py [--quick] [--json PATH] [--code DIR ...]

About 2 minutes per process under valgrind (torch's import alone is a minute), two at a time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_header, table, verdict, write_json

ARMS = ("bare", "probes", "watch")
WARMUP = 1000  # past the probes' first steps (the FLOP counter is loaded at step 100)
TICK_STEPS = 800  # 0.25 s of 0.31 ms steps
TARGET = 1.01  # the design's 99 % throughput, as instructions: at most 1 % more per step


def child(arm: str, steps: int) -> None:
    """Run in the measured process: the loop, and in its arm, the probes and the sampler's ticks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _loops import make_loop

    run = make_loop("fast")
    tick: Any = None
    if arm != "bare":
        from gpuwidget.clock import now
        from gpuwidget.probes import Probes
        from gpuwidget.sampler import Sampler
        from gpuwidget.sources.host import HostSource
        from gpuwidget.trace import Trace

        trace = Trace()
        trace.start_clock = now()
        probes = Probes(trace)
        probes.poll()  # installs the probes (torch is imported)
        if arm == "watch":
            sampler = Sampler([HostSource()], trace, 0.25, [probes.poll], first=[probes.sample])
            tick = sampler.tick
        else:
            def tick() -> None:
                probes.sample()
                probes.poll()
    done, total = 0, WARMUP + steps
    while done < total:
        # Up to the next tick: step 100 (the first tick loads the FLOP counter, as the sampler thread
        # does), then every TICK_STEPS steps.
        boundary = 100 if done < 100 else (done // TICK_STEPS + 1) * TICK_STEPS
        block = min(boundary, total) - done if tick is not None else total - done
        run(block)
        done += block
        if tick is not None and done == boundary:
            tick()
    if tick is not None and arm != "bare":
        steps_probe = probes._steps
        assert steps_probe._flops is not None and getattr(steps_probe, "forwards_sampled", True), "not steady yet"


def instructions(arm: str, steps: int, code: Path) -> int:
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, __file__, "--child", arm, str(steps)]
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    found = re.search(r"I\s+refs:\s+([\d,]+)", result.stderr)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"{arm} {steps}: valgrind failed ({result.returncode}): {result.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    args = parse_args(__doc__.splitlines()[0], [("--code", {"action": "append", "metavar": "DIR",
                                                           "help": "also measure this checkout"})])
    if shutil.which("valgrind") is None:
        print("SKIP  probe_instructions: valgrind is not installed (apt-get install valgrind)")
        return
    codes = [ROOT, *(Path(code).resolve() for code in args.code or ())]
    short, long = (TICK_STEPS, 3 * TICK_STEPS) if not args.quick else (TICK_STEPS // 4, TICK_STEPS // 2)
    jobs = [(code, arm, steps) for code in codes for arm in (ARMS if code == ROOT else ARMS[1:])
            for steps in (short, long)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: instructions(job[1], job[2], job[0]), jobs)))
    per_step = {(code, arm): (counts[(code, arm, long)] - counts[(code, arm, short)]) / (long - short)
                for code, arm, _ in jobs}
    bare = per_step[(ROOT, "bare")]
    info = print_header("gpuwidget's cost per step in instructions (valgrind cachegrind)")
    rows = []
    results: dict[str, Any] = {"bare_per_step": bare, "steps": [short, long], "tick_steps": TICK_STEPS, "arms": []}
    for (code, arm), value in per_step.items():
        if arm == "bare":
            continue
        label = f"{arm} ({'this checkout' if code == ROOT else code.name})"
        rows.append([label, f"{value:,.0f}", f"{value - bare:,.0f}", f"{value / bare:.4f}"])
        results["arms"].append({"code": str(code), "arm": arm, "per_step": value, "extra": value - bare,
                                "ratio": value / bare})
    print(f"  bare loop: {bare:,.0f} instructions per step")
    table(["arm", "instructions per step", "beyond the bare loop", "ratio"], rows)
    watch = per_step[(ROOT, "watch")] / bare
    results["verdicts"] = [verdict("the watch's instructions per step over the bare loop's, 0.3 ms loop", watch,
                                   TARGET, higher_is_better=False, shown=f"{watch:.4f}", target_shown=str(TARGET))]
    write_json(args.json, {"benchmark": "probe_instructions", "machine": info, **results})


if __name__ == "__main__":
    main()
