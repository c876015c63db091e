"""An AMD machine, unchanged above the seam: the server's /devices and stream (the sidebar's data),
Prometheus with AMD device-metrics-exporter's label names, a watched cell's panel and a rule firing,
and one hung MI300X leaving the others live, all on the fake amdsmi (no AMD GPU was at hand)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from test_prometheus_metrics import samples, scrape
from test_server import get_json, read_until

import gpuwidget

from fakeamdsmi import GIB, FakeAmdSmi
from fakenvml import FakeNvml

pytestmark = pytest.mark.server

HOST = "mi300-node-3"


@pytest.fixture
def jp_server_config():
    return {
        "ServerApp": {"jpserver_extensions": {"gpuwidget": True}, "allow_unauthenticated_access": False},
        "GpuWidget": {"interval": 0.05, "metrics_hostname": HOST, "metrics_keepalive_s": 1.5},
    }


@pytest.fixture
def monitor(jp_serverapp):
    monitor = jp_serverapp.web_app.settings["gpuwidget_monitor"]
    yield monitor
    from gpuwidget.server.metrics import unregister

    unregister()
    monitor.close()


@pytest.fixture
def mi300x_node(fake_nvml, fake_amdsmi, monitor) -> FakeAmdSmi:
    """Eight MI300X, the fourth idle, no NVIDIA driver; the monitor forgets sources built before."""
    fake_nvml(FakeNvml.library_missing())
    fake = FakeAmdSmi.mi300x(8, gfx_activity=90, vram_used_mib=48 * 1024, current_socket_power=620)
    fake.set(3, gfx_activity=0, vram_used_mib=0, current_socket_power=140)
    fake.real_time = True
    fake_amdsmi(fake)
    monitor.close()
    return fake


async def test_the_sidebars_devices_and_stream_describe_the_amd_gpus(jp_fetch, jp_ws_fetch, mi300x_node):
    devices = await get_json(jp_fetch, "devices")
    assert devices["gpu_found"] is True and devices["message"] is None
    listed = devices["devices"]
    assert [d["id"] for d in listed] == [f"gpu{i}" for i in range(8)]
    assert {d["vendor"] for d in listed} == {"amd"} and {d["name"] for d in listed} == {"AMD Instinct MI300X"}
    assert listed[0]["memory_total"] == 196_592 * 2**20 and listed[0]["power_limit"] == 750.0
    assert listed[0]["compute_partition"] == "SPX" and listed[0]["serial"] == "692251001120"
    assert listed[0]["gpm"] is False  # amdsmi has no CU activity: the busy figure is the GFX activity

    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        hello = await read_until(ws, "hello")
        assert [d["id"] for d in hello["devices"]["devices"]] == [d["id"] for d in listed]
        sample = await read_until(ws, "sample", 200, lambda message: "gpu7.util" in message["values"])
        values = sample["values"]
        assert values["gpu0.util"] == 90.0 and values["gpu3.util"] == 0.0
        assert values["gpu0.mem_used"] == 48 * GIB and values["gpu0.power"] == 620.0
        assert values["gpu0.temperature"] == 55.0 and sample["stalled"] == []
    finally:
        ws.close()


async def test_prometheus_labels_amd_gpus_as_amds_exporter_does(jp_fetch, mi300x_node):
    deadline = time.monotonic() + 20
    found = await scrape(jp_fetch)
    while len(found.get("gpuwidget_gpu_utilization_ratio", [])) < 8:
        assert time.monotonic() < deadline, "the sampler never came up for /metrics"
        await asyncio.sleep(0.1)
        found = await scrape(jp_fetch)
    util = {labels["gpu_id"]: (labels, value) for labels, value in found["gpuwidget_gpu_utilization_ratio"]}
    labels, value = util["0"]
    assert set(labels) == {"gpu_id", "serial_number", "card_model", "hostname", "gpu_partition_id",
                           "gpu_compute_partition_type"}
    assert labels == {"gpu_id": "0", "serial_number": "692251001120", "card_model": "AMD Instinct MI300X",
                      "hostname": HOST, "gpu_partition_id": "0", "gpu_compute_partition_type": "spx"}
    assert value == pytest.approx(0.9) and util["3"][1] == 0.0
    power = {labels["gpu_id"]: value for labels, value in found["gpuwidget_gpu_power_watts"]}
    assert power["0"] == 620.0 and power["3"] == 140.0
    energy = {labels["gpu_id"]: value for labels, value in found["gpuwidget_gpu_energy_joules_total"]}
    assert len(energy) == 8 and all(value > 0 for value in energy.values())
    assert "gpuwidget_gpu_sm_active_ratio" not in found  # absent, not 0: amdsmi does not measure it
    assert all("UUID" not in labels for labels, _ in found["gpuwidget_gpu_memory_used_bytes"])


async def test_one_hung_mi300x_leaves_the_others_and_their_series_live(jp_fetch, jp_ws_fetch, mi300x_node,
                                                                      monitor, monkeypatch):
    import sys

    from gpuwidget import sampler

    monkeypatch.setattr(sampler, "SOURCE_DEADLINE_S", 0.3)
    monkeypatch.setattr(sampler, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(sampler, "WATCHDOG_LATE_S", 0.1)
    module, lost, released = sys.modules["amdsmi"], mi300x_node.gpu(5), threading.Event()
    usage, asked = module.amdsmi_get_gpu_vram_usage, []

    def vram_usage(handle: Any) -> Any:  # GPU 5 falls off the bus: its fourth VRAM query never returns
        if handle.gpu is lost:
            asked.append(1)
            if len(asked) > 3:
                released.wait(30)
        return usage(handle)

    monkeypatch.setattr(module, "amdsmi_get_gpu_vram_usage", vram_usage)
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        first = await read_until(ws, "sample", 400, lambda message: message["stalled"])
        assert [entry["source"] for entry in first["stalled"]] == ["GPU 5"]
        later = await read_until(ws, "sample", 100, lambda message: message["t"] >= first["t"] + 0.3)
        assert all(later["values"].get(f"gpu{i}.util") is not None for i in range(8) if i != 5)
        assert "gpu5.util" not in later["values"]
        found = samples((await jp_fetch("metrics")).body.decode())
        exported = {labels["gpu_id"] for labels, _ in found["gpuwidget_gpu_utilization_ratio"]}
        assert exported == {str(i) for i in range(8) if i != 5}
    finally:
        ws.close()
        released.set()


LOADER_CELL = """%%gpuwatch --quiet --interval 0.02
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
train_loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 2)), batch_size=8)
for x, y in train_loader:
    time.sleep(0.04)
"""


@pytest.fixture(scope="module")
def loader_warmed_up() -> None:
    """A DataLoader's first batch pays one-time costs that would read as a starved loop: paid here."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    for _ in DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 2)), batch_size=8):
        pass


@pytest.mark.parametrize(("busy", "fires"), [(30, True), (70, False)])
def test_small_batch_fires_on_a_fake_mi300x_from_its_gfx_activity(ip, fake_nvml, fake_amdsmi, loader_warmed_up,
                                                                   busy, fires):
    fake_nvml(FakeNvml.library_missing())
    fake = FakeAmdSmi.mi300x(gfx_activity=busy, vram_used_mib=8 * 1024, processes=[(os.getpid(), 8 * GIB)])
    fake.real_time = True
    fake_amdsmi(fake)
    assert ip.run_cell(LOADER_CELL).success
    run = gpuwidget.last_run()

    assert [gpu["name"] for gpu in run.machine["gpus"]] == ["AMD Instinct MI300X"]
    assert run.machine["gpus"][0]["vendor"] == "amd" and run.machine["gpu_message"] is None
    assert run.summary["gpu_busy_metric"] == "kernel_running" and run.summary["gpu_busy_mean"] == pytest.approx(busy)
    assert run.summary["gpus_used"] == [0] and run.summary["process_gpu_mem_source"] == "driver"
    assert run.summary["energy_j"] > 0
    small = next((f for f in run.findings if f.rule == "small-batch"), None)
    assert (small is not None) is fires, ([f.rule for f in run.findings], run.summary.get("data_wait_fraction"))
    text = run._repr_mimebundle_()["text/plain"]
    assert "AMD Instinct MI300X" in text
    if small is not None:
        assert small.change == {"batch_size": 128} and small.evidence["signal"] == "kernel_running"
        assert small.title in text
