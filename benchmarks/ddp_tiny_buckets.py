"""How often ddp-communication names a DDP job whose buckets are far too small, and on what figures.

Runs tests/test_rules_ranks.py's two gloo ranks (``train_ranks``: 36 buckets of 16.6 KB, then a
straggler phase) ``--runs`` times and prints, for each run, whether the rule named the tiny buckets,
the ranks' step jitter (the MAD the rule compares the exposed all-reduce with), and per rank: the
median step, DDP's average and latest figures (compute ms, exposed all-reduce ms), how many of the
iterations the probe kept describe typical steady steps, and the all-reduce the rule judged.
Start a CPU hog beside it (``sh -c 'while :; do :; done' &``) to see a busy host.

    .venv/bin/python benchmarks/ddp_tiny_buckets.py --runs 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_rules_ranks as job  # noqa: E402

from gpuwidget.advice.rules import ddp_communication  # noqa: E402
from gpuwidget.advice.rules._ranks import (  # noqa: E402
    ddp_iterations,
    ddp_timings,
    median,
    step_jitter_s,
    step_series,
    typical_ddp_step,
)


def one_run() -> tuple[bool, str]:
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(job.train_ranks, args=(2, job.free_port(), results), nprocs=2, start_method="spawn")
    ranks = [entry[1] for entry in sorted((results.get() for _ in range(2)), key=lambda item: item[0])]
    named = ddp_communication.check({}, {"model": None, "loaders": [], "ranks": ranks}, job.NO_GPU) is not None
    parts = [f"jitter {step_jitter_s(ranks) * 1e3:.1f} ms"]
    for rank in ranks:
        series = step_series(rank)
        figures = ", ".join(f"{t.which} {t.compute_s * 1e3:.1f}/{t.exposed_s * 1e3:.1f}"
                            for t in ddp_timings(rank, typical_only=False))
        judged = typical_ddp_step(rank)
        parts.append(f"rank {rank['rank']}: step {median(series[0]) * 1e3:.1f} ms" if series else "no steps")
        parts.append(f"  {figures}; typical steady iterations {len(ddp_iterations(rank))}; judged "
                     + (f"{judged.which} {judged.exposed_s * 1e3:.1f} ms" if judged else "none"))
    return named, "\n  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    runs = parser.parse_args().runs
    named = 0
    for index in range(runs):
        found, figures = one_run()
        named += found
        print(f"run {index + 1}: {'named' if found else 'NOT NAMED'}\n  {figures}", flush=True)
    print(f"named in {named} of {runs} runs")


if __name__ == "__main__":
    main()
