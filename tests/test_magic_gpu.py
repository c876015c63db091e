"""%%gpuwatch against fake GPUs: the real nvidia-ml-py code path, driven by the fake NVML."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import gpuwidget

from fakenvml import FakeNvml


def test_eight_gpus_are_recorded_and_summarised(ip, fake_nvml):
    fake_nvml(_eight_busy_gpus())
    result = ip.run_cell("%%gpuwatch --interval 0.02 --quiet\nimport time\ntime.sleep(0.2)\n")
    assert result.success
    run = gpuwidget.last_run()
    assert [d["index"] for d in run.machine["gpus"]] == list(range(8))
    for index in range(8):
        assert run.trace.stats(f"gpu{index}.util") is not None
    assert run.summary["gpu_busy_mean"] == pytest.approx(75.0)
    assert 0 < run.summary["peak_gpu_mem_fraction"] <= 1
    text = run._repr_mimebundle_()["text/plain"]
    assert "GPU busy 75%" in text and "GPU7" in text


def _eight_busy_gpus() -> FakeNvml:
    fake = FakeNvml.gpus(8)
    for index in range(8):
        fake.set(index, util=75)
    fake.real_time = True
    return fake


def test_gpus_option_selects_devices_by_cuda_number(ip, fake_nvml):
    fake_nvml(_eight_busy_gpus())
    ip.run_cell("%%gpuwatch --gpus 2,5 --quiet --interval 0.02\npass\n")
    run = gpuwidget.last_run()
    assert [d["index"] for d in run.machine["gpus"]] == [2, 5]
    assert not any(c.startswith("gpu0.") for c in run.trace.columns)


def test_asking_for_a_gpu_that_is_not_there_is_a_usage_error(ip, fake_nvml):
    fake_nvml(FakeNvml.gpus(2))
    result = ip.run_cell("%%gpuwatch --gpus 5\nran_anyway = 1\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "no GPU 5 here (visible: GPUs 0-1)" in str(result.error_in_exec)
    assert "ran_anyway" not in ip.user_ns


def test_gpu_lost_mid_run_ends_that_device_and_the_rest_go_on(ip, fake_nvml):
    fake = FakeNvml.gpus(2)
    fake.real_time = True
    fake.lose_gpu(1, at_tick=3)
    fake_nvml(fake)
    result = ip.run_cell("%%gpuwatch --interval 0.02 --quiet\nimport time\ntime.sleep(0.6)\n")
    assert result.success
    run = gpuwidget.last_run()
    gpu0 = run.trace.stats("gpu0.util")
    gpu1 = run.trace.stats("gpu1.util")
    assert gpu0.count > gpu1.count >= 1
    messages = [e["message"] for e in run.sampler["source_errors"]]
    assert any("lost" in m.lower() for m in messages)


def test_no_driver_means_host_metrics_and_a_plain_message(ip, fake_nvml):
    fake_nvml(FakeNvml.library_missing())
    ip.run_cell("%%gpuwatch --quiet --interval 0.02\nimport time\ntime.sleep(0.1)\n")
    run = gpuwidget.last_run()
    assert run.machine["gpus"] == []
    assert "no NVIDIA GPU found" in run.machine["gpu_message"]
    assert not any(c.startswith("gpu") for c in run.trace.columns)
    assert "gpu_busy_mean" not in run.summary
    assert run.trace.stats("cpu.util").count >= 2


# ------------------------------------------------------------------ TF32: PyTorch's current switch

_TF32_CELL = """%%gpuwatch --quiet --interval 0.02
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.backends.cuda.matmul.fp32_precision = "tf32"
net = torch.nn.Linear(8, 2)
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 2)), batch_size=8)
for x, y in loader:
    net(x).sum().backward()
"""


@pytest.fixture
def fp32_precision_restored():
    """The TF32 switch is process-wide: leave it as found ("none": inherit, torch's default)."""
    import torch

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    yield
    matmul.fp32_precision = saved


def test_setting_tf32_through_the_new_api_keeps_the_summary_and_records_it(ip, fake_nvml,
                                                                            fp32_precision_restored):
    import torch

    fake_nvml(FakeNvml.single())
    result = ip.run_cell(_TF32_CELL)
    assert result.success
    # The reproduction: torch's legacy reader raises once the new API was used.
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    run = gpuwidget.last_run()
    assert run.summary["steps"] == 8 and run.summary["samples_per_s"] > 0
    model = run.workload["model"]
    assert model["tf32_api"] == "fp32_precision"
    assert model["matmul_fp32_precision"] == "tf32" and model["cuda_matmul_allow_tf32"] is True
    assert model["float32_matmul_precision"] == "high"
    assert "probe_errors" not in run.workload


def test_one_failing_probe_is_recorded_and_the_others_still_report(ip, fake_nvml, monkeypatch):
    from gpuwidget.probes.torch_model import ModelProbe

    def broken(self, names):
        raise RuntimeError("model facts broke")

    monkeypatch.setattr(ModelProbe, "facts", broken)
    fake_nvml(FakeNvml.single())
    assert ip.run_cell(_TF32_CELL.replace('torch.backends.cuda.matmul.fp32_precision = "tf32"\n', "")).success
    run = gpuwidget.last_run()
    assert run.summary["steps"] == 8
    assert run.workload["loaders"][0]["steps"] == 8
    assert run.workload["model"] is None
    assert any("model facts unavailable" in e and "model facts broke" in e for e in run.workload["probe_errors"])
