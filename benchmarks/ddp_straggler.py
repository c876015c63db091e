"""How close a DDP straggler's evidence comes to each of rank-straggler's gates, run after run.

Runs tests/test_real_scripts.py's torchrun job (two gloo ranks; rank 1 sleeps 10 ms a step outside
the model's work) ``--runs`` times, started from a ``%%gpuwatch`` cell in an in-process IPython shell
(``--cli``: under the ``gpuwatch`` command), and prints for each run whether the straggler was named
and the figures ``rank_straggler.own_time`` judged: the extra own time against its noise floor (3x the
ranks' step jitter at least), the others' measured wait in the all-reduce, and the straggler's
stack-sampled wait beyond the others'. Start CPU hogs beside it (``--hogs``) to see a busy host.

    .venv/bin/python benchmarks/ddp_straggler.py --runs 6 --hogs 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_real_scripts as scripts  # noqa: E402

import gpuwidget  # noqa: E402
from gpuwidget.advice.rules import rank_straggler  # noqa: E402
from gpuwidget.advice.rules._ranks import median, ranks, step_jitter_s, step_series  # noqa: E402
from gpuwidget.run import Run  # noqa: E402


def in_a_cell(tmp: Path) -> Run:
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()  # None once started
    if "gpuwatch" not in shell.magics_manager.magics["cell"]:
        shell.run_line_magic("load_ext", "gpuwidget")
    home = os.getcwd()
    os.chdir(tmp)
    shell.user_ns["_job"] = scripts.torchrun(tmp, "--straggler", "1", "--delay", "0.01")
    shell.user_ns["_extra"] = {key: value for key, value in scripts.script_env().items()
                               if os.environ.get(key) != value}
    result = shell.run_cell(f"%%gpuwatch --quiet --interval {scripts.INTERVAL}\nimport os, subprocess\n"
                            "_done = subprocess.run(_job, env={**os.environ, **_extra}, capture_output=True,"
                            " text=True, timeout=240)")
    os.chdir(home)
    assert result.error_in_exec is None and shell.user_ns["_done"].returncode == 0, shell.user_ns["_done"].stderr
    run = gpuwidget.last_run()
    assert run is not None
    return run


def under_the_command(tmp: Path) -> Run:
    return scripts.gpuwatch(tmp, *scripts.torchrun(tmp, "--straggler", "1", "--delay", "0.01"))[0]


def figures(run: Run) -> tuple[bool, str]:
    named = rank_straggler.check(run.summary, run.workload, run.machine) is not None
    entries = [rank for rank in ranks(run.workload) if step_series(rank) is not None]
    series = [step_series(rank) for rank in entries]
    steps = [median(s[0]) for s in series if s]
    waits = [median(s[1]) for s in series if s]
    judged = rank_straggler.own_time(entries, steps, waits, max(steps, default=0.0))
    delays = [f"{float((rank.get('host') or {}).get('run_delay_fraction') or 0):.0%}" for rank in entries]
    line = (f"steps {', '.join(f'{s * 1e3:.1f}' for s in steps)} ms; jitter {step_jitter_s(entries) * 1e3:.1f} ms; "
            f"run delay {', '.join(delays)}")
    if judged is None:
        return named, line + "; no DDP figures"
    ms = lambda seconds: f"{seconds * 1e3:.1f}"  # noqa: E731
    return named, (f"{line}\n  rank {judged.index}: extra {ms(judged.extra_s)} (floor {ms(judged.floor_s)}), "
                   f"others waited {ms(judged.waited_s)}, stalled beyond the others {ms(judged.stalled_extra_s)} "
                   f"(needs {ms(max(1e-3, rank_straggler.CAUSE_SHARE * judged.extra_s))}), shown {judged.shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound neighbours to start beside it")
    parser.add_argument("--cli", action="store_true", help="under the gpuwatch command instead of a cell")
    args = parser.parse_args()
    out = sys.stdout  # IPython's test shell takes sys.stdout over
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.hogs)]
    named = 0
    try:
        for index in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                run = (under_the_command if args.cli else in_a_cell)(Path(tmp))
            found, line = figures(run)
            named += found
            print(f"run {index + 1}: {'named' if found else 'NOT NAMED'}; {line}", file=out, flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"named in {named} of {args.runs} runs", file=out)


if __name__ == "__main__":
    main()
