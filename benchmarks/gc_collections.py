"""Python's garbage collections in a watched loop, and what a full collection costs in a large process.

(a) Issue 23's 0.3 ms loop (benchmarks/_loops.py), blocks of ``--steps`` steps bare and under
    ``gpuwidget.watch(quiet=True)`` (entered 1,500 steps before its block, past its first ticks),
    ``--rounds`` times in one process: the collections of each generation per 1,000 steps and their
    seconds, read through ``gc.callbacks``. Does a watch make the collector run more often?
(b) One full collection (``gc.collect()``), timed in this process after importing what a notebook
    kernel of the test suite holds (torch, Lightning, transformers, IPython, Bokeh), and again after
    ``gc.freeze()``: what a collection falling due inside a loop's ``next()`` pauses it for
    (probes.gc_pauses takes that time out of the loader's waits).

    .venv/bin/python benchmarks/gc_collections.py [--quick] [--json PATH] [--rounds N] [--steps N]
"""

from __future__ import annotations

import gc
import importlib
import time
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, write_json

setup_paths()

from _loops import make_loop  # noqa: E402

import gpuwidget  # noqa: E402

HEAVY_MODULES = ("torch", "pytorch_lightning", "transformers", "IPython", "bokeh.plotting")


class Collections:
    """Collections per generation and their seconds, while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = int(info["generation"])
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


def loop_collections(rounds: int, steps: int) -> dict[str, list[dict[str, Any]]]:
    run = make_loop("fast")
    run(2000)
    results: dict[str, list[dict[str, Any]]] = {"bare": [], "watch": []}
    for _ in range(rounds):
        for arm in ("bare", "watch"):
            watch = gpuwidget.watch(quiet=True) if arm == "watch" else None
            if watch is not None:
                watch.__enter__()
                run(1500)
            counter = Collections()
            gc.callbacks.append(counter)
            try:
                wall, _ = run(steps)
            finally:
                gc.callbacks.remove(counter)
                if watch is not None:
                    watch.__exit__(None, None, None)
            results[arm].append({"us_per_step": 1e6 * wall / steps,
                                 "per_1000": [1000 * n / steps for n in counter.count],
                                 "ms": [1e3 * s for s in counter.seconds]})
    return results


def collect_ms(repeats: int) -> float:
    """The median of ``repeats`` full collections, milliseconds."""
    timed = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        timed.append(1e3 * (time.perf_counter() - started))
    return median(timed)


def full_collection_ms(repeats: int) -> dict[str, float]:
    for name in HEAVY_MODULES:
        importlib.import_module(name)
    gc.collect()
    objects = len(gc.get_objects())
    full = collect_ms(repeats)
    gc.freeze()
    frozen = collect_ms(repeats)
    gc.unfreeze()
    return {"objects": objects, "full_ms": full, "frozen_ms": frozen}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--rounds", {"type": int, "default": 4}),
                                                ("--steps", {"type": int, "default": 5000})])
    rounds, steps = (1, 1000) if args.quick else (args.rounds, args.steps)
    header = print_header("Garbage collections: a watched loop's, and a full one's cost")
    loops = loop_collections(rounds, steps)
    rows = []
    for arm, blocks in loops.items():
        per = [median([block["per_1000"][g] for block in blocks]) for g in range(3)]
        ms = [median([block["ms"][g] for block in blocks]) for g in range(3)]
        rows.append([arm, f"{median([block['us_per_step'] for block in blocks]):.1f}",
                     *(f"{value:.2f}" for value in per), f"{sum(ms):.2f}"])
    table(["arm", "us a step", "gen 0 / 1000 steps", "gen 1", "gen 2", "collection ms a block"], rows)
    full = full_collection_ms(3 if args.quick else 7)
    table(["objects tracked", "a full collection, ms", "after gc.freeze(), ms"],
          [[full["objects"], f"{full['full_ms']:.0f}", f"{full['frozen_ms']:.1f}"]])
    write_json(args.json, {**header, "loops": loops, "full_collection": full})


if __name__ == "__main__":
    main()
