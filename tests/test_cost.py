"""A price per GPU-hour: --price, watch(price=...), the environment the server's GpuWidget.gpu_hour_price
sets for its kernels; the summary's cost over the GPUs judged and the idle share of it, in the headline."""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError
from traitlets import TraitError

import gpuwidget
from gpuwidget.advice.finding import Finding
from gpuwidget.cli import main
from gpuwidget.figures.summary import summarize
from gpuwidget.options import BUDGET_ENV, PRICE_ENV, OptionError, make_options, parse_args, parse_line
from gpuwidget.run import Run
from gpuwidget.trace import Trace

from fakenvml import GIB, FakeNvml

RUN_CELL = "%%gpuwatch --quiet --interval 0.02 {options}\nimport time\ntime.sleep(0.2)\n"


@pytest.fixture(autouse=True)
def no_price_in_the_environment(monkeypatch):
    """Unset for each test, and as it was afterwards whatever a test (the server's share_with_kernels) set."""
    for name in (PRICE_ENV, BUDGET_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def one_of_eight(sm_active: float | None = 30.0, ticks: int = 20) -> Trace:
    """GPU 0 trained (this process's memory, 30% of its SMs active), GPUs 1-7 idle."""
    trace = Trace()
    for tick in range(ticks):
        row = {}
        for index in range(8):
            row[f"gpu{index}.util"] = 95.0 if index == 0 else 0.0
            row[f"gpu{index}.proc_mem"] = 4.0 * GIB if index == 0 else 0.0
        if sm_active is not None:
            row.update({f"gpu{index}.sm_active": sm_active if index == 0 else 0.0 for index in range(8)})
        trace.append(tick * 0.1, row)
    return trace


def test_cost_and_idle_cost_from_price():
    # Half an hour on the one GPU used, at 4 per GPU-hour: 2.00, of which its SMs idled 70%.
    summary = summarize(one_of_eight(), {}, duration_s=1800.0, price=4.0)
    assert summary["gpus_judged"] == 1 and summary["gpu_hour_price"] == 4.0
    assert summary["cost"] == pytest.approx(2.0)
    assert summary["idle_cost"] == pytest.approx(2.0 * 0.7)  # idle by the busy figure, SM activity
    run = Run(trace=one_of_eight(), summary=summary, finished=True,
              machine={"gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "gpm": True} for i in range(8)]})
    assert "cost at 4/GPU-h 2.00 (1.40 idle)" in run._repr_mimebundle_()["text/plain"]
    assert "cost at 4/GPU-h" in run._repr_mimebundle_()["text/html"]


def test_without_gpm_idle_is_by_kernel_running_and_without_a_price_there_is_no_cost():
    summary = summarize(one_of_eight(sm_active=None), {}, duration_s=3600.0, price=2.5)
    assert summary["cost"] == pytest.approx(2.5) and summary["idle_cost"] == pytest.approx(2.5 * 0.05)
    unpriced = summarize(one_of_eight(), {}, duration_s=3600.0)
    assert not {"cost", "idle_cost", "gpu_hour_price"} & set(unpriced)


def test_every_gpu_is_charged_when_nothing_says_which_was_used():
    trace = Trace()
    for tick in range(10):
        trace.append(tick * 0.1, {f"gpu{index}.util": 0.0 for index in range(8)})
    summary = summarize(trace, {}, duration_s=3600.0, price=1.0)
    assert summary["gpu_busy_basis"] == "visible" and summary["cost"] == pytest.approx(8.0)
    assert summary["idle_cost"] == pytest.approx(8.0)


def test_a_mig_instance_without_a_busy_figure_has_a_cost_but_no_idle_cost_guessed():
    trace = Trace()
    for tick in range(10):
        trace.append(tick * 0.1, {"gpu0.mem_used": GIB, "gpu0.mem_total": 20.0 * GIB, "gpu0.proc_mem": GIB})
    machine = {"gpus": [{"index": 0, "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "is_mig": True, "gpm": False}]}
    summary = summarize(trace, {}, duration_s=3600.0, machine=machine, price=1.2)
    assert summary["cost"] == pytest.approx(1.2) and "idle_cost" not in summary
    assert "gpu_busy_missing" in summary


def test_without_a_gpu_nothing_is_charged():
    trace = Trace()
    trace.append(0.0, {"cpu.util": 10.0})
    assert "cost" not in summarize(trace, {}, duration_s=3600.0, price=3.0)


@pytest.mark.parametrize("bad", ["abc", "-1", "0", "inf", "nan"])
def test_bad_price_is_a_usage_error(ip, bad):
    result = ip.run_cell(f"%%gpuwatch --price {bad}\nraise AssertionError('the cell must not run')\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec) == (
        f"%%gpuwatch: --price: expected a positive price per GPU-hour like 2.5, got {bad!r}")
    with pytest.raises(ValueError, match="--price: expected a positive price"), gpuwidget.watch(price=bad):
        pass


def test_bad_price_stops_the_command_line_before_the_command_runs(capsys, tmp_path):
    marker = tmp_path / "ran"
    assert main(["--price", "free", "--", "touch", str(marker)]) == 2
    assert "gpuwatch: --price: expected a positive price per GPU-hour like 2.5, got 'free'" in capsys.readouterr().err
    assert not marker.exists()
    assert parse_args(["--price", "1.75"]).price == 1.75


def test_the_price_comes_from_the_environment_the_server_sets_for_its_kernels(monkeypatch):
    from gpuwidget.server import GpuWidget, share_with_kernels

    share_with_kernels(GpuWidget(gpu_hour_price=3.2))
    assert os.environ[PRICE_ENV] == "3.2"
    assert make_options().price == 3.2 and parse_line("").price == 3.2
    assert parse_line("--price 1").price == 1.0  # the cell's own option wins
    with pytest.raises(TraitError, match="positive number per GPU-hour"):
        GpuWidget(gpu_hour_price=-1.0)
    share_with_kernels(GpuWidget())  # unset: the environment is left as it is
    assert os.environ[PRICE_ENV] == "3.2"
    monkeypatch.setenv(PRICE_ENV, "cheap")
    with pytest.raises(OptionError, match=f"^{PRICE_ENV} \\(the environment's GPU-hour price\\): expected a positive"):
        make_options()


def test_the_measure_budget_comes_from_the_environment_the_server_sets_for_its_kernels(monkeypatch):
    from gpuwidget.measure.plan import plan_budget
    from gpuwidget.server import GpuWidget, share_with_kernels

    assert make_options().budget is None  # unset: each plan announces its own
    share_with_kernels(GpuWidget(measure_budget=12.0))
    assert os.environ[BUDGET_ENV] == "12.0"
    assert make_options().budget == 12.0 and parse_line("").budget == 12.0
    assert parse_args(["--interval", "1"]).budget == 12.0
    assert parse_line("--budget 60").budget == 60.0  # the cell's own option wins
    run = gpuwidget.Run(trace=Trace(), options=make_options())
    run.findings = [Finding("small-batch", "warn", "Batches of 8 leave the GPU idle", change={"batch_size": 256})]
    assert plan_budget(run) == 12.0  # what Measure announces and takes
    with pytest.raises(TraitError, match="measure_budget must be seconds from 1 to 3600"):
        GpuWidget(measure_budget=0.5)
    monkeypatch.setenv(BUDGET_ENV, "soon")
    with pytest.raises(OptionError, match=f"^{BUDGET_ENV} \\(the environment's Measure budget\\): expected seconds"):
        make_options()


def test_a_priced_cell_shows_what_it_cost(ip, fake_nvml):
    fake = FakeNvml.single(util=90, sm_active=40.0).processes(0, compute=[(os.getpid(), 4 * GIB)])
    fake.real_time = True
    fake_nvml(fake)
    assert ip.run_cell(RUN_CELL.format(options="--price 3600")).success  # 1 per GPU-second
    summary = gpuwidget.last_run().summary
    assert summary["cost"] == pytest.approx(summary["duration_s"])
    assert summary["idle_cost"] == pytest.approx(0.6 * summary["cost"])
    assert gpuwidget.last_run().options.price == 3600.0
    with gpuwidget.watch(price=7200, display=False) as run:
        pass
    assert run.summary["cost"] == pytest.approx(2 * run.summary["duration_s"])
