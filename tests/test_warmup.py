"""Warm-up apart: the detector at the edges of each threshold, its causes, the summary and the panel's line."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwidget.figures.summary import step_figures
from gpuwidget.figures.warmup import (
    MIN_STEADY_STEPS,
    WARMUP_FACTOR,
    WARMUP_MIN_S,
    split_run,
    split_warmup,
    warmup_cause,
)
from gpuwidget.report import warmup_sentence

STEADY = [0.0012, 0.0011, 0.0013, 0.0012, 0.0014, 0.0011, 0.0012, 0.0013] * 25  # 200 steps around 1.2 ms


def test_torchs_first_steps_are_warm_up_and_the_rest_is_steady():
    # torch's own first steps on this machine: 18-28 ms against a 1.2 ms median.
    first = [0.028, 0.024, 0.021, 0.019, 0.018, 0.022, 0.020, 0.018]
    split = split_warmup(first + STEADY)
    assert (split.steps, split.first_steady, split.all_warmup) == (8, 8, False)
    assert split.seconds == pytest.approx(sum(first))
    assert split.steady_median == pytest.approx(0.0012)


def test_compilation_takes_whole_seconds_and_ends_at_the_first_steps_at_speed():
    times = [4.2, 1.1, 0.9, 0.7] + [0.01] * 100
    split = split_warmup(times)
    assert split.steps == 4 and split.seconds == pytest.approx(6.9)


@pytest.mark.parametrize(("first", "warm"), [
    # The factor: a slow step takes more than WARMUP_FACTOR times the steady median...
    (WARMUP_FACTOR * 0.01 - 1e-6, False), (WARMUP_FACTOR * 0.01 + 1e-6, True),
])
def test_a_step_is_warm_up_above_three_times_the_typical_steady_step(first, warm):
    split = split_warmup([first] + [0.01] * 50)
    assert (split.steps == 1) is warm and (split.steps == 0) is not warm


@pytest.mark.parametrize(("excess", "warm"), [(WARMUP_MIN_S - 1e-4, False), (WARMUP_MIN_S + 1e-4, True)])
def test_a_step_is_warm_up_only_beyond_a_scheduler_time_slice(excess, warm):
    # ...and more than WARMUP_MIN_S beyond it: in a 0.3 ms loop a 5 ms first step is noise.
    split = split_warmup([0.0003 + excess] + [0.0003] * 50)
    assert (split.steps == 1) is warm


def test_one_fast_step_between_slow_ones_does_not_end_the_warm_up():
    # torch.compile recompiles on the second shape it sees: slow, fast, slow, then steady.
    assert split_warmup([2.0, 0.01, 1.5] + [0.01] * 50).steps == 3
    # Two steps at speed end it: a slow step after them is the loop's own (a stall), not warm-up.
    assert split_warmup([2.0, 0.01, 0.01, 1.5] + [0.01] * 50).steps == 1


def test_a_stall_every_third_step_stays_a_stall_not_an_endless_warm_up():
    times = [0.2 if i % 3 == 0 else 0.01 for i in range(90)]
    split = split_warmup(times)
    assert split.steps <= 1 and not split.all_warmup  # at most the first step, a stall and a start at once


def test_periodic_stalls_after_the_warm_up_are_not_warm_up():
    times = [0.03] * 8 + [0.0012] * 142
    for i in range(24, 150, 25):
        times[i] = 0.5
    assert split_warmup(times).steps == 8


@pytest.mark.parametrize(("slow", "all_warm"), [(50, False), (51, True)])
def test_a_warm_up_longer_than_half_the_run_means_no_steady_state(slow, all_warm):
    split = split_warmup([0.5] * slow + [0.01] * (100 - slow))
    assert split.all_warmup is all_warm
    assert split.steps == (100 if all_warm else slow)


def test_steps_still_speeding_up_at_the_end_never_reached_a_steady_state():
    # Most of the run warming (the latter half's median is itself warm-up): the last steps are
    # far faster than it.
    times = [1.0] * 80 + [0.01] * 5
    split = split_warmup(times)
    assert split.all_warmup and split.steps == 85 and split.seconds == pytest.approx(80.05)


def test_steps_alternating_fast_and_slow_are_steady():
    # Two spawned workers: the first batch after seconds of start-up, then batches in pairs
    # (one at once, the next after a 90 ms wait), ending on a fast step.
    times = [5.4] + [0.006, 0.09] * 14 + [0.005]
    split = split_warmup(times)
    assert split.steps == 1 and not split.all_warmup


def test_a_slow_start_with_too_few_steps_after_it_is_all_warm_up():
    assert split_warmup([3.0, 2.0, 0.01, 0.01, 0.01, 0.01]).steps == 2
    split = split_warmup([3.0, 2.0, 2.5, 0.01, 0.01])
    assert split.all_warmup and split.steps == 5


def test_a_run_too_short_to_judge_has_no_warm_up():
    assert split_warmup([]).steps == 0
    for times in ([5.0], [5.0, 0.01], [5.0, 0.01, 0.01][:MIN_STEADY_STEPS]):
        split = split_warmup(times)
        assert split.steps == 0 and not split.all_warmup


def test_a_history_that_lost_the_first_steps_holds_no_warm_up():
    times = [0.5] * 3 + [0.01] * 97
    assert split_run(times, steps=100).steps == 3
    assert split_run(times, steps=101).steps == 3  # the open last step is not in the history
    assert split_run(times, steps=25_000).steps == 0  # the latest 100 of 25,000: mid-run


def test_steady_loops_and_noise_have_no_warm_up():
    assert split_warmup(STEADY).steps == 0
    noisy = list(STEADY)
    noisy[40] = noisy[90] = 0.03  # a loaded host's spikes, mid-run
    assert split_warmup(noisy).steps == 0


# ------------------------------------------------------------------ the cause, where the facts say


def loader(workers: int, waits: list[float]) -> dict[str, Any]:
    return {"settings": {"num_workers": workers}, "wait_times": waits}


@pytest.mark.parametrize(("workload", "loop", "cause"), [
    ({"model": {"compiled": True}}, None, "compilation"),
    ({"cuda": {"devices": [{"index": 0}], "peak_since_cell_start": False}}, None, "CUDA start-up"),
    ({"cuda": {"devices": [{"index": 0}], "peak_since_cell_start": True}}, None, None),  # CUDA was up before
    ({}, loader(2, [0.21, 0.001] + [0.001] * 50), "worker start-up"),
    ({}, loader(2, [0.001] * 52), None),  # the slow steps were the loop's own work
    ({}, loader(0, [0.21] + [0.001] * 51), None),  # no workers to start
    ({"model": {"compiled": True}, "cuda": {"devices": [{"index": 0}], "peak_since_cell_start": False}}, None,
     "compilation and CUDA start-up"),
])
def test_the_warm_up_is_named_only_where_the_facts_say(workload, loop, cause):
    split = split_warmup([0.25] + [0.01] * 51)
    assert warmup_cause(split, workload, loop) == cause
    assert warmup_cause(split_warmup([0.01] * 52), workload, loop) is None  # no warm-up, no cause


# ------------------------------------------------------------------ the summary and the panel


def test_step_percentiles_leave_the_warm_up_out():
    times = [2.0, 1.0] + [0.01] * 98
    figures = step_figures(times, 100, {"model": {"compiled": True}})
    assert figures["step_time_p99"] == pytest.approx(0.01)
    assert figures["warmup_steps"] == 2 and figures["warmup_s"] == pytest.approx(3.0)
    assert figures["warmup_cause"] == "compilation" and "all_warmup" not in figures


def test_a_run_that_is_all_warm_up_says_so_in_the_summary():
    figures = step_figures([3.0, 2.0, 2.5, 0.01, 0.01], 5)
    assert figures["all_warmup"] is True and figures["warmup_steps"] == 5
    assert figures["step_time_p50"] == pytest.approx(2.0)  # then the percentiles are of every step


def test_the_warm_up_is_said_in_words():
    assert warmup_sentence(6, 2.1, "compilation") == "the first 6 steps took 2.1 s: compilation"
    assert warmup_sentence(1, 0.21) == "the first step took 210 ms: warm-up"
    assert warmup_sentence(4, 9.0, "compilation", all_warmup=True) == (
        "all 4 steps were warm-up (9.0 s: compilation): the loop never reached a steady state")


def test_every_first_step_that_periodic_stall_would_count_is_warm_up():
    from gpuwidget.advice.rules.periodic_stall import OUTLIER_RATIO, STALL_MIN_S, find_stalls

    median = 0.002
    # The smallest step periodic-stall counts as a stall, at the start of a run.
    first = max(OUTLIER_RATIO * median, median + STALL_MIN_S) + 1e-6
    times = [first] + [median] * 99
    assert find_stalls(times)[0] == [0]
    assert split_warmup(times).steps == 1


# ------------------------------------------------------------------ real loops


def watched_epoch(train_loader: Any, model: Any) -> Any:
    import torch

    import gpuwidget

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for x, y in train_loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run


@pytest.mark.usefixtures("one_torch_thread")
def test_a_cold_cache_at_the_start_is_measured_apart_and_said_in_the_panel():
    import torch
    from torch.utils.data import DataLoader

    from gpuwidget.report import run_html, run_text

    import workloads

    data = workloads.FirstTouchDataset(torch.randn(3200, 64), torch.randint(0, 10, (3200,)),
                                       slow_items=6 * 32, latency=0.04 / 32)  # 6 batches of 40 ms
    run = watched_epoch(DataLoader(data, batch_size=32), workloads.mlp(features=64, hidden=128, layers=1))
    s = run.summary
    assert 6 <= s["warmup_steps"] <= 8, s  # a loaded host's spike right after may add a step or two
    assert s["warmup_s"] >= 6 * 0.04 and "warmup_cause" not in s and not s.get("all_warmup")
    assert s["step_time_p99"] < 0.04  # the slow start is not in the step times
    line = f"warm-up: the first {s['warmup_steps']} steps took"
    assert line in run_text(run) and line in run_html(run)


@pytest.mark.usefixtures("one_torch_thread")
def test_workers_starting_are_named_as_the_warm_up():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import workloads

    # Each worker opens its data before its first batch (a file, a connection): 0.2 s, as a
    # dataset's would. With fork alone the start is ~10 ms, as long as torch's own first step in
    # a fresh process, and a step half of each is rightly not named (CI read 32 ms of 64).
    data = TensorDataset(torch.randn(3200, 64), torch.randint(0, 10, (3200,)))
    loader = DataLoader(data, batch_size=32, num_workers=2, worker_init_fn=workloads.open_slowly)
    run = watched_epoch(loader, workloads.mlp(features=64, hidden=128, layers=1))
    s, facts = run.summary, run.workload["loaders"][0]
    said = (s.get("warmup_steps"), s.get("warmup_s"), facts["step_times"][:4], facts["wait_times"][:4])
    assert s["warmup_steps"] >= 1 and s.get("warmup_cause") == "worker start-up", said
    assert s["warmup_s"] >= facts["wait_times"][0] >= workloads.OPEN_S / 2  # the workers start at iter(), before next()


def test_the_headline_rates_leave_the_warm_up_out_and_keep_it_beside_them():
    """Four compiling steps of 0.3 s before 146 steps of 3 ms: the loop runs at 333 steps/s, not 98."""
    from gpuwidget.figures.summary import summarize
    from gpuwidget.trace import Trace

    times = [0.3] * 4 + [0.003] * 146
    waits = [0.05] * 4 + [0.0003] * 146
    loader = {"name": "loader", "steps": 150, "samples": 1200, "loop_time_s": sum(times), "wait_total_s": sum(waits),
              "compute_total_s": sum(times) - sum(waits), "step_times": times, "wait_times": waits, "settings": {}}
    summary = summarize(Trace(), {"loaders": [loader]}, duration_s=2.0)  # type: ignore[typeddict-item]
    assert summary["warmup_steps"] == 4
    assert summary["steps_per_s"] == pytest.approx(1 / 0.003, rel=1e-6)
    assert summary["samples_per_s"] == pytest.approx(8 / 0.003, rel=1e-6)
    assert summary["data_wait_fraction"] == pytest.approx(0.1, rel=1e-6)
    assert summary["steps_per_s_with_warmup"] == pytest.approx(150 / sum(times))
    assert summary["data_wait_fraction_with_warmup"] == pytest.approx(sum(waits) / sum(times))
    training = {"optimizer_steps": 150, "loop_s": sum(times), "step_times": times, "samples_per_step": 8}
    optimizer = summarize(Trace(), {"training": training}, duration_s=2.0)  # type: ignore[typeddict-item]
    assert optimizer["step_source"] == "optimizer" and optimizer["samples_per_s"] == pytest.approx(8 / 0.003)
    every = summarize(Trace(), {"loaders": [{**loader, "step_times": [0.3] * 150, "wait_times": [0.0] * 150,
                                             "loop_time_s": 45.0}]}, duration_s=50.0)  # type: ignore[typeddict-item]
    assert "samples_per_s_with_warmup" not in every  # no warm-up split off: the figures are every step's
