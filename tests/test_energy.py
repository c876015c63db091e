"""GPU energy per sample and per step, from NVML's energy counter (the fake NVML's counter rises with power x time)."""

from __future__ import annotations

import os
import time

import pytest

import gpuwidget
from gpuwidget.figures.summary import summarize
from gpuwidget.report import fmt_energy
from gpuwidget.run import Run
from gpuwidget.sources.nvml import NvmlSource
from gpuwidget.trace import Trace

from fakenvml import GIB, FakeNvml

ENERGY_KEYS = ("energy_j", "energy_per_sample_j", "energy_per_step_j")
ENERGY_CALL = "nvmlDeviceGetTotalEnergyConsumption"

# 64 samples in 8 steps, a little work per step: a watched loop of about 0.8 s (long enough that a
# sampler thread held off the CPU for a few ms on a loaded host moves the figure by well under 5%).
LOADER_CELL = """%%gpuwatch --quiet --interval 0.02
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 2)), batch_size=8)
for x, y in loader:
    time.sleep(0.1)
"""


def _training_on_gpu0(**gpu0: object) -> FakeNvml:
    """GPU 0 at 300 W holding this process's memory; GPU 1 idle at 60 W, used by nobody."""
    fake = FakeNvml.gpus(2, util=0, power_mw=60_000)
    fake.set(0, util=95, power_mw=300_000, **gpu0).processes(0, compute=[(os.getpid(), 4 * GIB)])
    fake.real_time = True
    return fake


def test_the_nvml_source_reads_the_counter_in_joules(fake_nvml):
    fake = fake_nvml(FakeNvml.single(power_mw=250_000))
    source = NvmlSource()
    try:
        first = source.read()["gpu0.energy_j"]
        fake.step(10)  # a second at 250 W
        assert source.read()["gpu0.energy_j"] - first == pytest.approx(250.0)
        assert first == pytest.approx(86_400_000.0)  # the counter runs from the driver's start, in J
    finally:
        source.close()


def test_energy_per_sample_and_step_match_power_times_the_watched_time(ip, fake_nvml):
    fake_nvml(_training_on_gpu0())
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()
    summary = run.summary

    # Only the GPU that trained counts (the idle one's 60 W is not this cell's), over the cell's own time:
    # the counter is interpolated at the cell's start and end, whenever the sampler began and stopped.
    assert summary["energy_j"] == pytest.approx(300.0 * summary["duration_s"], rel=0.05)
    assert summary["energy_per_sample_j"] == pytest.approx(summary["energy_j"] / 64)
    assert summary["energy_per_step_j"] == pytest.approx(summary["energy_j"] / 8)

    text = run._repr_mimebundle_()["text/plain"]
    per_sample, total = fmt_energy(summary["energy_per_sample_j"]), fmt_energy(summary["energy_j"])
    assert f"GPU energy {per_sample}/sample, {total} total" in text
    assert "GPU energy" in run._repr_mimebundle_()["text/html"]
    assert Run.from_dict(run.to_dict()).summary["energy_j"] == summary["energy_j"]


def test_a_gpu_without_an_energy_counter_leaves_the_figures_out_not_zero(ip, fake_nvml):
    fake = fake_nvml(_training_on_gpu0())
    fake.not_supported(0, "energy")
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()
    assert not any(key in run.summary for key in ENERGY_KEYS)
    assert run.summary["gpu_kernel_running_mean"] == pytest.approx(95.0)  # the rest of the GPU figures are there
    assert "energy" not in run._repr_mimebundle_()["text/plain"]
    assert fake.count(ENERGY_CALL, 0) == 1  # NotSupported once: never asked again
    assert not any("energy" in error["message"].lower() for error in run.sampler["source_errors"])


def test_without_a_gpu_there_is_no_energy_figure(ip, fake_nvml):
    fake_nvml(FakeNvml.library_missing())
    assert ip.run_cell("%%gpuwatch --quiet --interval 0.02\nimport time\ntime.sleep(0.05)\n").success
    run = gpuwidget.last_run()
    assert not any(key in run.summary for key in ENERGY_KEYS)
    assert "energy" not in run._repr_mimebundle_()["text/plain"]


def _counter_trace(readings: list[float], **trace_options: int) -> Trace:
    trace = Trace(**trace_options)
    for tick, joules in enumerate(readings):
        trace.append(tick * 0.1, {"gpu0.util": 90.0, "gpu0.proc_mem": GIB, "gpu0.energy_j": joules})
    return trace


def test_a_driver_reload_mid_run_restarts_the_counter_and_the_energy_still_adds_up():
    # 30 J a tick: 10 ticks on an old count, then the driver reloads and counts again from 12 J.
    before = [5e9 + 30.0 * tick for tick in range(10)]
    after = [12.0 + 30.0 * tick for tick in range(10)]
    summary = summarize(_counter_trace(before + after), {}, duration_s=1.9)  # the cell: first to last reading
    assert summary["energy_j"] == pytest.approx(9 * 30.0 + 12.0 + 9 * 30.0)


def test_energy_over_a_run_longer_than_the_raw_rows_is_exact_despite_the_archives_float32():
    # A counter at 5 GJ (months of uptime): float32 keeps it to 512 J, the archive's resolution.
    readings = [5e9 + 7.5 * tick for tick in range(3000)]
    trace = _counter_trace(readings, recent_capacity=64, archive_capacity=64)
    assert trace.bucket_width_s > 0.1  # most rows were merged into float32 buckets
    assert summarize(trace, {}, duration_s=299.9)["energy_j"] == pytest.approx(7.5 * 2999)
    # The cell went on 0.1 s after the last reading: charged at the last readings' 75 W, still exact.
    assert summarize(trace, {}, duration_s=300.0)["energy_j"] == pytest.approx(7.5 * 3000)


def test_a_judged_gpu_without_the_counter_leaves_the_total_out():
    trace = Trace()
    for tick in range(10):
        trace.append(tick * 0.1, {"gpu0.util": 90.0, "gpu0.energy_j": 1e6 + tick, "gpu1.util": 90.0})
    assert "energy_j" not in summarize(trace, {}, duration_s=1.0)  # two GPUs judged, one can't say


def test_energy_is_charged_over_the_cell_not_the_sampler_lifetime():
    # A 0.33 s cell at 300 W on a loaded host: the sampler's first reading came 50 ms in, its last one
    # 0.6 s after the cell ended (the watch winding down). The sampler's span would charge 195 J.
    trace = Trace()
    for tick in range(18):
        t = 0.05 + 0.05 * tick
        trace.append(t, {"gpu0.util": 90.0, "gpu0.proc_mem": GIB, "gpu0.energy_j": 1e6 + 300.0 * t})
    assert summarize(trace, {}, duration_s=0.33)["energy_j"] == pytest.approx(300.0 * 0.33)
    assert summarize(trace, {})["energy_j"] == pytest.approx(300.0 * 0.85)  # no cell given: first to last


def test_a_watch_that_winds_down_slowly_is_not_charged_for_it(ip, fake_nvml, monkeypatch):
    from gpuwidget.session import Watch

    fake_nvml(_training_on_gpu0())
    close_children = Watch._close_children

    def slow(self: Watch) -> None:  # the sampler reads on for 0.5 s after the cell ended
        time.sleep(0.5)
        close_children(self)

    monkeypatch.setattr(Watch, "_close_children", slow)
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()
    first, last = (run.trace.window(columns=["gpu0.energy_j"]).t[i] for i in (0, -1))
    assert last - first > run.summary["duration_s"] + 0.4  # the sampler did read on
    assert run.summary["energy_j"] == pytest.approx(300.0 * run.summary["duration_s"], rel=0.05)


def test_readings_that_miss_most_of_the_cell_give_no_energy_figure():
    trace = _counter_trace([1e6 + 30.0 * tick for tick in range(10)])  # 0.9 s of readings
    assert "energy_j" in summarize(trace, {}, duration_s=1.8)
    assert "energy_j" not in summarize(trace, {}, duration_s=1.81)  # under half the cell was read
