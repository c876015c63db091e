"""Child processes: what the start-up hook costs every Python start, and what the probes cost a DDP rank.

1. **Start-up hook, no watch active** (the target: < 2 ms a Python start-up). Every Python
   start in the environment reads ``gpuwidget_children.pth`` and runs its one line, which
   looks up one environment variable. Measured two ways:

   * in-process, the exact work ``site`` does for the file (``site.addpackage`` of the
     installed ``.pth``), median of 7 batches of 2000 calls;
   * whole interpreters: ``python -I -S -c "import site; site.addsitedir(D)"`` with ``D`` an
     empty directory or one holding only a copy of the ``.pth``, alternating, 60 starts each;
     the difference of the medians (start-up itself varies by about a millisecond here, so
     this figure is the noisier of the two).

   For information, a watch active: the start of a Python that never imports torch (it loads
   only the small boot module), and the extra time of ``import torch`` in a child (the probes
   and the agent load right after it).

2. **Per-rank probe overhead** (the target: a watched 2-rank run keeps >= 0.98 of the
   unwatched throughput). ``torch.multiprocessing.spawn`` runs 2 DDP ranks on gloo, one
   torch thread each: an MLP (3 x Linear(256)) on batches of 64 from a TensorDataset with a
   DistributedSampler; each rank times its own loop (:data:`STEPS` steps after
   :data:`WARMUP` untimed ones) and the job's throughput is the sum of the ranks' samples/s.
   Watched (``gpuwidget.watch(quiet=True)``: the probes in both ranks, spans streamed every
   0.3 s) and unwatched jobs alternate in ABBA order; each pair gives a ratio. An A/A control
   (unwatched against unwatched, same protocol) shows how far noise alone moves the ratio.
   Each rank also counts its samples per second of its process's CPU time (all its threads,
   the agent's included): on a machine other jobs keep busy, wall-clock ratios swing with
   their load while CPU time only counts the rank's own work, which is where the probes' cost
   shows. And from the parts, which other jobs' load hardly moves: the probes' cost per
   DataLoader ``next()`` (tiny batches, best of runs, with and without an agent's probes) and
   the agent thread's CPU time per second of a loop stepping at the measured rank's pace
   (timed inside the thread), charged in full to the rank's step: ``step / (step + per-next
   cost + thread share x step)``.

    .venv/bin/python benchmarks/children.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import median, parse_args, print_header, quartiles, setup_paths, table, verdict, write_json

setup_paths()

PTH = "gpuwidget_children.pth"
STEPS = 400
WARMUP = 40
BATCH = 64


# --------------------------------------------------------------------------- start-up hook


def installed_pth() -> Path:
    for directory in site.getsitepackages():
        path = Path(directory) / PTH
        if path.is_file():
            return path
    raise SystemExit(f"{PTH} is not installed in this environment: run `make install`")


def in_process_cost(pth: Path, batches: int, calls: int) -> float:
    """Seconds ``site`` spends on the .pth per start-up (env var absent), median over batches."""
    from gpuwidget.children import ENV_VAR

    assert ENV_VAR not in os.environ
    times = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(calls):
            site.addpackage(str(pth.parent), pth.name, set())
        times.append((time.perf_counter() - started) / calls)
    return median(times)


def interpreter_starts(pth: Path, runs: int) -> dict[str, Any]:
    """Whole ``python`` starts with and without the .pth in a site directory, alternating."""
    env = {k: v for k, v in os.environ.items() if k != "GPUWIDGET_CHILDREN"}
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as with_pth:
        shutil.copy(pth, Path(with_pth) / PTH)
        times: dict[str, list[float]] = {"without": [], "with": []}
        for i in range(2 * runs):
            which = ("without", "with")[(i + i // 2) % 2]  # ABBA
            directory = empty if which == "without" else with_pth
            started = time.perf_counter()
            subprocess.run([sys.executable, "-I", "-S", "-c", f"import site; site.addsitedir({directory!r})"],
                           env=env, check=True)
            times[which].append(time.perf_counter() - started)
    return {"without_s": median(times["without"]), "with_s": median(times["with"]),
            "difference_s": median(times["with"]) - median(times["without"]),
            "without_iqr_s": quartiles(times["without"]), "with_iqr_s": quartiles(times["with"])}


def active_costs(runs: int) -> dict[str, float]:
    """With a watch's variable set (a socket nobody listens on): a start without torch, and import torch."""
    base = {k: v for k, v in os.environ.items() if k != "GPUWIDGET_CHILDREN"}
    active = {**base, "GPUWIDGET_CHILDREN": "/nonexistent/children.sock"}
    timer = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    out: dict[str, list[float]] = {"pass": [], "pass_active": [], "torch": [], "torch_active": []}
    for i in range(runs):
        for key, env in (("pass", base), ("pass_active", active)):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
            out[key].append(time.perf_counter() - started)
        for key, env in (("torch", base), ("torch_active", active)) if i % 2 == 0 else (("torch_active", active),
                                                                                       ("torch", base)):
            done = subprocess.run([sys.executable, "-c", timer], env=env, check=True, capture_output=True, text=True)
            out[key].append(float(done.stdout.split()[-1]))
    return {key: median(values) for key, values in out.items()}


# --------------------------------------------------------------------------- DDP ranks


def rank(rank: int, world_size: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    count = (STEPS + WARMUP) * BATCH * world_size
    dataset = TensorDataset(torch.randn(count, 256), torch.randn(count, 1))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, world_size, rank))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                                  nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    started = cpu_started = None
    for step, (x, y) in enumerate(loader):
        if step == WARMUP:
            started, cpu_started = time.perf_counter(), time.process_time()
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert started is not None and cpu_started is not None
    samples = STEPS * BATCH
    results.put((rank, samples / (time.perf_counter() - started), samples / (time.process_time() - cpu_started)))
    del model  # the model before its group: tests/gloo_job.py's fit() says why
    dist.destroy_process_group()


def job(watched: bool) -> tuple[float, float]:
    """One 2-rank job: the sum of the ranks' samples/s, and of their samples per CPU second."""
    import torch.multiprocessing as torch_mp

    import gpuwidget

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = torch_mp.get_context("spawn").SimpleQueue()
    if watched:
        with gpuwidget.watch(quiet=True) as run:
            torch_mp.spawn(rank, args=(2, port, results), nprocs=2, join=True)
        assert len(run.ranks) == 2 and all(r["steps"] == STEPS + WARMUP for r in run.ranks), run.ranks
    else:
        torch_mp.spawn(rank, args=(2, port, results), nprocs=2, join=True)
    per_rank = [results.get() for _ in range(2)]
    return sum(r[1] for r in per_rank), sum(r[2] for r in per_rank)


def next_cost(agent_on: bool, batches: int = 2000, repeats: int = 5) -> float:
    """Seconds per DataLoader ``next()`` over tiny batches (best of ``repeats``), with or without an agent's probes."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from gpuwidget.children.agent import ChildAgent
    from gpuwidget.children.channel import ChildChannel
    from gpuwidget.trace import Trace

    loader = DataLoader(TensorDataset(torch.zeros(batches, 1)), batch_size=1)
    channel = ChildChannel(Trace()) if agent_on else None
    agent = ChildAgent(channel.path) if channel is not None else None
    try:
        if agent is not None:
            agent.probes.poll()  # the probes only: the thread's cost is measured apart
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in loader:
                pass
            best = min(best, (time.perf_counter() - started) / batches)
        return best
    finally:
        if agent is not None:
            agent.retire()
        if channel is not None:
            channel.close()


def agent_thread_share(seconds: float, step_s: float) -> dict[str, float]:
    """The agent thread's CPU time as a share of wall time, while a loop of ``step_s`` steps feeds it spans."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from gpuwidget.children.agent import ChildAgent
    from gpuwidget.children.channel import ChildChannel
    from gpuwidget.trace import Trace

    channel = ChildChannel(Trace())
    agent = ChildAgent(channel.path)
    spent = [0.0, 0]
    flush = agent.flush

    def timed_flush() -> None:
        started = time.thread_time()
        flush()
        spent[0] += time.thread_time() - started
        spent[1] += 1

    agent.flush = timed_flush  # type: ignore[method-assign]
    steps = int(seconds / step_s)
    loader = DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    try:
        agent.start()
        started = time.perf_counter()
        for _ in loader:
            time.sleep(step_s)
        wall = time.perf_counter() - started
    finally:
        agent.finish()
        channel.close()
    (record,) = channel.snapshot()
    assert record.progress.get("steps") == steps, record.progress
    return {"share": spent[0] / wall, "flushes": spent[1], "cpu_per_flush_s": spent[0] / max(1, spent[1]),
            "steps_received": len(record.step_times)}


def pairs(count: int, second_watched: bool) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """(first, second) jobs in ABBA order; the second is watched unless this is the A/A control."""
    out = []
    for i in range(count):
        if i % 2:
            second = job(second_watched)
            first = job(False)
        else:
            first = job(False)
            second = job(second_watched)
        out.append((first, second))
        print(f"    pair {i + 1}: {first[0]:,.0f} vs {second[0]:,.0f} samples/s ({second[0] / first[0]:.3f}); "
              f"per CPU second {first[1]:,.0f} vs {second[1]:,.0f} ({second[1] / first[1]:.3f})", flush=True)
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    info = print_header("Child processes: start-up hook and per-rank probe overhead")
    pth = installed_pth()
    results: dict[str, Any] = {"machine": info, "pth": str(pth), "verdicts": []}

    per_start = in_process_cost(pth, 3 if args.quick else 7, 500 if args.quick else 2000)
    starts = interpreter_starts(pth, 10 if args.quick else 60)
    active = active_costs(2 if args.quick else 5)
    results["startup"] = {"in_process_s": per_start, **starts, "active": active}
    print("\n  Start-up hook, no watch active")
    table(["figure", "value"], [
        ["site's work on the .pth (in-process)", f"{per_start * 1e6:.1f} us"],
        ["python start, site dir without / with the .pth", f"{starts['without_s'] * 1e3:.2f} / "
                                                          f"{starts['with_s'] * 1e3:.2f} ms"],
        ["difference of medians", f"{starts['difference_s'] * 1e3:+.2f} ms"],
        ["python -c pass, watch inactive / active",
         f"{active['pass'] * 1e3:.1f} / {active['pass_active'] * 1e3:.1f} ms"],
        ["import torch, watch inactive / active", f"{active['torch']:.3f} / {active['torch_active']:.3f} s"],
    ])
    results["verdicts"].append(verdict("start-up hook, no watch (in-process)", per_start * 1e3, 2.0,
                                       higher_is_better=False, shown=f"{per_start * 1e3:.3f} ms",
                                       target_shown="2 ms"))
    worst = max(starts["difference_s"], per_start)
    results["verdicts"].append(verdict("start-up hook, no watch (whole interpreters)", worst * 1e3, 2.0,
                                       higher_is_better=False, shown=f"{worst * 1e3:.2f} ms", target_shown="2 ms"))

    count, control = (1, 1) if args.quick else (6, 4)
    print(f"\n  2-rank gloo DDP, watched vs unwatched ({count} pairs)")
    measured = pairs(count, True)
    print(f"  A/A control ({control} pairs)")
    aa = pairs(control, False)
    ratios = [b[0] / a[0] for a, b in measured]
    cpu_ratios = [b[1] / a[1] for a, b in measured]
    aa_ratios = [b[0] / a[0] for a, b in aa]
    aa_cpu = [b[1] / a[1] for a, b in aa]
    best = max(b[0] for _, b in measured) / max(a[0] for a, _ in measured)
    results["ranks"] = {"pairs": measured, "ratios": ratios, "median": median(ratios), "iqr": quartiles(ratios),
                        "cpu_ratios": cpu_ratios, "cpu_median": median(cpu_ratios), "best_of": best,
                        "aa_pairs": aa, "aa_median": median(aa_ratios), "aa_cpu_median": median(aa_cpu)}
    table(["figure", "wall clock", "per CPU second"], [
        ["median ratio watched/unwatched", f"{median(ratios):.3f}", f"{median(cpu_ratios):.3f}"],
        ["IQR", "{:.3f} - {:.3f}".format(*quartiles(ratios)), "{:.3f} - {:.3f}".format(*quartiles(cpu_ratios))],
        ["min - max", f"{min(ratios):.3f} - {max(ratios):.3f}", f"{min(cpu_ratios):.3f} - {max(cpu_ratios):.3f}"],
        ["best-of (fastest watched / fastest unwatched)", f"{best:.3f}", ""],
        ["A/A control median", f"{median(aa_ratios):.3f}", f"{median(aa_cpu):.3f}"],
        ["unwatched job, median samples/s (2 ranks)", f"{median([a[0] for a, _ in measured]):,.0f}", ""],
    ])
    results["verdicts"].append(verdict("watched 2-rank run / unwatched, wall clock", median(ratios), 0.98,
                                       higher_is_better=True, shown=f"{median(ratios):.3f}", target_shown="0.98"))

    # The parts, which other jobs' load hardly moves: the probes' cost per next() and the agent thread's CPU.
    step_s = 2 * BATCH / median([a[0] for a, _ in measured])  # a rank's unwatched step (2 ranks share the rate)
    without, with_agent = (min(next_cost(False) for _ in range(3)), min(next_cost(True) for _ in range(3)))
    thread = agent_thread_share(2.0 if args.quick else 10.0, step_s)
    per_step = max(0.0, with_agent - without)
    estimate = step_s / (step_s + per_step + thread["share"] * step_s)
    results["parts"] = {"step_s": step_s, "next_without_s": without, "next_with_s": with_agent,
                        "probe_per_step_s": per_step, "agent_thread": thread, "estimate": estimate}
    print("\n  From the parts (a rank's step as measured unwatched above)")
    table(["figure", "value"], [
        ["a rank's step, unwatched", f"{step_s * 1e3:.2f} ms"],
        ["DataLoader next(), without / with the probes", f"{without * 1e6:.1f} / {with_agent * 1e6:.1f} us"],
        ["agent thread: CPU per flush, flushes", f"{thread['cpu_per_flush_s'] * 1e6:.0f} us, {thread['flushes']:.0f}"],
        ["agent thread: share of wall time", f"{thread['share'] * 100:.3f} %"],
        ["estimated watched/unwatched", f"{estimate:.4f}"],
    ])
    results["verdicts"].append(verdict("watched 2-rank run / unwatched, from the parts", estimate, 0.98,
                                       higher_is_better=True, shown=f"{estimate:.4f}", target_shown="0.98"))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
