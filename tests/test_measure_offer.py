"""What Measure says when what it would measure is gone, and a plan that could measure nothing: without a
kernel, on a watched run's own objects (the model kept, the loader rebound as tutorial 01 does before its
second watched cell)."""

from __future__ import annotations

import gc

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpuwidget.advice.finding import Finding
from gpuwidget.measure.plan import MeasuredChange, MeasurePlan
from gpuwidget.measure.subjects import Subjects
from gpuwidget.run import Run
from gpuwidget.trace import Trace
from gpuwidget.ui.actions import LOADER_GONE_NOTE, MeasureOffer

STARVED = Finding("dataloader-starved", "warn", "The loop waits for data",
                  change={"num_workers": 2, "persistent_workers": True})
FP32 = Finding("fp32-math", "warn", "FP32 math", change={"float32_matmul_precision": "high"})


def run_with(model: torch.nn.Module, *findings: Finding) -> Run:
    run = Run(Trace(), label="In [3]")
    run.findings = list(findings)
    run.subjects = Subjects.from_watch({"model": model, "loaders": []}, {}, None)
    return run


def offer_with_a_rebound_loader(run: Run) -> MeasureOffer:
    loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
    offer = MeasureOffer(run, loader)
    del loader
    gc.collect()
    return offer


def test_a_loader_setting_with_the_loader_rebound_says_so_though_the_model_lives():
    model = torch.nn.Linear(2, 2)
    status, bundle = offer_with_a_rebound_loader(run_with(model, STARVED)).measure()
    assert status == "gone"
    assert bundle["text/plain"] == LOADER_GONE_NOTE


def test_a_change_of_the_step_is_still_measurable_when_only_the_loader_is_gone():
    model = torch.nn.Linear(2, 2)
    offer = offer_with_a_rebound_loader(run_with(model, STARVED, FP32))
    assert offer._gone() is None  # the fp32 change runs on the model, which lives


def test_a_plan_that_measured_nothing_says_why_and_not_that_nothing_was_faster():
    plan = MeasurePlan([MeasuredChange("dataloader-starved", {"num_workers": 2},
                                       error="the watched loader no longer exists")], budget_s=15)
    assert plan.summary() == "Measured none of 1 change(s): the watched loader no longer exists."
