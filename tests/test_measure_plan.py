"""Finding.measure, --tune and the panel's Measure button: each finding's own change measured in the cell's
loop, shown beside its bound, and the best set measured together."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpuwidget
from gpuwidget.advice.finding import Finding
from gpuwidget.measure.plan import measure_findings, plan_budget
from gpuwidget.options import WatchOptions, make_options
from gpuwidget.report import finding_html, finding_text

import workloads


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Timing on a shared two-core machine: the math on one core (conftest)."""


# The cells' models stay alive as a notebook's names keep them (a Run holds them weakly).
KEPT: list[Any] = []


def trained_mlp() -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    features, labels = torch.randn(8, 64), torch.randint(0, 10, (8,))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(10):
            x, y = features, labels
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    KEPT[:] = [model, optimizer, criterion]
    return run


def with_findings(run: Any, *findings: Finding) -> Any:
    run.findings = list(findings)
    run.adopt_findings()
    return run


SMALL_BATCH = Finding("small-batch", "warn", "Batches of 8 leave the GPU idle", change={"batch_size": 256},
                      expected_speedup=1.8)
FP32 = Finding("fp32-math", "warn", "FP32 math skips the Tensor Cores",
               change={"float32_matmul_precision": "high", "autocast_dtype": "bfloat16"}, expected_speedup=1.4)


def test_a_finding_measures_its_own_change_and_shows_it_beside_its_bound():
    run = with_findings(trained_mlp(), SMALL_BATCH)
    finding = run.findings[0]
    measured = finding.measure(budget_s=5)
    assert measured.change == {"batch_size": 256} and measured.bound == 1.8
    assert finding.measured is measured
    assert measured.verdict == "faster", measured.text()  # 32 times the samples for one step's overhead
    line = f"up to 1.80x (bound) \u00b7 measured {measured.speedup:.2f}x [{measured.ci[0]:.2f}, {measured.ci[1]:.2f}]"
    assert line in finding_text(finding) and line in finding_html(finding)
    assert "loss within" in finding_text(finding)
    # Saved and loaded, the finding still says what was measured.
    loaded = Finding.from_dict(finding.to_dict())
    assert loaded.measured.verdict == "faster" and line in finding_text(loaded)


def test_a_change_without_gain_is_not_recommended_and_says_why(monkeypatch):
    # What a finding says of a change measured as no faster, not how often timing finds that: by the
    # sides' clock every step of either side takes the same 2 ** -12 s (exact in binary). TF32 on the
    # CPU changes nothing either, but a loaded host times a no-op "faster" or "slower" now and then.
    ticks = iter(range(10 ** 9))
    monkeypatch.setattr("gpuwidget.measure.sides.now", lambda: next(ticks) * 2.0 ** -12)
    run = with_findings(trained_mlp(), FP32)
    measured = run.findings[0].measure(budget_s=4)
    assert measured.change == {"tf32": True}  # the change its bound is about
    assert measured.ci == (1.0, 1.0) and measured.verdict == "no difference"
    assert "not recommended" in finding_text(run.findings[0])


def test_a_finding_whose_change_no_step_can_try_says_so():
    finding = Finding("memory-pressure", "warn", "Fragmented", change={"PYTORCH_CUDA_ALLOC_CONF": "x"})
    with_findings(trained_mlp(), finding)
    with pytest.raises(ValueError, match="not one a training step can try"):
        finding.measure()


def test_every_finding_is_measured_and_the_gains_together_once():
    run = with_findings(trained_mlp(), SMALL_BATCH, FP32,
                        Finding("launch-bound", "warn", "Python-bound", change={"torch_compile": True}))
    run.subjects.loader_refs = []  # no loader in this cell: no tuner
    told: list[str] = []
    calls: list[dict[str, Any]] = []
    original = run.measure

    def measure(change: dict[str, Any], **kwargs: Any) -> Any:
        calls.append(dict(change))
        if "compile" in change:  # compiling takes its own slow test (test_measure_models); here: refused
            raise ValueError("compile is measured elsewhere")
        return original(change, **kwargs)

    run.measure = measure
    plan = measure_findings(run, budget_s=16, progress=lambda line, elapsed: told.append(line))
    assert [item.rule for item in plan.items] == ["small-batch", "fp32-math", "fp32-math", "launch-bound"]
    assert calls[:4] == [{"batch_size": 256}, {"tf32": True}, {"autocast": "bfloat16"}, {"compile": True}]
    assert plan.items[-1].error == "compile is measured elsewhere"
    faster = {item.rule for item in plan.items if item.measurement and item.measurement.verdict == "faster"}
    if len(faster) >= 2:  # bf16 autocast faster on this CPU too: then they are measured together, once
        assert plan.combined is not None and len(calls) == 5
    else:
        assert plan.combined is None and len(calls) == 4
    chosen = plan.chosen
    assert chosen is not None and chosen[1].verdict == "faster"
    bundle = plan._repr_mimebundle_()
    assert "gpuwidget-plan" in bundle["text/html"] and "Adopt batch_size=256" in bundle["text/plain"]
    assert any(line.startswith("small-batch: batch_size=256") for line in told)


def test_the_budget_announced_is_the_one_given_to_the_measurement():
    run = with_findings(trained_mlp(), SMALL_BATCH)
    run.subjects.loader_refs = []
    assert plan_budget(run) == 15.0
    plan = measure_findings(run)
    assert plan.budget_s == 15.0 and plan.elapsed_s <= 15.0 * 1.2


def test_a_budget_the_user_chose_is_the_one_announced_and_kept_with_the_run():
    run = with_findings(trained_mlp(), SMALL_BATCH)
    run.subjects.loader_refs = []
    run.options = make_options(budget="8")
    assert plan_budget(run) == 8.0  # the offer's "about 8 s", --tune's and Measure's budget
    assert WatchOptions.from_dict(run.options.to_dict()).budget == 8.0  # saved with the run
    run.findings = []
    assert plan_budget(run) == 0.0  # nothing to measure: still nothing, whatever the budget


@pytest.mark.slow
def test_gpuwatch_tune_measures_the_loader_and_every_finding_in_the_cells_own_loop_within_its_budget(ip):
    workload = workloads.cpu_heavy_transform(items=320)
    ip.user_ns.update(train_loader=workload.loader, train_ds=workload.loader.dataset, train=workload.train)
    result = ip.run_cell("%%gpuwatch --tune --budget 15 --quiet\ntrain(train_loader)\n")
    assert result.success
    run = gpuwidget.last_run()
    plan = run.measured
    assert plan is not None and run.tuning is plan.tuning and plan.tuning is not None
    # --budget: the plan's time in all, told in its summary (the default would be 35 s and more here).
    assert plan.budget_s == 15.0 and plan.elapsed_s <= 15.0 * 1.5, (plan.budget_s, plan.elapsed_s)
    assert "of a 15.0 s budget" in plan.summary()
    # The tuner searched the cell's own loader, by its name, against the rate the loop consumed.
    tuning = run.tuning
    assert tuning.name == "train_loader"
    loader = run.workload["loaders"][0]
    assert tuning.target_rate == pytest.approx(loader["steps"] / loader["compute_total_s"])
    assert tuning.code.splitlines()[-1].startswith("train_loader = DataLoader(train_ds, "), (
        tuning._repr_mimebundle_()["text/plain"], [(f.rule, dict(f.change)) for f in run.findings])
    loader_findings = [f for f in run.findings if f.trial_changes()]
    assert [item.change for item in plan.items] == [c for f in loader_findings for c in f.trial_changes()]
    for item in plan.items:  # the loader's settings fed the cell's own model step
        assert item.measurement is not None, item.error
        assert any("fed by new loaders" in note for note in item.measurement.notes)
        assert item.measurement.loss == "cross_entropy(output, y), guessed"
