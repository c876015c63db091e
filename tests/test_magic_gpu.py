"""%%gpuwatch against fake GPUs: the real nvidia-ml-py code path, driven by the fake NVML."""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError

import gpuwidget

from fakenvml import GIB, FakeNvml


def test_eight_gpus_are_recorded_and_summarised(ip, fake_nvml):
    fake_nvml(_eight_busy_gpus())
    result = ip.run_cell("%%gpuwatch --interval 0.02 --quiet\nimport time\ntime.sleep(0.2)\n")
    assert result.success
    run = gpuwidget.last_run()
    assert [d["index"] for d in run.machine["gpus"]] == list(range(8))
    for index in range(8):
        assert run.trace.stats(f"gpu{index}.util") is not None
    # Hopper GPUs: the busy figure is GPM's SM activity (the fake's 60%), NVML's utilisation is beside it.
    assert run.summary["gpu_busy_metric"] == "sm_active"
    assert run.summary["gpu_busy_mean"] == pytest.approx(60.0)
    assert run.summary["gpu_kernel_running_mean"] == pytest.approx(75.0)
    assert 0 < run.summary["peak_gpu_mem_fraction"] <= 1
    text = run._repr_mimebundle_()["text/plain"]
    assert "SM active 60% · kernel running (nvidia-smi) 75%" in text and "GPU7" in text


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
    assert run.machine["gpu_message"] == "no GPU found (no NVIDIA or AMD GPU driver)"
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


# ------------------------------------------------------------------ what a user sees on real-GPU hosts (issue 15)

_LOADER_CELL = """%%gpuwatch --quiet --interval 0.02
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 2)), batch_size=8)
for x, y in loader:
    time.sleep(0.04)
"""


def test_one_busy_gpu_of_eight_is_judged_alone_and_the_idle_ones_are_named(ip, fake_nvml):
    fake = FakeNvml.gpus(8, util=0, sm_active=0.0, tensor_active=0.0)
    fake.set(0, util=98, sm_active=90.0).processes(0, compute=[(os.getpid(), 4 * GIB)])
    fake.real_time = True
    fake_nvml(fake)

    assert ip.run_cell(_LOADER_CELL).success
    run = gpuwidget.last_run()

    assert run.summary["gpu_busy_mean"] == pytest.approx(90.0)  # SM activity of GPU 0 alone, not 11.25
    assert run.summary["gpu_kernel_running_mean"] == pytest.approx(98.0)
    assert run.summary["gpus_used"] == [0] and run.summary["gpus_unused_idle"] == list(range(1, 8))
    assert not any(f.rule == "small-batch" for f in run.findings)  # the idle seven made it claim up to 8x
    text = run._repr_mimebundle_()["text/plain"]
    assert "SM active 90% · kernel running (nvidia-smi) 98%" in text
    assert "GPUs 1-7 were idle and unused by this kernel." in text


def test_an_idle_gpu_with_an_empty_sample_buffer_reads_idle_and_is_not_called_throttled(ip, fake_nvml):
    # Busy for 0.3 s, then idle with idle clocks: the driver records no samples while idle.
    busy = lambda tick: tick < 3  # noqa: E731
    fake = FakeNvml.single(util=lambda t: 97 if busy(t) else 0, sm_clock_mhz=lambda t: 1980 if busy(t) else 210,
                           clock_events=lambda t: 0 if busy(t) else 0x1, gpm=False)
    fake.processes(0, compute=[(os.getpid(), 4 * GIB)])
    fake.real_time = True
    fake_nvml(fake)

    assert ip.run_cell("%%gpuwatch --quiet --interval 0.02\nimport time\ntime.sleep(1.2)\n").success
    run = gpuwidget.last_run()

    assert run.summary["gpu_busy_mean"] < 40  # it froze at 97 before
    assert run.summary["gpu_idle_gaps"] >= 1
    assert not any(f.rule == "gpu-throttled" for f in run.findings)


def _torch_reserved(monkeypatch, reserved: int, uuid: str | None = None) -> None:
    """torch's view of CUDA device 0 (this CPU build has none): what CudaMemoryProbe would report."""
    from gpuwidget.probes.torch_model import CudaMemoryProbe

    device = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "total_memory": 80 * GIB,
              "peak_allocated": reserved // 2, "peak_reserved": reserved, **({"uuid": uuid} if uuid else {})}
    monkeypatch.setattr(CudaMemoryProbe, "facts", lambda self: {"devices": [device], "peak_since_cell_start": True})


def test_in_a_container_the_user_is_told_and_sees_torchs_memory_not_zero(ip, fake_nvml, monkeypatch):
    fake = FakeNvml.single().in_container(used=6 * GIB)
    fake.real_time = True
    fake_nvml(fake)
    _torch_reserved(monkeypatch, 5 * GIB)

    assert ip.run_cell(_LOADER_CELL).success
    run = gpuwidget.last_run()

    assert run.machine["gpus"][0]["foreign_pid_namespace"] is True
    assert run.summary["process_gpu_mem_peak"] == 5 * GIB and run.summary["process_gpu_mem_source"] == "torch"
    assert run.summary["gpus_used"] == [0]
    assert "own PID namespace (a container)" in run._repr_mimebundle_()["text/plain"]


def test_on_a_mixed_host_gpu_0_is_cudas_device_0(ip, fake_nvml, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    fake = FakeNvml.mixed()
    fake.real_time = True
    fake_nvml(fake)

    assert ip.run_cell("%%gpuwatch --gpus 0 --quiet --interval 0.02\npass\n").success
    run = gpuwidget.last_run()

    assert [g["name"] for g in run.machine["gpus"]] == ["NVIDIA H100 80GB HBM3"]  # NVML's 0 is the A40
    assert "GPU0 NVIDIA H100 80GB HBM3" in run._repr_mimebundle_()["text/plain"]


def test_torchs_device_is_matched_to_its_gpu_by_uuid(ip, fake_nvml, monkeypatch):
    # CUDA's order is a guess on a mixed host; torch says its device 0 is the A40 (NVML's 0).
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    fake = FakeNvml.mixed()
    fake.set(0, util=90).set(1, util=0)
    fake.real_time = True
    fake_nvml(fake)
    _torch_reserved(monkeypatch, 20 * GIB, uuid=fake.gpu(0).uuid[len("GPU-"):])

    assert ip.run_cell(_LOADER_CELL).success
    run = gpuwidget.last_run()

    a40 = next(g["index"] for g in run.machine["gpus"] if g["name"] == "NVIDIA A40")
    assert run.summary["gpus_used"] == [a40]
    assert run.summary["gpu_busy_mean"] == pytest.approx(90.0)


def test_one_unknown_error_does_not_drop_the_gpu_for_the_run(ip, fake_nvml):
    fake = FakeNvml.gpus(2).unknown_at(1, "nvmlDeviceGetPowerUsage", 2)
    fake.real_time = True
    fake_nvml(fake)

    assert ip.run_cell("%%gpuwatch --quiet --interval 0.02\nimport time\ntime.sleep(0.8)\n").success
    run = gpuwidget.last_run()

    assert run.trace.stats("gpu1.util").count >= run.trace.stats("gpu0.util").count - 2
    messages = [e["message"] for e in run.sampler["source_errors"]]
    assert any("still answers" in m for m in messages) and not any("GPU lost" in m for m in messages)


def test_early_r535_driver_still_shows_the_processes_own_memory(ip, fake_nvml):
    fake = FakeNvml.single().r535_process_struct()
    fake.processes(0, compute=[(os.getppid(), 9 * GIB), (os.getpid(), 3 * GIB)])
    fake.real_time = True
    fake_nvml(fake)

    assert ip.run_cell("%%gpuwatch --quiet --interval 0.02\nimport time\ntime.sleep(0.2)\n").success
    assert gpuwidget.last_run().summary["process_gpu_mem_peak"] == 3 * GIB


def test_in_a_container_the_sidebar_does_not_call_the_users_process_another_users(fake_nvml):
    from gpuwidget.server.monitor import HOST_PID_USER, Monitor

    fake = FakeNvml.single().in_container(used=6 * GIB, others=1)
    fake_nvml(fake)
    monitor = Monitor()
    try:
        monitor.read_once()  # the snapshot path: builds the sources, reads, lists the processes
        listed = monitor.processes()
    finally:
        monitor.close()
    rows = listed["gpus"]["gpu0"]
    assert len(rows) == 2 and {row["user"] for row in rows} == {HOST_PID_USER}
    assert all(row["memory"] == 6 * GIB and row["name"] is None for row in rows)
