"""Enough evidence before a cause: thresholds at their edges, "watch longer" instead of a guess,
storage only from sleeping builders, and an expected gain that bounds what following it measures."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpuwidget
from gpuwidget.advice.advisor import advise
from gpuwidget.advice.evidence import MIN_CAUSE_LOOP_S, MIN_CAUSE_STEPS, loop_evidence
from gpuwidget.advice.loader import MIN_SAMPLED_WAIT_S, MIN_SAMPLED_WAITS, diagnose
from gpuwidget.advice.rules import RULES, watch_longer
from gpuwidget.probes.torch_data import CPU_SAMPLE_EVERY, loader_kwargs
from gpuwidget.report import main_cause, run_text

import workloads

LOOP_CAUSES = {"dataloader-starved", "dataloader-cpu-bound", "io-bound", "cpu-contention", "periodic-stall",
               "small-batch"}
NO_GPU = {"gpus": [], "usable_cpus": 2}
BUSY = {"process_cpu_mean": 20.0, "cpu_util_mean": 99.0, "workers_cpu_mean": 0.0,
        "process_run_delay_mean": 40.0, "other_cpu_mean": 150.0}


def starved(steps: int, step_s: float, wait_share: float = 0.8, wait_cpu: float = 0.02,
            first: list[float] | None = None) -> dict[str, Any]:
    """A loader sleeping in next() ``wait_share`` of each step, after ``first`` slow steps of compute."""
    first = first or []
    times = first + [step_s] * steps
    waits = [0.0] * len(first) + [step_s * wait_share] * steps
    return {"loaders": [{
        "name": "train_loader", "dataset_name": "train_ds", "epochs": 1, "steps": len(times),
        "samples": 32 * len(times), "wait_total_s": sum(waits), "compute_total_s": sum(times) - sum(waits),
        "loop_time_s": sum(times), "wait_cpu_ratio": wait_cpu, "wait_delay_ratio": 0.01,
        "step_times": times, "wait_times": waits,
        "settings": {"batch_size": 32, "num_workers": 0, "pin_memory": False, "shuffle": True,
                     "prefetch_factor": None, "persistent_workers": False, "default_collate": True},
    }]}


def causes(workload: dict[str, Any], summary: dict[str, Any] | None = None) -> set[str]:
    return {f.rule for f in advise(summary or BUSY, workload, NO_GPU)}


# ------------------------------------------------------------------ the thresholds at their edges


@pytest.mark.parametrize(("steps", "step_s", "enough"), [
    (MIN_CAUSE_STEPS, MIN_CAUSE_LOOP_S / MIN_CAUSE_STEPS, True),
    (MIN_CAUSE_STEPS - 1, 2 * MIN_CAUSE_LOOP_S / MIN_CAUSE_STEPS, False),  # long enough, too few steps
    (200, 0.99 * MIN_CAUSE_LOOP_S / 200, False),  # many steps, too short
])
def test_a_cause_needs_enough_steady_steps_and_seconds(steps, step_s, enough):
    workload = starved(steps, step_s)
    assert loop_evidence(workload).enough is enough
    named = causes(workload) & LOOP_CAUSES
    assert bool(named) is enough, named
    assert ("watch-longer" in causes(workload)) is not enough


def test_warm_up_steps_do_not_count_towards_the_evidence():
    # 20 steps over 3.7 s, but 5 of them warm-up: 15 steady steps are too few.
    workload = starved(15, 0.08, first=[0.5] * 5)
    seen = loop_evidence(workload)
    assert (seen.steps, seen.steady_steps, seen.warmup.steps) == (20, 15, 5) and not seen.enough
    assert causes(workload) & LOOP_CAUSES == set()


def test_watch_longer_says_how_many_steps_and_seconds_to_watch():
    # 32 steps of 7 ms (0.23 s): 1 s of them takes 143 steps.
    finding = watch_longer.check({}, starved(32, 0.007), NO_GPU)
    assert finding.severity == "info" and finding.expected_speedup is None
    assert finding.evidence["watch_steps"] == 143 and finding.evidence["watch_s"] == pytest.approx(1.0, abs=0.01)
    assert finding.title == "Too short to name a cause: watch at least 1.0 s (143 steps)"
    assert "The loop ran 32 steady steps in 224 ms." in finding.suggestion
    # Slow steps: the step count decides.
    assert watch_longer.check({}, starved(8, 0.5), NO_GPU).evidence["watch_steps"] == MIN_CAUSE_STEPS


def test_a_run_that_never_reached_a_steady_state_is_told_to_watch_past_the_warm_up():
    workload = starved(2, 0.01, first=[4.0, 3.0, 3.5])
    finding = watch_longer.check({"warmup_cause": "compilation"}, workload, NO_GPU)
    assert finding.title == f"No steady state yet: watch {MIN_CAUSE_STEPS} steps beyond the warm-up"
    assert finding.suggestion.startswith(
        "All 5 steps were warm-up (10.5 s: compilation): the loop never reached a steady state.")


@pytest.mark.parametrize(("samples", "sampled", "cause"), [
    (MIN_SAMPLED_WAITS - 1, 0.01, "unknown"),
    (MIN_SAMPLED_WAITS, 0.01, "io"),  # many short waits
    (4, 1.01 * MIN_SAMPLED_WAIT_S, "io"),  # a few long ones
    (4, 0.99 * MIN_SAMPLED_WAIT_S, "unknown"),
])
def test_sleep_is_read_from_enough_sampled_waits(samples, sampled, cause):
    # A thread whose CPU clock read 0 while waiting is asleep, if enough of its waits were sampled to stand
    # for them all: many (each reading is exact, however short), or a few long enough to tell it themselves.
    steps = CPU_SAMPLE_EVERY * samples + 1
    workload = starved(steps, 2.0 / steps, wait_share=0.4, wait_cpu=0.0)  # 2 s of loop
    loader = workload["loaders"][0]
    loader.update(wait_cpu_clock="thread", wait_samples=samples, wait_sampled_s=sampled)
    d = diagnose(BUSY, workload, NO_GPU)
    assert d is not None and d.cause == cause
    assert ("io-bound" in causes(workload)) is (cause == "io")


@pytest.mark.parametrize(("sampled", "cause"), [(0.99 * MIN_SAMPLED_WAIT_S, "unknown"),
                                                (1.01 * MIN_SAMPLED_WAIT_S, "io")])
def test_a_run_saved_before_the_cpu_clock_reads_sleep_from_enough_sampled_seconds(sampled, cause):
    # Saved runs read the CPU from schedstat, which counts it in 4 ms ticks, so short waits read 0 as
    # often as not: asleep only over enough seconds of sampled waits.
    steps = 400
    wait = sampled / len(range(1, steps, CPU_SAMPLE_EVERY))
    workload = starved(steps, wait / 0.4, wait_share=0.4, wait_cpu=0.0)  # 2 s of loop
    d = diagnose(BUSY, workload, NO_GPU)
    assert d is not None and d.cause == cause
    assert ("io-bound" in causes(workload)) is (cause == "io")


def test_the_gain_bound_counts_a_warm_up_the_next_run_may_not_pay():
    # 3 steps of 0.5 s warm-up (a first CUDA use, compilation) counted as compute, then 120 steps of
    # 10 ms waiting 4 ms each: 1 / (1 - 0.48 / 2.7) = 1.22x if the warm-up were compute; a warm
    # process that follows the change takes 123 steps of 6 ms: 2.7 / 0.738 = 3.66x.
    workload = starved(120, 0.01, wait_share=0.4, first=[0.5, 0.5, 0.5])
    d = diagnose(BUSY, workload, NO_GPU)
    assert d is not None and d.warmup_steps == 3 and d.wait_fraction == pytest.approx(0.4)
    assert d.expected_speedup == pytest.approx(2.7 / (123 * 0.006), rel=1e-3)
    assert d.evidence["upper_bound_speedup"] == pytest.approx(3.66, abs=0.01) and d.gain <= d.expected_speedup
    # Without a warm-up the bound is the familiar 1 / (1 - wait share).
    assert diagnose(BUSY, starved(120, 0.01, wait_share=0.4), NO_GPU).expected_speedup == pytest.approx(1 / 0.6)


QUIET = {"cpu_util_mean": 30.0, "process_cpu_mean": 50.0, "workers_cpu_mean": 0.0}
ON_GPU = {"gpus": [{"index": 0, "name": "NVIDIA H100"}], "usable_cpus": 2}


def periodic(steps: int) -> dict[str, Any]:
    workload = starved(steps, 0.01, wait_share=0.0)
    times = workload["loaders"][0]["step_times"]
    for i in range(9, steps, 10):
        times[i] = 0.2
    workload["loaders"][0].update(loop_time_s=sum(times), compute_total_s=sum(times))
    return workload


# Each loop cause with the figures that name it; a loop of 200 steps of 10 ms (2 s) is long enough,
# the same figures over 10 steps (0.1 s) are not.
CASES = {
    "dataloader-starved": (lambda n: starved(n, 0.01, 0.5, wait_cpu=1.0), {**QUIET, "process_cpu_mean": 100.0},
                           NO_GPU),
    "io-bound": (lambda n: starved(n, 0.01, 0.5), QUIET, NO_GPU),
    "dataloader-cpu-bound": (lambda n: starved(n, 0.01, 0.5, wait_cpu=1.0), {**BUSY, "process_cpu_mean": 100.0},
                             NO_GPU),
    "cpu-contention": (lambda n: starved(n, 0.01, 0.02), BUSY, NO_GPU),
    "periodic-stall": (periodic, QUIET, NO_GPU),
    "small-batch": (lambda n: starved(n, 0.01, 0.0), {**QUIET, "gpu_busy_mean": 20.0, "peak_gpu_mem_fraction": 0.1},
                    ON_GPU),
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_every_loop_cause_waits_for_enough_evidence(rule):
    build, figures, machine = CASES[rule]
    assert RULES[rule](figures, build(200), machine) is not None
    assert RULES[rule](figures, build(10), machine) is None
    assert watch_longer.check(figures, build(10), machine) is not None


# ------------------------------------------------------------------ real loops


pytestmark_threads = pytest.mark.usefixtures("one_torch_thread")


def watched(train_loader: DataLoader, model: torch.nn.Module) -> gpuwidget.Run:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for x, y in train_loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run


@pytestmark_threads
@pytest.mark.parametrize("workers", [0, 2])
def test_a_short_cell_of_in_memory_batches_gets_no_cause_but_how_long_to_watch(workers):
    """32 in-memory batches (0.2 s): once called io-bound in 3 runs of 3 (four sampled waits of well
    under a millisecond read 0 CPU; with workers, their start-up was most of the wait)."""
    data = TensorDataset(torch.randn(32 * 32, 64), torch.randint(0, 10, (32 * 32,)))
    short = []
    for _ in range(3):
        run = watched(DataLoader(data, batch_size=32, num_workers=workers),
                      workloads.mlp(features=64, hidden=256, layers=2))
        assert run.summary["steps"] == 32
        seen = loop_evidence(run.workload)
        assert seen is not None
        if seen.steady_s >= MIN_CAUSE_LOOP_S:
            # A neighbour stretched this run's steady steps past the gate (fresh-check run 52: 41 % of the
            # time lost waiting for a core, with workers): it is then not short, and the causes may be named.
            continue
        rules = {f.rule for f in run.findings}
        assert not rules & LOOP_CAUSES and "watch-longer" in rules, [f.title for f in run.findings]
        assert main_cause(run).startswith("Too short to name a cause: watch at least")
        assert "watch-longer" in run_text(run)
        short.append(seen.steady_s)
    assert short, "no run was short: the host stretched all three past a second of steady steps"


@pytestmark_threads
def test_a_sleeping_dataset_is_io_bound_from_its_measured_sleep():
    run = watched(workloads.slow_storage().loader, workloads.mlp(layers=2))
    finding = next(f for f in run.findings if f.rule == "io-bound")
    assert finding.evidence["cpu_while_waiting"] < 0.25
    loader = run.workload["loaders"][0]
    # Its loader is what it waits on: one next() in CPU_SAMPLE_EVERY was read, from the second.
    assert loader["wait_sampled_s"] == pytest.approx(sum(loader["wait_times"][1::CPU_SAMPLE_EVERY]))
    assert loader["wait_cpu_clock"] == "thread"
    assert loader["wait_samples"] >= MIN_SAMPLED_WAITS or loader["wait_sampled_s"] >= MIN_SAMPLED_WAIT_S


_first_uses = [0]


class FirstUseModel(torch.nn.Module):
    """An MLP whose first five forward passes in the process take 0.8 s more (compilation or a
    first CUDA use): a later run in the same process does not pay them again. With 4 s of warm-up
    the followed change gains about 1.6x the old bound beside another test's load, a margin the
    workers' slower start on a loaded host cannot take (with 0.4 s per pass it was 1.26x quiet and
    0.84x once under a neighbour's load)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = workloads.mlp(layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _first_uses[0] < 5:
            _first_uses[0] += 1
            time.sleep(0.8)
        return self.body(x)


@pytestmark_threads
def test_following_an_io_bound_change_in_a_warm_process_stays_within_the_bound():
    """An io-bound "at most 1.46x" measured 1.81x when followed: its first run paid a warm-up the
    next did not, and the old bound counted that warm-up as compute."""
    _first_uses[0] = 0
    workload = workloads.slow_storage(items=640)  # 40 steps of 48 ms sleeping on "storage"
    model = FirstUseModel()
    before = watched(workload.loader, model)
    finding = next(f for f in before.findings if f.rule == "io-bound")
    assert finding.evidence["warmup_steps"] >= 5 and "if no waiting or warm-up remained" in run_text(before)
    after = watched(DataLoader(**loader_kwargs(workload.loader, finding.change)), model)
    measured = before.summary["loop_time_s"] / after.summary["loop_time_s"]
    # The old bound's share of waiting was over every step, the warm-up's included (the headline's
    # data_wait_fraction leaves a warm-up out since 4c50a2d: at ~0.94, its 1 / (1 - share) swings from
    # 14x to 27x between runs, around the 21x measured, and would test nothing).
    old_bound = 1 / (1 - before.summary["data_wait_fraction_with_warmup"])
    assert old_bound < measured <= finding.evidence["upper_bound_speedup"], (old_bound, measured)
