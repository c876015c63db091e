"""MIG: every instance in the machine's view, the one this process uses judged by its GPM SM activity,
and where neither utilisation nor SM activity exists the report says which is missing and why."""

from __future__ import annotations

import os

import pynvml
import pytest
import torch

import gpuwidget
from gpuwidget.sources.nvml import NvmlSource, list_devices
from gpuwidget.sources.nvml import devices as nvml_devices

from fakenvml import GIB, FakeNvml

# 256 samples in batches of 8, 40 ms of "compute" per step (32 steps, 1.3 s: past the evidence a cause
# needs, advice.evidence): a loop not waiting for data (a batch takes
# well under a millisecond, a few on a host whose cores are contended: far below the 10% that means starved).
LOADER_CELL = """%%gpuwatch --quiet --interval 0.02
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
train_loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 2)), batch_size=8)
for x, y in train_loader:
    time.sleep(0.04)
"""


@pytest.fixture(scope="module", autouse=True)
def loader_warmed_up() -> None:
    """A DataLoader's first batch in a process pays one-time costs (lazy imports, first collate) that would
    read as a starved loop in the first watched cell: paid here, outside any watch."""
    from torch.utils.data import DataLoader, TensorDataset

    for _ in DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 2)), batch_size=8):
        pass


def ticks(source: NvmlSource, fake: FakeNvml, count: int) -> list[dict[str, float]]:
    readings = []
    for _ in range(count):
        readings.append(source.read())
        fake.step()
    return readings


# -- the fake is as strict as the driver --------------------------------------------------------------


def test_the_fake_driver_refuses_utilisation_and_gpm_on_an_instance_handle_as_the_real_one_does(fake_nvml):
    fake = fake_nvml(FakeNvml.mig(hopper=True))
    pynvml.nvmlInit()
    try:
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
        for call in (lambda: pynvml.nvmlDeviceGetUtilizationRates(instance),
                     lambda: pynvml.nvmlDeviceGetUtilizationRates(parent),  # MIG mode: none device-wide either
                     lambda: pynvml.nvmlDeviceGetPowerUsage(instance),
                     lambda: pynvml.nvmlGpmSampleGet(instance, pynvml.nvmlGpmSampleAlloc())):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call()
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # through the parent, never the instance
            pynvml.nvmlGpmMigSampleGet(instance, 1, pynvml.nvmlGpmSampleAlloc())
    finally:
        pynvml.nvmlShutdown()
    assert fake.unfaked_calls == []


# -- the machine's view (the server) -------------------------------------------------------------------


def test_the_machine_view_lists_every_instance_after_its_gpu_with_its_instance_id_and_profile(fake_nvml):
    fake = fake_nvml(FakeNvml.mig(extra_gpus=1, hopper=True))
    source = NvmlSource(pids=lambda: (), every_device=True)
    try:
        listed = source.describe()
        first, second = fake.gpu(0).instances
        assert [d["uuid"] for d in listed] == [fake.gpu(0).uuid, first.uuid, second.uuid, fake.gpu(1).uuid]
        assert [(d["is_mig"], d["gpu_instance_id"], d["mig_profile"]) for d in listed] == [
            (False, None, None), (True, 1, "3g.40gb"), (True, 5, "2g.20gb"), (False, None, None)]
        assert listed[0]["mig_mode"] and not listed[3]["mig_mode"]
        assert all(d["driver_index"] == 0 for d in listed[:3]) and listed[3]["driver_index"] == 1
        fake.set(second.uuid, sm_active=12.0)
        reading = ticks(source, fake, 3)[-1]
        # Each instance: its own memory and its own SM activity; the GPU: its power and temperature.
        assert reading["gpu1.mem_total"] == 40 * GIB and reading["gpu2.mem_total"] == 20 * GIB
        assert reading["gpu2.sm_active"] == 12.0 and "gpu2.util" not in reading
        assert reading["gpu0.power"] == 250.0 and "gpu0.util" not in reading
        assert reading["gpu3.util"] == 87.0
        assert source.errors == []
    finally:
        source.close()


def test_a_cuda_process_still_sees_one_instance(fake_nvml):
    fake = fake_nvml(FakeNvml.mig(extra_gpus=1, hopper=True))
    source = NvmlSource()
    try:
        assert [d["uuid"] for d in source.describe()] == [fake.gpu(0).instances[0].uuid]
    finally:
        source.close()
    assert [d.gpu_instance_id for d in list_devices() if d.is_mig] == [1, 5]


def test_torchs_device_uuid_names_the_instance_this_process_uses(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.mig(hopper=True))
    second = fake.gpu(0).instances[1]
    # CUDA_VISIBLE_DEVICES unset: CUDA's own pick is what torch reports (its uuid without "MIG-").
    monkeypatch.setattr(nvml_devices, "_torch_uuids", lambda: [second.uuid[len("MIG-"):]])
    source = NvmlSource()
    try:
        (device,) = source.describe()
        assert device["uuid"] == second.uuid and source.cuda_order == "torch"
        assert ticks(source, fake, 2)[-1]["gpu0.mem_total"] == 20 * GIB
    finally:
        source.close()


# -- the instance a watched cell uses ------------------------------------------------------------------


def _hopper_instance_in_use(sm_active: float) -> tuple[FakeNvml, str]:
    """This process on the H100's second MIG instance (2g.20gb, 2 GiB used), named in CUDA_VISIBLE_DEVICES."""
    fake = FakeNvml.mig(hopper=True)
    instance = fake.gpu(0).instances[1]
    fake.set(instance.uuid, sm_active=sm_active, tensor_active=0.0)
    fake.processes(instance.uuid, compute=[(os.getpid(), 2 * GIB)])
    fake.cuda_visible_devices = instance.uuid
    fake.real_time = True
    return fake, instance.uuid


def test_mig_instance_is_judged_by_gpm_sm_activity_and_small_batch_fires(ip, fake_nvml):
    fake, uuid = _hopper_instance_in_use(sm_active=20.0)
    fake_nvml(fake)
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()
    summary = run.summary

    assert [gpu["uuid"] for gpu in run.machine["gpus"]] == [uuid]
    assert summary["gpu_busy_metric"] == "sm_active" and summary["gpu_busy_mean"] == pytest.approx(20.0)
    assert "gpu_kernel_running_mean" not in summary and "gpu_busy_missing" not in summary
    assert summary["peak_gpu_mem_fraction"] == pytest.approx(2 / 20)  # the instance's memory, not the GPU's
    assert summary["gpus_used"] == [0]
    small = next((f for f in run.findings if f.rule == "small-batch"), None)
    assert small is not None, ([f.rule for f in run.findings], summary.get("data_wait_fraction"),
                               summary.get("process_cpu_mean"))
    assert small.evidence["signal"] == "sm_active" and small.evidence["sm_active_percent"] == 20.0
    assert small.change == {"batch_size": 64}
    text = run._repr_mimebundle_()["text/plain"]
    assert "SM active 20%" in text and "kernel running" not in text


@pytest.mark.parametrize(("sm_active", "fires"), [(49.0, True), (51.0, False)])
def test_mig_instance_small_batch_edge_is_dcgms_half(ip, fake_nvml, sm_active, fires):
    fake, _ = _hopper_instance_in_use(sm_active=sm_active)
    fake_nvml(fake)
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()
    assert any(f.rule == "small-batch" for f in run.findings) is fires, (
        [f.rule for f in run.findings], run.summary.get("data_wait_fraction"), run.summary.get("process_cpu_mean"))


def test_mig_without_gpm_says_which_figure_is_missing(ip, fake_nvml):
    fake = FakeNvml.mig()  # an A100: no GPM, and NVML has no utilisation on MIG
    instance = fake.gpu(0).instances[0]
    fake.processes(instance.uuid, compute=[(os.getpid(), GIB)])
    fake.real_time = True
    fake_nvml(fake)
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()

    assert "gpu_busy_mean" not in run.summary
    missing = run.summary["gpu_busy_missing"]
    assert "GPU 0 (NVIDIA A100-SXM4-40GB MIG 3g.20gb) is a MIG instance" in missing
    assert "no utilisation (kernel running)" in missing and "GPM" in missing
    assert run.summary["peak_gpu_mem_fraction"] == pytest.approx(1 / 20)  # memory per instance is still there
    assert not any(f.rule in ("small-batch", "launch-bound", "gpu-unused") for f in run.findings)
    text = run._repr_mimebundle_()["text/plain"]
    assert "SM active not measured" in text
    assert f"Not measured how busy the GPU was: {missing}" in text
    assert "—" not in text
