"""gpuwidget's series on the Jupyter server's own /metrics, in a real server (pytest-jupyter) with a fake NVML."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPClientError

from gpuwidget.kernelstatus import StatusWriter, read_status, status_path
from gpuwidget.server.metrics import GPU_LABELS

from fakenvml import GIB, FakeNvml

# Real-time stream margins and keep-alives: alone, in make test's serial pass (tests/conftest.py).
pytestmark = [pytest.mark.server, pytest.mark.serial]

HOST = "gpu-node-7"


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


def samples(text: str) -> dict[str, list]:
    """metric sample name -> [(labels, value)]"""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


async def scrape(jp_fetch, **kwargs) -> dict[str, list]:
    reply = await jp_fetch("metrics", **kwargs)
    assert reply.code == 200
    return samples(reply.body.decode())


async def scrape_until_up(jp_fetch, timeout: float = 20) -> dict[str, list]:
    """The first scrape starts the sampler (off the loop); later ones carry its figures."""
    deadline = time.monotonic() + timeout
    while True:
        found = await scrape(jp_fetch)
        if found["gpuwidget_sampler_up"][0][1] == 1 and "gpuwidget_gpu_utilization_ratio" in found:
            return found
        assert time.monotonic() < deadline, "the sampler never came up for /metrics"
        await asyncio.sleep(0.1)


def eight_gpus() -> FakeNvml:
    fake = FakeNvml.gpus(8, util=87, memory_used=20 * GIB, power_mw=250_000, temperature=61)
    fake.gpu(7).util = 0  # an idle one
    fake.real_time = True
    return fake


async def test_eight_gpus_are_exported_with_dcgm_label_names_and_units(jp_fetch, fake_nvml, monitor):
    fake = fake_nvml(eight_gpus())
    monitor.close()  # forget sources built before the fake was installed
    found = await scrape_until_up(jp_fetch)
    util = {labels["gpu"]: (labels, value) for labels, value in found["gpuwidget_gpu_utilization_ratio"]}
    assert sorted(util) == [str(i) for i in range(8)]
    labels, value = util["3"]
    assert set(labels) == set(GPU_LABELS)
    assert labels["UUID"] == fake.gpu(3).uuid and labels["modelName"] == "NVIDIA H100 80GB HBM3"
    assert labels["Hostname"] == HOST
    assert value == pytest.approx(0.87)
    assert util["7"][1] == 0.0
    for name, expected in [("gpuwidget_gpu_memory_used_bytes", 20 * GIB),
                           ("gpuwidget_gpu_memory_total_bytes", 80 * GIB), ("gpuwidget_gpu_power_watts", 250.0),
                           ("gpuwidget_gpu_temperature_celsius", 61.0), ("gpuwidget_gpu_power_limit_watts", 700.0)]:
        assert len(found[name]) == 8, name
        assert found[name][0][1] == pytest.approx(expected), name
    assert found["gpuwidget_gpu_energy_joules_total"][0][1] > 0
    assert 0 <= found["gpuwidget_host_cpu_utilization_ratio"][0][1] <= 1
    assert found["gpuwidget_host_memory_total_bytes"][0][1] > 0
    assert not [name for name in found if name.startswith("DCGM_FI")]
    assert all(name.startswith("gpuwidget_") for name in found if "gpu" in name and not name.startswith("http"))


async def test_a_scrape_keeps_the_sampler_running_and_it_stops_after_the_keepalive(jp_fetch, fake_nvml, monitor):
    fake_nvml(eight_gpus())
    monitor.close()
    assert not monitor.running
    first = await scrape(jp_fetch)
    assert first["gpuwidget_sampler_up"][0][1] == 0  # no sample yet: nothing current to report
    assert "gpuwidget_gpu_utilization_ratio" not in first
    await scrape_until_up(jp_fetch)
    assert monitor.running and monitor.subscribers == 1
    deadline = time.monotonic() + 10
    while monitor.running:  # keep-alive 1.5 s, then the monitor's own 1 s grace
        assert time.monotonic() < deadline, "a scrape kept the sampler running forever"
        await asyncio.sleep(0.2)
    assert monitor.subscribers == 0
    monitor.trace.start_wall -= 60  # the newest sample now a minute old: not current, not exported
    stale = await scrape(jp_fetch)
    assert stale["gpuwidget_sampler_up"][0][1] == 0 and "gpuwidget_gpu_utilization_ratio" not in stale


async def test_an_unauthenticated_scrape_is_refused_unless_the_server_allows_it(jp_fetch, jp_serverapp, monitor):
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("metrics", headers={"Authorization": ""})
    assert refused.value.code == 403
    jp_serverapp.web_app.settings["authenticate_prometheus"] = False
    open_scrape = await scrape(jp_fetch, headers={"Authorization": ""})
    assert "gpuwidget_sampler_up" in open_scrape


async def test_kernels_report_gpu_memory_and_their_watched_cell_notebook_only_when_authenticated(
        jp_fetch, jp_serverapp, fake_nvml, monitor):
    reply = await jp_fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": "experiments/train.ipynb", "type": "notebook", "kernel": {"name": "python3"}}))
    kernel_id = json.loads(reply.body)["kernel"]["id"]
    manager = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    kernel_pid = manager.provisioner.pid
    fake = eight_gpus()
    fake.processes(2, compute=[(kernel_pid, 3 * GIB)])
    fake_nvml(fake)
    monitor.close()
    from gpuwidget.server import _kernel_pids

    await scrape(jp_fetch)  # starts the sampler and its kernel table refresh
    await monitor.refresh_kernels(lambda: _kernel_pids(jp_serverapp), jp_serverapp.session_manager.list_sessions)
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        # A real watched cell in the kernel: a loader that makes the loop wait for data, for ~4 s.
        code = (
            "%load_ext gpuwidget\n"
            "import time, torch\n"
            "from torch.utils.data import DataLoader, Dataset\n"
            "class Slow(Dataset):\n"
            "    def __len__(self): return 1000\n"
            "    def __getitem__(self, i): time.sleep(0.004); return torch.zeros(4)\n"
            "loader = DataLoader(Slow(), batch_size=4)\n"
        )
        outcome = await client.execute_interactive(code, timeout=120)
        assert outcome["content"]["status"] == "ok"
        cell = asyncio.ensure_future(client.execute_interactive(
            "%%gpuwatch --quiet --interval 0.05\nfor x in loader:\n    pass\n", timeout=120))
        # While it runs: its figures so far, every WRITE_EVERY_S.
        while True:
            found = await scrape(jp_fetch)
            running = found.get("gpuwidget_kernel_watch_info", [({}, 0)])[0][0].get("state") == "running"
            if running and found.get("gpuwidget_kernel_steps", [({}, 0)])[0][1] > 0:
                break
            assert not cell.done(), f"the cell ended before /metrics saw it running: {sorted(found)}"
            await asyncio.sleep(0.2)
        assert 0 < found["gpuwidget_kernel_steps"][0][1] < 250
        assert found["gpuwidget_kernel_watch_info"][0][0]["cause"] == ""  # not known before the end
        assert 0.5 < found["gpuwidget_kernel_data_wait_ratio"][0][1] <= 1
        assert (await cell)["content"]["status"] == "ok"
        asked = await client.execute_interactive("import gpuwidget", timeout=60, user_expressions={
            "run": "[gpuwidget.last_run().findings[0].rule, gpuwidget.last_run().summary['steps']]"})
        cause, steps = eval(asked["content"]["user_expressions"]["run"]["data"]["text/plain"])
    finally:
        client.stop_channels()
    deadline = time.monotonic() + 20
    while True:
        found = await scrape(jp_fetch)
        info = found.get("gpuwidget_kernel_watch_info", [({}, 0)])[0][0]
        if "gpuwidget_kernel_gpu_memory_used_bytes" in found and info.get("state") == "finished":
            break
        assert time.monotonic() < deadline, f"no finished watch in {found}"
        await asyncio.sleep(0.2)
    (labels, memory), = found["gpuwidget_kernel_gpu_memory_used_bytes"]
    assert memory == 3 * GIB and labels["gpu"] == "2" and labels["UUID"] == fake.gpu(2).uuid
    assert labels["kernel_id"] == kernel_id and labels["notebook"] == "experiments/train.ipynb"
    (info, one), = found["gpuwidget_kernel_watch_info"]
    assert one == 1 and info["state"] == "finished" and info["notebook"] == "experiments/train.ipynb"
    assert info["cause"] == cause and cause in ("io-bound", "dataloader-starved")  # the kernel's own main finding
    assert found["gpuwidget_kernel_steps"][0][1] == steps == 250
    assert 0.5 < found["gpuwidget_kernel_data_wait_ratio"][0][1] <= 1
    assert found["gpuwidget_kernel_samples_per_second"][0][1] > 0
    status_file = status_path(jp_serverapp.kernel_manager.connection_dir, kernel_pid)
    assert stat.S_IMODE(os.stat(status_file).st_mode) == 0o600
    # Anyone may scrape when authentication is off: then no notebook path is told.
    jp_serverapp.web_app.settings["authenticate_prometheus"] = False
    open_scrape = await scrape(jp_fetch, headers={"Authorization": ""})
    assert {labels["notebook"] for labels, _ in open_scrape["gpuwidget_kernel_gpu_memory_used_bytes"]} == {""}
    assert {labels["notebook"] for labels, _ in open_scrape["gpuwidget_kernel_watch_info"]} == {""}
    assert open_scrape["gpuwidget_kernel_watch_info"][0][0]["kernel_id"] == kernel_id
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")
    assert not os.path.exists(status_file)  # the kernel removed it as it shut down


def test_a_running_watch_publishes_its_progress_and_a_stale_file_is_ignored(tmp_path):
    totals = [(0, 0, 0.0, 0.0)]
    writer = StatusWriter(str(tmp_path), label="epoch 1", progress=lambda: totals[-1])
    writer.started()
    path = status_path(str(tmp_path), os.getpid())
    assert read_status(path)["state"] == "running" and read_status(path)["steps"] is None
    totals.append((40, 640, 3.0, 4.0))
    writer.on_tick()
    status = read_status(path)
    assert status["steps"] == 40 and status["samples_per_s"] == 160 and status["data_wait_fraction"] == 0.75
    totals.append((80, 1280, 6.0, 8.0))
    writer.on_tick()  # within WRITE_EVERY_S of the last write: not rewritten
    assert read_status(path)["steps"] == 40
    writer.finished({"steps": 100, "samples_per_s": 150.0, "data_wait_fraction": 0.7}, None)
    status = read_status(path)
    assert status["state"] == "finished" and status["cause"] == "none" and status["label"] == "epoch 1"
    # Written before this process started (a reused pid's leftover): not ours.
    assert read_status(path, not_before=time.time() + 60) is None
    path_big = tmp_path / "big.json"
    path_big.write_text(json.dumps({"version": 1, "state": "running", "label": "x" * 10_000}))
    assert read_status(str(path_big)) is None


async def test_loading_the_extension_twice_in_one_process_keeps_one_collector(jp_serverapp, monitor):
    from gpuwidget.server import _load_jupyter_server_extension

    _load_jupyter_server_extension(jp_serverapp)
    text = generate_latest(REGISTRY).decode()
    assert text.count("# TYPE gpuwidget_sampler_up gauge") == 1


async def test_without_prometheus_configured_the_cluster_route_says_so_and_asks_nobody(jp_fetch, jp_serverapp, monitor):
    devices = json.loads((await jp_fetch("gpuwidget", "api", "devices")).body)
    assert devices["cluster"] is False
    reply = json.loads((await jp_fetch("gpuwidget", "api", "cluster", params={"window_s": "3600"})).body)
    assert reply["configured"] is False and reply["hosts"] == [] and reply["error"] is None
    asked = []

    async def fetch(request):
        asked.append(request)
        raise AssertionError("no request may be made")

    from gpuwidget.server.cluster import Cluster

    assert (await Cluster(None, fetch=fetch).reply(3600))["configured"] is False
    assert asked == [] and jp_serverapp.web_app.settings["gpuwidget_cluster"].queries_sent == 0
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("gpuwidget", "api", "cluster", params={"window_s": "-5"})
    assert refused.value.code == 400


async def test_every_mig_instance_is_listed_with_gi_labels_in_prometheus(jp_fetch, fake_nvml, monitor):
    fake = FakeNvml.mig(extra_gpus=1, hopper=True)
    first, second = fake.gpu(0).instances
    fake.set(first.uuid, sm_active=35.0).set(second.uuid, sm_active=8.0)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()
    found = await scrape_until_up(jp_fetch)
    deadline = time.monotonic() + 20
    while len(found.get("gpuwidget_gpu_sm_active_ratio", [])) < 4:  # GPM's first pair: two samples 100 ms apart
        assert time.monotonic() < deadline, "no SM activity exported"
        await asyncio.sleep(0.1)
        found = await scrape(jp_fetch)

    # dcgm-exporter's labels: an instance is its GPU's index, UUID and model, with GPU_I_ID and GPU_I_PROFILE.
    sm = {(labels["gpu"], labels["GPU_I_ID"]): (labels, value)
          for labels, value in found["gpuwidget_gpu_sm_active_ratio"]}
    assert sorted(sm) == [("0", ""), ("0", "1"), ("0", "5"), ("1", "")]
    labels, value = sm[("0", "5")]
    assert labels["GPU_I_PROFILE"] == "2g.20gb" and labels["UUID"] == fake.gpu(0).uuid
    assert labels["modelName"] == "NVIDIA H100 80GB HBM3" and value == pytest.approx(0.08)
    assert sm[("0", "1")][0]["GPU_I_PROFILE"] == "3g.40gb" and sm[("0", "1")][1] == pytest.approx(0.35)
    assert sm[("1", "")][0]["GPU_I_PROFILE"] == "" and sm[("1", "")][0]["UUID"] == fake.gpu(1).uuid
    memory = {(labels["gpu"], labels["GPU_I_ID"]): value
              for labels, value in found["gpuwidget_gpu_memory_total_bytes"]}
    assert memory == {("0", ""): 80 * GIB, ("0", "1"): 40 * GIB, ("0", "5"): 20 * GIB, ("1", ""): 80 * GIB}
    # "Kernel running" (NVML utilisation) exists on the whole GPU without MIG only, as on a real driver.
    assert [labels["gpu"] for labels, _ in found["gpuwidget_gpu_utilization_ratio"]] == ["1"]
    text = (await jp_fetch("metrics")).body.decode()
    assert "# HELP gpuwidget_gpu_utilization_ratio Kernel running: share of time any kernel ran" in text
    assert "# HELP gpuwidget_gpu_sm_active_ratio SM active: share of the SMs busy" in text

    devices = json.loads((await jp_fetch("gpuwidget", "api", "devices")).body)["devices"]
    assert [(d["driver_index"], d["is_mig"], d["gpu_instance_id"], d["mig_profile"]) for d in devices] == [
        (0, False, None, None), (0, True, 1, "3g.40gb"), (0, True, 5, "2g.20gb"), (1, False, None, None)]
    assert all(d["gpm"] for d in devices)


def test_the_cluster_view_keeps_each_mig_instance_apart_though_they_share_their_gpus_uuid():
    from gpuwidget.server.cluster import SOURCES, _gather

    def series(metric: str, value: float, instance: str = "", kernel: str = "") -> dict:
        labels = {"__name__": metric, "gpu": "0", "UUID": "GPU-a", "modelName": "NVIDIA H100 80GB HBM3",
                  "Hostname": "node-a", **({"GPU_I_ID": instance, "GPU_I_PROFILE": "2g.20gb"} if instance else {}),
                  **({"kernel_id": kernel, "notebook": f"{kernel}.ipynb"} if kernel else {})}
        return {"metric": labels, "values": [[1000.0, str(value)]]}

    found = {"memory_used": [series("m", 30 * GIB), series("m", 2 * GIB, "5"), series("m", 9 * GIB, "1")],
             "holder": [series("h", 2 * GIB, "5", kernel="small"), series("h", 9 * GIB, "1", kernel="big")]}
    results = {(source, query.key): (query, found.get(query.key, []) if source == "gpuwidget" else [])
               for source, queries in SOURCES for query in queries}
    gpus = _gather(results, 1000.0, 15.0, 1)
    by_gpu = {entry["gpu"]: entry for entry in gpus.values()}
    assert sorted(by_gpu) == ["0", "0/GI1", "0/GI5"]
    assert by_gpu["0/GI5"]["memory_used_bytes"] == [2 * GIB] and by_gpu["0/GI5"]["holder"] == "small.ipynb"
    assert by_gpu["0/GI1"]["holder"] == "big.ipynb" and by_gpu["0"]["memory_used_bytes"] == [30 * GIB]
    assert all(entry["uuid"] == "GPU-a" for entry in gpus.values())
