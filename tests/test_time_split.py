"""The run's time split (waiting for data, computing, before the first step, after the last, other): each
second counted once, whatever loaders nest or stay open, and the parts sum to the run's duration."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpuwidget
from gpuwidget.figures.summary import covered, time_breakdown
from gpuwidget.probes import STEP_SPAN
from gpuwidget.report import run_text
from gpuwidget.trace import Trace

from support import burn_cpu


def test_covered_counts_overlaps_once_and_clips():
    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 0.0, 10.0) == 4.0
    assert covered([(1.0, 2.0), (0.0, 5.0)], 0.0, 10.0) == 5.0  # one inside another
    assert covered([(-1.0, 1.0), (9.0, 12.0)], 0.0, 10.0) == 2.0
    assert covered([], 0.0, 1.0) == 0.0


def test_nested_and_left_open_loaders_count_each_second_once():
    """As Lightning runs them: a sanity-check iterator that takes two batches and stays open, then a
    training epoch of 100 steps with a validation pass every 25 steps inside it, then a pause."""
    train = DataLoader(TensorDataset(torch.randn(400, 4)), batch_size=4)
    val = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)
    sanity_loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)
    with gpuwidget.watch(display=False) as run:
        sanity = iter(sanity_loader)
        next(sanity), next(sanity)
        started = time.perf_counter()
        for step, (_x,) in enumerate(train):
            burn_cpu(0.002)
            if step % 25 == 24:
                for (_v,) in val:
                    burn_cpu(0.0005)
        loop_wall = time.perf_counter() - started
        time.sleep(0.3)
    del sanity
    summary = run.summary
    parts = summary["time_breakdown"]
    duration = summary["duration_s"]
    assert sum(parts.values()) == pytest.approx(duration, abs=1e-9)
    # Summed per loader, the loops take more than the run (validation inside training, the open
    # sanity iterator up to the end): the split counts the training loop's seconds once.
    assert sum(loader["loop_time_s"] for loader in run.workload["loaders"]) > duration
    assert parts["compute_s"] + parts["data_wait_s"] <= loop_wall + 0.05
    assert parts["compute_s"] >= 100 * 0.002 + 4 * 10 * 0.0005
    assert parts["after_loop_s"] >= 0.3  # the pause, and the open sanity step, are not computing
    assert "before_loop_s" in parts and parts["other_s"] >= 0
    assert "time: waiting for data" in run_text(run) and "after the last step" in run_text(run)


def test_a_trace_that_dropped_steps_counts_them_from_the_totals():
    """A long run keeps only its latest spans: the dropped steps count as the loaders' totals say,
    and without the first step's time there is no "before the first step"."""
    trace = Trace(span_capacity=50)
    for index in range(200):  # 200 steps of 10 ms from 1 s to 3 s; the trace keeps the last 50
        trace.add_span(STEP_SPAN, 1.0 + index * 0.01, 1.0 + (index + 1) * 0.01)
    parts = time_breakdown(4.0, trace, None, loop_s=2.0, wait_s=0.5)
    assert parts == pytest.approx({"data_wait_s": 0.5, "compute_s": 1.5, "other_s": 2.0})
    complete = Trace()
    for index in range(200):
        complete.add_span(STEP_SPAN, 1.0 + index * 0.01, 1.0 + (index + 1) * 0.01)
    parts = time_breakdown(4.0, complete, None, loop_s=2.0, wait_s=0.5)
    assert parts == pytest.approx({"data_wait_s": 0.5, "compute_s": 1.5, "before_loop_s": 1.0,
                                   "after_loop_s": 1.0, "other_s": 0.0})


def test_a_step_left_open_is_not_computing():
    trace = Trace()
    trace.add_span(STEP_SPAN, 1.0, 2.0)
    trace.add_span(STEP_SPAN, 2.0, 9.0, {"open": True})  # the loop broke out; the cell went on for 7 s
    parts = time_breakdown(10.0, trace, None, loop_s=8.0, wait_s=0.2)
    assert parts == pytest.approx({"data_wait_s": 0.2, "compute_s": 0.8, "before_loop_s": 1.0,
                                   "after_loop_s": 8.0, "other_s": 0.0})
    # Another process's steps (a child's, with its pid) are its own split's, not this one's.
    trace.add_span(STEP_SPAN, 0.0, 10.0, {"pid": 4242})
    assert time_breakdown(10.0, trace, None, loop_s=8.0, wait_s=0.2)["compute_s"] == pytest.approx(0.8)
    assert time_breakdown(10.0, trace, 4242, loop_s=10.0, wait_s=0.0)["compute_s"] == pytest.approx(10.0)


def test_a_loop_without_a_dataloader_is_split_by_its_optimizer_steps():
    """nanoGPT's shape: batches from a function, an optimizer step each; set-up before, a pause after."""
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 8)
    with gpuwidget.watch(display=False) as run:
        time.sleep(0.2)  # set-up before the first step
        for index in range(40):
            model(data[index % 8:index % 8 + 8]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            burn_cpu(0.002)
        time.sleep(0.3)  # saving, tear-down
    summary = run.summary
    assert summary["step_source"] == "optimizer" and summary["steps"] == 40
    parts = summary["time_breakdown"]
    assert sum(parts.values()) == pytest.approx(summary["duration_s"], abs=1e-9)
    assert parts["compute_s"] == pytest.approx(summary["loop_time_s"], rel=0.05) and parts["data_wait_s"] == 0.0
    assert parts["compute_s"] >= 39 * 0.002
    assert parts["before_loop_s"] >= 0.2 and parts["after_loop_s"] >= 0.3


def test_a_childs_optimizer_loop_is_split_by_its_own_train_step_spans():
    from gpuwidget.children.ranks import job_summary
    from gpuwidget.probes import TRAIN_STEP_SPAN

    trace = Trace()
    for index in range(100):  # a child's 100 steps of 10 ms from 2 s to 3 s
        trace.add_spans(TRAIN_STEP_SPAN, [(2.0 + index * 0.01, 2.0 + (index + 1) * 0.01)], {"pid": 4242})
    entry = {"pid": 4242, "steps": 100, "step_source": "optimizer", "loop_time_s": 1.0, "loaders": []}
    job_summary({"duration_s": 4.0}, {"ranks": [entry]}, trace)  # type: ignore[typeddict-item]
    parts = entry["time_breakdown"]
    assert parts == pytest.approx({"data_wait_s": 0.0, "compute_s": 1.0, "before_loop_s": 2.0, "after_loop_s": 1.0,
                                   "other_s": 0.0})
