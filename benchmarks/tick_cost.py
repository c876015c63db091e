"""The sampler thread's CPU on the 0.3 ms loop, per tick and per second, by part; this checkout against others.

Each round starts one fresh process per checkout (this one, and each ``--code DIR``: a ``git worktree``
of an older commit), in rotating order. The process runs issue 23's 0.3 ms loop (benchmarks/_loops.py)
2000 steps unwatched, then ``--steps`` steps under ``gpuwidget.watch(quiet=True)`` at the default
interval, and reports the thread CPU time (``time.thread_time``) of every sampler tick and of its parts:
the host source's read, the GPU source's read (and each NVML function's calls, where a driver
answers), the tick's first stack sample, the probes' poll (the stack sampler's spans,
the probes' flushes), and the Trace's row. Each part is timed by a wrapper around the method where the
checkout has it (a few microseconds a call, alike for every checkout).

The figure is the sampler thread's CPU per second of the watched loop: with a GIL-bound loop, what the
thread's work (with the GIL held for most of it) can take from the loop. The "steady" columns leave out
the watch's first 30 % of steps (its first ticks and one-offs, such as the FLOP counter's load): what a
long cell pays a second. Thread CPU is the sampler's own
work, which a busy neighbour moves far less than it moves the loop's wall time.

With ``--reader thread --reader process`` each checkout runs twice a round, the host read on the
sampler's thread and by the reader process (gpuwidget.sources.reader): the reader's part is the
request and its answer (thread CPU: mostly the system calls, made without the GIL). ``--fake-gpus N``
reads N fake GPUs (tests/fakenvml.py, in the measured process and in its reader) in place of the
machine's: what a GPU source's Python costs a tick, the driver's own time left out.

    .venv/bin/python benchmarks/tick_cost.py [--quick] [--json PATH] [--rounds N] [--steps N] [--code DIR ...]
        [--reader thread|process ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, median, parse_args, print_header, table, verdict, write_json

# (label, module, class, method): the parts of a tick, where a checkout has them.
PARTS = (
    ("tick", "gpuwidget.sampler", "Sampler", "_tick"),
    ("wait for the tick (prompt GIL: two wakes)", "gpuwidget.sampler", "Sampler", "_wait_until"),
    ("host source", "gpuwidget.sources.host", "HostSource", "read"),
    ("host source from the reader process", "gpuwidget.sources.reader", "RemoteHostSource", "read"),
    ("GPU source (NVML)", "gpuwidget.sources.nvml.source", "NvmlSource", "read"),
    ("GPU sources from the reader process", "gpuwidget.sources.reader", "RemoteGpuSource", "read"),
    ("stack sample (tick's first)", "gpuwidget.probes", "Probes", "sample"),
    ("probes' poll", "gpuwidget.probes", "Probes", "poll"),
    ("  stack sampler's spans", "gpuwidget.probes.stack", "StackSampler", "tick"),
    ("  DataLoader probe's flush", "gpuwidget.probes.torch_data", "DataLoaderProbe", "flush"),
    ("  step probe's flush", "gpuwidget.probes.torch_steps", "StepProbe", "flush"),
    ("Trace row", "gpuwidget.trace", "Trace", "append"),
)
# The tool's sampler alone, per second of the loop, against the budget for the whole watch.
BUDGET_SHARE = 0.01

CHILD = r"""
import importlib, json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from _loops import make_loop
import gpuwidget
parts = json.loads(sys.argv[3])
spent = {label: [0, 0] for label, *_ in parts}  # label -> [calls, thread CPU ns]
def timed(function, cell):
    def wrapper(*args, **kwargs):
        started = time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            cell[0] += 1
            cell[1] += time.thread_time_ns() - started
    return wrapper
for label, module, cls, method in parts:
    try:
        owner = getattr(importlib.import_module(module), cls, None)
    except ImportError:  # a checkout from before that module
        continue
    if owner is not None and hasattr(owner, method):
        setattr(owner, method, timed(getattr(owner, method), spent[label]))
nvml_calls = {}  # NVML function -> [calls, thread CPU ns], from every caller
try:
    import pynvml
except ImportError:
    pynvml = None
for name in dir(pynvml) if pynvml is not None else ():
    function = getattr(pynvml, name)
    if name.startswith("nvml") and callable(function) and not isinstance(function, type):
        setattr(pynvml, name, timed(function, nvml_calls.setdefault(name, [0, 0])))
if int(sys.argv[5]):  # fake GPUs (tests/fakenvml.py), in this process and, by sitecustomize, in the reader
    sys.path.insert(0, sys.argv[6])
    from fakenvml import FakeNvml
    _patch = FakeNvml.gpus(int(sys.argv[5])).patched()
    _patch.__enter__()
run = make_loop("fast")
run(2000)
steps = int(sys.argv[4])
first = steps * 3 // 10
with gpuwidget.watch(quiet=True):
    first_wall, _ = run(first)  # the watch's first ticks and one-offs (the FLOP counter's load)
    mark = {label: list(cell) for label, cell in spent.items()}
    rest_wall, _ = run(steps - first)
    steady = {label: [cell[0] - mark[label][0], cell[1] - mark[label][1]] for label, cell in spent.items()}
nvml_calls = {name: cell for name, cell in nvml_calls.items() if cell[0]}
print(json.dumps({"wall_s": first_wall + rest_wall, "steps": steps, "parts": spent, "nvml": nvml_calls,
                  "steady_wall_s": rest_wall, "steady_parts": steady}))
"""


# With --fake-gpus: a Python started with this folder first on its path (the watch's reader process is
# started with the watched process's sys.path) gets the same fake GPUs as the measured process.
SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {tests!r})
from fakenvml import FakeNvml
_patch = FakeNvml.gpus({count}).patched()
_patch.__enter__()
"""


def measure(code: Path, steps: int, reader: str, fake_gpus: int = 0, site: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), "GPUWIDGET_READER": reader}
    if fake_gpus and site is not None:
        env["PYTHONPATH"] = os.pathsep.join((str(site), str(code)))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(code), str(ROOT / "benchmarks"), json.dumps(PARTS), str(steps),
         str(fake_gpus), str(ROOT / "tests")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{code}: the watched loop failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def nvml_table(done: list[dict[str, Any]]) -> None:
    """Where a driver answers: each NVML function's thread CPU (the sampler's calls and any other), by cost."""
    names = {name for r in done for name in r.get("nvml", {})}
    if not names:
        return

    def figure(name: str, index: int, per: str) -> float:
        cells = [(r.get("nvml", {}).get(name, [0, 0]), r["wall_s"]) for r in done]
        if per == "call":
            return median([cell[1] / 1e3 / cell[0] for cell, _ in cells if cell[0]])
        return median([cell[index] / (1e3 if index else 1) / wall for cell, wall in cells])

    rows = sorted(names, key=lambda name: figure(name, 1, "second"), reverse=True)
    print("  NVML functions, by their thread CPU a second of the loop:")
    table(["NVML function", "calls a second", "us a call", "us a second of the loop", "share of a core"],
          [(name, figure(name, 0, "second"), figure(name, 1, "call"), figure(name, 1, "second"),
            f"{figure(name, 1, 'second') / 1e4:.3f} %") for name in rows])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [
        ("--code", {"action": "append", "metavar": "DIR", "help": "another checkout to measure beside this one"}),
        ("--rounds", {"type": int, "default": 5}),
        ("--steps", {"type": int, "default": 30000, "help": "watched steps a run (0.3 ms each on a quiet VM)"}),
        ("--reader", {"action": "append", "choices": ("thread", "process"),
                      "help": "where the host is read (GPUWIDGET_READER); both given: each is an arm"}),
        ("--fake-gpus", {"type": int, "default": 0,
                         "help": "read this many fake GPUs (tests/fakenvml.py) instead of the machine's"}),
    ])
    info = print_header("The sampler thread's CPU on the 0.3 ms loop, by part")
    rounds, steps = (1, 5000) if args.quick else (args.rounds, args.steps)
    readers = args.reader or ["thread"]
    # Older checkouts may have no reader process: they run the default only.
    arms = [*((ROOT, reader) for reader in readers), *((Path(code).resolve(), "thread") for code in args.code or ())]
    runs: dict[tuple[Path, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as site:
        if args.fake_gpus:
            print(f"  {args.fake_gpus} fake GPUs (tests/fakenvml.py) in place of the machine's")
            Path(site, "sitecustomize.py").write_text(
                SITECUSTOMIZE.format(tests=str(ROOT / "tests"), count=args.fake_gpus))
        for round_ in range(rounds):
            for code, reader in arms[round_ % len(arms):] + arms[:round_ % len(arms)]:
                runs[code, reader].append(measure(code, steps, reader, args.fake_gpus, Path(site)))
    results: dict[str, Any] = {"machine": info, "rounds": rounds, "steps": steps, "checkouts": []}
    for code, reader in arms:
        name = "this checkout" if code == ROOT else code.name
        name += f", GPUWIDGET_READER={reader}" if args.reader else ""
        done = runs[code, reader]
        per_s = {label: median([r["parts"][label][1] / 1e3 / r["wall_s"] for r in done]) for label, *_ in PARTS}
        steady_s = {label: median([r["steady_parts"][label][1] / 1e3 / r["steady_wall_s"] for r in done])
                    for label, *_ in PARTS}
        per_call = {label: median([r["parts"][label][1] / 1e3 / max(1, r["parts"][label][0]) for r in done])
                    for label, *_ in PARTS}
        calls_per_s = {label: median([r["parts"][label][0] / r["wall_s"] for r in done]) for label, *_ in PARTS}
        step_ms = median([1e3 * r["wall_s"] / r["steps"] for r in done])
        print(f"\n{name} ({code}): {rounds} runs of {steps} watched steps, {step_ms:.3f} ms a step (median)")
        table(["part", "calls a second", "us a call", "us a second of the loop", "share of a core",
               "steady: us a second", "steady: share"],
              [(label, calls_per_s[label], per_call[label], per_s[label], f"{per_s[label] / 1e4:.3f} %",
                steady_s[label], f"{steady_s[label] / 1e4:.3f} %")
               for label, *_ in PARTS if calls_per_s[label]])
        nvml_table(done)
        results["checkouts"].append({"code": str(code), "reader": reader, "step_ms": step_ms, "us_per_s": per_s,
                                     "steady_us_per_s": steady_s, "us_per_call": per_call,
                                     "calls_per_s": calls_per_s, "runs": done})
    print()
    results["verdicts"] = [
        verdict(f"the sampler thread's share of a core, 0.3 ms loop, default interval, reader {arm['reader']}, "
                f"{span}", arm[key]["tick"] / 1e6, BUDGET_SHARE / 2, higher_is_better=False,
                shown=f"{arm[key]['tick'] / 1e4:.2f} %",
                target_shown=f"{100 * BUDGET_SHARE / 2:.1f} % (half the watch's 1 % budget)")
        for arm in results["checkouts"] if arm["code"] == str(ROOT)
        for key, span in (("us_per_s", "whole watch"), ("steady_us_per_s", "past its first 30 % of steps"))]
    write_json(args.json, results)


if __name__ == "__main__":
    main()
