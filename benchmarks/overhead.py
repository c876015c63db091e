"""Overhead: does a watched training loop keep >= 99 % of its unwatched throughput?

The loop is deliberately Python-heavy, the worst case for a sampler thread that competes
for the GIL: a small MLP (6 x Linear+LayerNorm+ReLU) trained with AdamW (foreach=False) on
batches of 32 from an in-memory TensorDataset through a DataLoader with num_workers=0,
on one torch thread; a step takes about 1.5 ms here, dominated by Python and the
dispatcher. The watch is the public ``gpuwidget.watch(quiet=True)``, so whatever a watch
installs (sampler thread, workload probes) is measured.

Watched and unwatched runs of a fixed number of steps (about 1.2 s each) alternate in one
process, in ABBA order (pair i runs watched first when i is odd), so drift and other
processes' load hit both sides alike; the configurations take turns, one pair each per
round, so a burst of load does not land on one configuration only. Each pair gives a
ratio of throughputs watched/unwatched. Reported:

* steady: the median pair ratio (the target figure), its IQR and min - max;
* best-of: fastest unwatched run / fastest watched run (other processes' load only ever
  slows a run down, so the fastest runs are the least disturbed);
* CPU: the median ratio from process CPU time (all threads); steadier than wall time on a
  busy machine, and slightly pessimistic (it counts sampler work done on another core);
* an estimate from the parts, which other processes' load hardly moves: the probe's cost
  per DataLoader ``next()`` (best of short runs) plus the sampler thread's CPU time as a
  share of the timed steps' time (with a GIL-bound loop, at most that much is taken from
  it);
* an A/A control (unwatched against unwatched, same protocol): how far from 1.0 noise
  alone moves the figures on this machine.

The steady state is what is compared: inside each block (watched or not) about 0.5 s of
steps run untimed first, so the watch's first ticks (which set up the Trace's ~150
columns, tens of ms once per watch) are not charged to 1.2 s of steps as if they recurred;
a training cell runs for minutes. That one-off cost is reported apart ("one-off ms": what a
whole watched block cost beyond the steady slowdown: start, first ticks, finish), with the
whole-block ratio of these short blocks.

Peers, side by side in the same rounds and as many pairs as the target: JUmPER
(jumper-extension; a C collector in its own process, no in-loop probes) and gpuprof (patches
nn.Module, backward and the optimizer step; sampler threads), each at its defaults, where
installed (pyproject's ``bench`` extra, which ``make bench`` installs beside the pinned torch).

Two loops (benchmarks/_loops.py), each a run of its own with every configuration: issue 23's
0.3 ms loop (``fast``: batch 8, MLP 256-128-10, SGD) and the 1.4 ms loop above (``python``).
Each tool's own CPU is reported as well: what the watched run's process CPU (all threads) and its
child processes' CPU (JUmPER's collector) took beyond the unwatched run's, as a share of the
unwatched run's wall time.

Configurations: the default interval (the target, 10 pairs), and for information (6 pairs
each; on the 1.4 ms loop only): the A/A control; 0.1 s (10 Hz); the default interval with 8 fake GPUs
(tests/fakenvml.py, answering instantly: real NVML calls are C calls that release the GIL
while they wait, so this adds our Python-side cost per GPU, not the driver's latency);
and the default interval on a host with 500 more (idle, not ours) processes, as on a
shared server, since finding child processes costs in proportion to the process table
(see sampler_cost.py).

    .venv/bin/python benchmarks/overhead.py [--loop fast|python] [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from _common import (
    median,
    parse_args,
    print_header,
    quartiles,
    setup_paths,
    strangers,
    table,
    verdict,
    write_json,
)
from _loops import DESCRIPTIONS, LOOPS, make_loop

setup_paths(fake_nvml=True)

TARGET_RATIO = 0.99

# (perf_counter at the start of a sampler tick, thread CPU seconds of that tick)
TICKS: list[tuple[float, float]] = []


def time_sampler_ticks() -> None:
    """Record each sampler tick's start and thread CPU time (in TICKS), so the sampler's
    steady cost can be told from its first ticks (which set up the Trace's columns)."""
    from gpuwidget.sampler import Sampler

    original = Sampler._tick  # what the sampler thread runs each tick

    def tick(self: Sampler, owner: Any) -> bool:
        started, cpu = time.perf_counter(), time.thread_time()
        done = original(self, owner)
        TICKS.append((started, time.thread_time() - cpu))
        return done

    Sampler._tick = tick  # type: ignore[method-assign]


def probe_cost_us(repeats: int) -> dict[str, float]:
    """What a watch adds to each DataLoader ``next()``, best of ``repeats`` (loader alone, no
    model: the probe's own cost, not diluted by the step). The watch's interval is 60 s, so
    its sampler ticks only at the start and the end."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import gpuwidget

    loader = DataLoader(TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,))),
                        batch_size=32, num_workers=0)

    def epochs(count: int = 16) -> float:
        n = 0
        started = time.perf_counter()
        for _ in range(count):
            for _batch in loader:
                n += 1
        return (time.perf_counter() - started) / n

    plain: list[float] = []
    probed: list[float] = []
    epochs()
    for _ in range(repeats):
        plain.append(epochs())
        with gpuwidget.watch(quiet=True, interval=60):
            probed.append(epochs())
    return {"next_us": 1e6 * min(plain), "probe_us": 1e6 * (min(probed) - min(plain))}


def children_cpu() -> float:
    """CPU seconds of this process's live descendants so far (a peer's collector process)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


@contextlib.contextmanager
def no_fake() -> Iterator[None]:
    yield


@contextlib.contextmanager
def crowded_host(count: int) -> Iterator[None]:
    with strangers(count):
        yield


@contextlib.contextmanager
def fake_gpus(count: int) -> Iterator[None]:
    from fakenvml import FakeNvml

    fake = FakeNvml.gpus(count)
    fake.real_time = True  # the fake's clock follows the wall clock, as a live driver's would
    with fake.patched():
        yield


# Peers, watched at their defaults beside gpuwidget in the same run (pyproject's ``bench``
# extra). A peer that is not installed is left out with a note.
JUMPER_ADAPTER: Any = None


@contextlib.contextmanager
def jumper_watch() -> Iterator[None]:
    """JUmPER (jumper-extension) as ``%perfmonitor_start`` / ``%perfmonitor_stop`` run it: its
    default monitor is a compiled C collector in a child process, sampling every second."""
    global JUMPER_ADAPTER
    from jumper_extension.core.service import build_perfmonitor_magic_adapter

    if JUMPER_ADAPTER is None:
        JUMPER_ADAPTER = build_perfmonitor_magic_adapter(visualizer_backend="plotly")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line at start and stop
        JUMPER_ADAPTER.perfmonitor_start("")
    try:
        yield
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            JUMPER_ADAPTER.perfmonitor_stop("")


@contextlib.contextmanager
def gpuprof_watch() -> Iterator[None]:
    """gpuprof's one-line integration, ``gpuprof.profile()``, at its defaults (auto-instrumented
    nn.Module, backward and optimizer step; sampler threads) except: the database goes to a
    temporary folder and the end-of-run summary is not printed (it comes after the timed steps)."""
    import gpuprof

    with tempfile.TemporaryDirectory() as folder, gpuprof.profile(
            "overhead", summary=False, db_path=os.path.join(folder, "gpuprof.db")):
        yield


def peer_versions() -> dict[str, str | None]:
    """Installed peers and their versions (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("jumper-extension", "gpuprof"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


@dataclass
class Config:
    """One configuration and the figures of its pairs so far."""

    name: str
    options: dict[str, Any] | None  # None: the A/A control, both sides unwatched
    context: Callable[[], contextlib.AbstractContextManager[None]]
    pairs: int
    # A peer's watch instead of gpuwidget.watch(quiet=True, **options).
    peer: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    plain: list[float] = field(default_factory=list)  # timed-steps wall seconds, unwatched
    watched: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    cpu_ratios: list[float] = field(default_factory=list)
    block_ratios: list[float] = field(default_factory=list)
    one_off_ms: list[float] = field(default_factory=list)
    sampler_share: list[float] = field(default_factory=list)
    tick_cpu_us: list[float] = field(default_factory=list)
    # The tool's own CPU: watched minus unwatched process CPU, plus its child processes', per wall second.
    tool_cpu_share: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        q1, q3 = quartiles(self.ratios)
        return {
            "pairs": len(self.ratios),
            "ratio_median": median(self.ratios),
            "ratio_q1": q1,
            "ratio_q3": q3,
            "ratio_min": min(self.ratios),
            "ratio_max": max(self.ratios),
            "ratio_best_of": min(self.plain) / min(self.watched),
            "ratios": self.ratios,
            "cpu_ratio_median": median(self.cpu_ratios),
            "cpu_ratios": self.cpu_ratios,
            "block_ratio_median": median(self.block_ratios),
            "one_off_ms": median(self.one_off_ms) if self.options is not None else float("nan"),
            "sampler_cpu_share": median(self.sampler_share) if self.sampler_share else float("nan"),
            "sampler_cpu_per_tick_us": median(self.tick_cpu_us) if self.tick_cpu_us else float("nan"),
            "tool_cpu_share": median(self.tool_cpu_share) if self.tool_cpu_share else float("nan"),
        }


def one_pair(config: Config, run: Callable[[int], tuple[float, float]], steps: int, settle_steps: int,
             watched_first: bool) -> None:
    """One unwatched and one watched run of the same steps, in the order given."""
    import gpuwidget

    children: list[float] = []

    def unwatched() -> tuple[float, float, float]:
        settle, _ = run(settle_steps)
        inner, cpu = run(steps)
        return inner, cpu, settle + inner

    def watched() -> tuple[float, float, float]:
        if config.options is None:
            return unwatched()
        TICKS.clear()
        outer = time.perf_counter()
        watch = config.peer() if config.peer is not None else gpuwidget.watch(quiet=True, **config.options)
        with watch:
            run(settle_steps)  # the watch's first ticks (column set-up) fall in here
            t0 = time.perf_counter()
            before = children_cpu()
            inner, cpu = run(steps)
            children.append(children_cpu() - before)
            t1 = time.perf_counter()
        block = time.perf_counter() - outer
        steady = [tick_cpu for started, tick_cpu in TICKS if t0 <= started < t1]
        if steady:
            config.sampler_share.append(sum(steady) / (t1 - t0))
            config.tick_cpu_us.append(1e6 * sum(steady) / len(steady))
        return inner, cpu, block

    with config.context():
        if watched_first:
            (watch, watch_cpu, watch_block), (plain, plain_cpu, plain_block) = watched(), unwatched()
        else:
            (plain, plain_cpu, plain_block), (watch, watch_cpu, watch_block) = unwatched(), watched()
    config.plain.append(plain)
    config.watched.append(watch)
    config.ratios.append(plain / watch)  # throughput ratio = inverse time ratio
    config.cpu_ratios.append(plain_cpu / watch_cpu)
    config.block_ratios.append(plain_block / watch_block)
    if config.options is not None:
        # Per wall second of the unwatched run: the loop's own CPU is the same work in both.
        extra = watch_cpu - plain_cpu * watch / plain + (children[0] if children else 0.0)
        config.tool_cpu_share.append(extra / watch)
    # What the whole block cost beyond the steady slowdown: start, first ticks, finish.
    config.one_off_ms.append(1e3 * (watch_block - plain_block * watch / plain))


def main() -> None:
    args = parse_args("Throughput of a watched vs unwatched Python-heavy training loop.",
                      [("--loop", {"choices": LOOPS, "action": "append",
                                   "help": "the loop(s) to measure (default: both, one after the other)"})])
    info = print_header("Overhead: watched / unwatched throughput of Python-heavy CPU training loops")
    time_sampler_ticks()
    results = {loop: measure_loop(loop, args.quick) for loop in (args.loop or LOOPS)}
    write_json(args.json, {"benchmark": "overhead", "machine": info, "quick": args.quick,
                           "peers": peer_versions(), "loops": results})


def measure_loop(loop: str, quick: bool) -> dict[str, Any]:
    """Every configuration, side by side in rotating rounds, on one loop; prints its tables."""
    import torch

    import gpuwidget
    from gpuwidget.options import DEFAULT_INTERVAL_S

    print()
    print(f"== loop: {DESCRIPTIONS[loop]}")
    run = make_loop(loop)
    run_seconds = 0.3 if quick else 1.2
    settle_seconds = 0.3 if quick else 0.5
    pairs = 3 if quick else 10  # the target configuration
    other_pairs = 2 if quick else 6  # the informational ones
    crowd = 50 if quick else 500
    # Warm up: the loop itself, and one watch (first-use imports are not overhead).
    run(300)
    with gpuwidget.watch(quiet=True):
        run(50)
    step_s = min(run(300)[0] for _ in range(3)) / 300
    steps = max(50, int(run_seconds / step_s))
    settle_steps = max(20, int(settle_seconds / step_s))
    print(f"  torch {torch.__version__}, 1 thread; {1e3 * step_s:.2f} ms/step unwatched; "
          f"each run {settle_steps} untimed + {steps} timed steps; pairs in ABBA order")

    default = f"default interval ({DEFAULT_INTERVAL_S:g} s)"
    configs = [
        Config(default, {}, no_fake, pairs),
        Config("control: unwatched vs unwatched (A/A, the noise floor)", None, no_fake, pairs),
    ]
    if loop == "python":
        configs += [
        Config("interval 0.1 s (10 Hz)", {"interval": 0.1}, no_fake, other_pairs),
        Config("default interval, 8 fake GPUs", {}, lambda: fake_gpus(8), other_pairs),
        Config(f"default interval, +{crowd} idle processes on the host", {}, lambda: crowded_host(crowd),
               other_pairs),
        ]
    peers = peer_versions()
    for package, name, watch in (("jumper-extension", "JUmPER", jumper_watch), ("gpuprof", "gpuprof", gpuprof_watch)):
        if peers[package] is None:
            print(f"  peer {name} ({package}) is not installed: left out")
            continue
        # Side by side with the target configuration: as many pairs, in the same rounds.
        configs.append(Config(f"peer: {name} {peers[package]} at its defaults", {}, no_fake, pairs, peer=watch))
        with watch():  # first use: JUmPER compiles its C collector once
            run(50)
    # Round robin: each round runs one pair of every configuration (in a rotated order), so a
    # burst of load from other processes hits all configurations rather than one.
    for round_index in range(max(c.pairs for c in configs)):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if round_index < config.pairs:
                one_pair(config, run, steps, settle_steps, watched_first=round_index % 2 == 1)
    results = {config.name: config.figures() for config in configs}
    rows = []
    for config in configs:
        f = results[config.name]
        control = config.options is None
        rows.append([
            config.name,
            f["pairs"],
            f"{f['ratio_median']:.4f}",
            f"{f['ratio_q1']:.4f} - {f['ratio_q3']:.4f}",
            f"{f['ratio_min']:.4f} - {f['ratio_max']:.4f}",
            f"{f['ratio_best_of']:.4f}",
            f"{f['cpu_ratio_median']:.4f}",
            f"{f['block_ratio_median']:.4f}",
            "-" if control else f"{f['one_off_ms']:.0f}",
            "-" if control or config.peer else f"{f['sampler_cpu_per_tick_us']:.0f}",
            "-" if control or config.peer else f"{100 * f['sampler_cpu_share']:.2f} %",
            "-" if control else f"{100 * f['tool_cpu_share']:.2f} %",
        ])
    print()
    print("  steady: median wall-clock throughput ratio of the timed steps (IQR and min - max over pairs);")
    print("  best-of: fastest unwatched run / fastest watched run; CPU: the median ratio from process CPU")
    print("  time (all threads; counts sampler work done on the other core too, so pessimistic); whole")
    print("  block: settle + timed steps with the watch's start and finish; one-off: what a watched block")
    print("  cost beyond the steady slowdown; sampler: thread CPU per tick and as a share of the time,")
    print("  over the ticks of the timed steps; tool CPU: watched minus unwatched process CPU plus the tool's")
    print("  child processes' CPU, per second of the watched run")
    table(["configuration", "pairs", "steady", "IQR", "min - max", "best-of", "CPU", "whole block",
           "one-off ms", "sampler us/tick", "sampler CPU", "tool CPU"], rows)
    # A load-independent estimate from the parts: the probe's cost per step (best of several
    # short runs) and the sampler's CPU while the loop runs (its own thread CPU time; with a
    # GIL-bound loop, at most this much time is taken from the loop).
    probe = probe_cost_us(3 if quick else 9)
    print()
    print(f"  parts: a watch adds {probe['probe_us']:.1f} us to each DataLoader next() "
          f"({probe['next_us']:.0f} us unwatched; best of runs), i.e. "
          f"{100 * probe['probe_us'] / (1e6 * step_s):.2f} % of a {1e3 * step_s:.2f} ms step")
    estimates = {}
    for config in configs:
        if config.options is None or config.peer is not None:
            continue
        share = results[config.name]["sampler_cpu_share"]
        estimate = 1 / (1 + probe["probe_us"] / (1e6 * step_s) + share)
        estimates[config.name] = estimate
        print(f"  estimated ratio from the parts, {config.name}: {estimate:.4f} "
              f"(probe {100 * probe['probe_us'] / (1e6 * step_s):.2f} % + sampler {100 * share:.2f} %)")
    print()
    verdicts = [
        verdict(f"{loop} loop: steady throughput ratio at the {default}", results[default]["ratio_median"],
                TARGET_RATIO,
                higher_is_better=True, shown=f"{results[default]['ratio_median']:.4f} (IQR "
                f"{results[default]['ratio_q1']:.4f} - {results[default]['ratio_q3']:.4f}, best-of "
                f"{results[default]['ratio_best_of']:.4f}; A/A control "
                f"{results[configs[1].name]['ratio_median']:.4f}; estimate from the parts "
                f"{estimates[default]:.4f})", target_shown=f"{TARGET_RATIO}"),
    ]
    for config in configs[1:]:
        if config.options is None or config.peer is not None:
            continue
        figures = results[config.name]
        verdicts.append(verdict(f"steady throughput ratio, {config.name} (informational, same bar)",
                                figures["ratio_median"], TARGET_RATIO, higher_is_better=True,
                                shown=f"{figures['ratio_median']:.4f} (best-of {figures['ratio_best_of']:.4f})",
                                target_shown=f"{TARGET_RATIO}"))
    for config in configs:
        if config.peer is not None:
            figures = results[config.name]
            print(f"  side by side: {config.name}: steady {figures['ratio_median']:.4f} (best-of "
                  f"{figures['ratio_best_of']:.4f}); gpuwidget {results[default]['ratio_median']:.4f} "
                  f"(best-of {results[default]['ratio_best_of']:.4f})")
            if config.name.startswith("peer: JUmPER"):
                verdicts.append(verdict(f"{loop} loop: gpuwidget's median minus JUmPER's, same rounds",
                                        results[default]["ratio_median"] - figures["ratio_median"], 0.0,
                                        higher_is_better=True,
                                        shown=f"{results[default]['ratio_median'] - figures['ratio_median']:+.4f}",
                                        target_shown="0 (ahead)"))
    return {"step_ms": 1e3 * step_s, "steps_per_run": steps, "settle_steps": settle_steps,
            "probe": probe, "estimates": estimates, "results": results, "verdicts": verdicts}


if __name__ == "__main__":
    main()
