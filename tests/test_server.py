"""The server extension's routes, in a real Jupyter server (pytest-jupyter), under a non-root base_url."""

from __future__ import annotations

import asyncio
import json
import os
import warnings

import pytest
from tornado.httpclient import HTTPClientError

from fakenvml import FakeNvml

pytestmark = pytest.mark.server


@pytest.fixture
def jp_server_config():
    return {
        # The strict setting: any route without an auth decorator is reported at registration.
        "ServerApp": {"jpserver_extensions": {"gpuwidget": True}, "allow_unauthenticated_access": False},
        "GpuWidget": {"interval": 0.05},
    }


@pytest.fixture
def monitor(jp_serverapp):
    monitor = jp_serverapp.web_app.settings["gpuwidget_monitor"]
    yield monitor
    monitor.close()


async def get_json(jp_fetch, *parts, **params):
    reply = await jp_fetch("gpuwidget", "api", *parts, params=params or None)
    assert reply.code == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    return json.loads(reply.body)


async def read_until(ws, kind: str, limit: int = 100, where=lambda message: True) -> dict:
    for _ in range(limit):
        message = json.loads(await asyncio.wait_for(ws.read_message(), 10))
        if message["type"] == kind and where(message):
            return message
    raise AssertionError(f"no {kind!r} message in {limit}")


async def test_without_a_gpu_devices_say_so_and_host_metrics_are_served(jp_fetch, monitor, jp_base_url):
    assert jp_base_url != "/"  # pytest-jupyter's default catches path bugs
    devices = await get_json(jp_fetch, "devices")
    assert devices["gpu_found"] is False and devices["devices"] == []
    assert devices["message"].startswith("no GPU found")
    assert devices["host"]["cpu_count"] >= 1 and devices["interval"] == 0.05
    snapshot = await get_json(jp_fetch, "snapshot")
    assert snapshot["latest"]["values"]["cpu.util"] >= 0
    assert "gpu0.util" not in snapshot["latest"]["values"]
    assert snapshot["processes"]["gpus"] == {}


@pytest.mark.parametrize("route", ["devices", "snapshot"])
async def test_routes_refuse_unauthenticated_requests(jp_fetch, monitor, route):
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("gpuwidget", "api", route, headers={"Authorization": ""})
    assert caught.value.code == 403


async def test_a_cross_origin_request_with_the_login_cookie_is_refused(jp_fetch, monitor, jp_http_port):
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("gpuwidget", "api", "devices",
                       headers={"Authorization": "", "Origin": "http://attacker.example",
                                "Cookie": "username-127-0-0-1=forged"})
    assert caught.value.code == 403


async def test_registering_the_routes_emits_no_auth_warning(jp_serverapp):
    from jupyter_server.utils import JupyterServerAuthWarning  # type: ignore[attr-defined]

    from gpuwidget.server import _load_jupyter_server_extension

    with warnings.catch_warnings():
        warnings.simplefilter("error", JupyterServerAuthWarning)
        _load_jupyter_server_extension(jp_serverapp)
    jp_serverapp.web_app.settings["gpuwidget_monitor"].close()


async def test_eight_gpus_stream_hello_history_then_samples(jp_ws_fetch, jp_fetch, fake_nvml, monitor):
    fake = FakeNvml.gpus(8)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()  # forget sources built before the fake was installed
    devices = await get_json(jp_fetch, "devices")
    assert [d["id"] for d in devices["devices"]] == [f"gpu{i}" for i in range(8)]
    ws = await jp_ws_fetch("gpuwidget", "api", "stream", params={"interval": "0.05"})
    try:
        hello = json.loads(await ws.read_message())
        assert hello["type"] == "hello" and len(hello["devices"]["devices"]) == 8
        history = json.loads(await ws.read_message())
        assert history["type"] == "history"
        first = await read_until(ws, "sample")
        second = await read_until(ws, "sample")
        assert second["t"] > first["t"]
        assert {f"gpu{i}.util" for i in range(8)} <= set(second["values"])
        assert monitor.running and monitor.subscribers == 1
    finally:
        ws.close()
    for _ in range(50):  # the last subscriber leaving stops the sampler
        if not monitor.running:
            break
        await asyncio.sleep(0.05)
    assert not monitor.running and monitor.subscribers == 0


async def test_a_slower_subscriber_gets_every_nth_sample(jp_ws_fetch, monitor):
    ws = await jp_ws_fetch("gpuwidget", "api", "stream", params={"interval": "0.2"})
    try:
        await read_until(ws, "sample")
        times = [(await read_until(ws, "sample"))["t"] for _ in range(3)]
    finally:
        ws.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.15


async def test_bad_stream_interval_is_refused(jp_ws_fetch, monitor):
    with pytest.raises(HTTPClientError) as caught:
        await jp_ws_fetch("gpuwidget", "api", "stream", params={"interval": "fast"})
    assert caught.value.code == 400


async def test_lost_gpu_leaves_the_others_streaming(jp_ws_fetch, fake_nvml, monitor):
    fake = FakeNvml.gpus(2)
    fake.real_time = True
    fake.lose_gpu(1, at_tick=3)
    fake_nvml(fake)
    monitor.close()
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        for _ in range(12):
            sample = await read_until(ws, "sample")
    finally:
        ws.close()
    assert "gpu0.util" in sample["values"] and "gpu1.util" not in sample["values"]


def test_each_gpu_is_read_through_a_source_of_its_own_and_a_lost_one_leaves_the_others(fake_nvml):
    from gpuwidget.server.monitor import Monitor

    fake = fake_nvml(FakeNvml.gpus(3).lose_gpu(0, at_tick=2))
    monitor = Monitor(interval=0.05)
    try:
        devices = monitor.devices()
        # One source each: the sampler's watchdog can then drop a GPU that hangs, alone.
        assert len(monitor._sources.gpus.sources) == 3
        assert [device["id"] for device in devices["devices"]] == ["gpu0", "gpu1", "gpu2"]
        assert all(device["foreign_pid_namespace"] is False for device in devices["devices"])
        monitor.read_once()
        assert {"gpu0.util", "gpu1.util", "gpu2.util"} <= set(monitor.latest()["values"])
        fake.step(2)
        monitor.read_once()
        values = monitor.latest()["values"]
        assert "gpu1.util" in values and "gpu2.util" in values and "gpu0.util" not in values
    finally:
        monitor.close()
    assert fake.inits == 0  # every source's NVML handle was shut down


async def test_processes_are_mapped_to_kernels_and_other_users_stay_anonymous(
        jp_ws_fetch, jp_fetch, jp_serverapp, fake_nvml, monitor):
    reply = await jp_fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": "experiments/train.ipynb", "type": "notebook", "kernel": {"name": "python3"}}))
    kernel_id = json.loads(reply.body)["kernel"]["id"]
    kernel_pid = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.pid
    stranger = os.getppid() if os.getppid() != kernel_pid else 1
    fake = FakeNvml.gpus(1)
    fake.real_time = True
    fake.processes(0, compute=[(kernel_pid, 2 * 2**30), (stranger, 2**30)])
    fake_nvml(fake)
    monitor.close()
    from gpuwidget.server import _kernel_pids

    await monitor.refresh_kernels(lambda: _kernel_pids(jp_serverapp), jp_serverapp.session_manager.list_sessions)
    real_user = monitor._user
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        listed = await read_until(ws, "processes", where=lambda message: "gpu0" in message["gpus"])
        rows = {row["pid"]: row for row in listed["gpus"]["gpu0"]}
        assert rows[kernel_pid]["kernel_id"] == kernel_id
        assert rows[kernel_pid]["notebook"] == "experiments/train.ipynb"
        assert rows[kernel_pid]["memory"] == 2 * 2**30 and rows[kernel_pid]["user"] == "you"
        # Seen as another user, a process shows its memory and nothing else.
        monitor._user = "somebody-else"
        row = monitor._describe_process(kernel_pid, 123)
        assert row == {"pid": kernel_pid, "memory": 123, "user": "another user", "name": None,
                       "kernel_id": None, "notebook": None}
    finally:
        monitor._user = real_user
        ws.close()
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_bokehjs_is_served_only_in_the_installed_version(jp_fetch, monitor):
    import bokeh

    reply = await jp_fetch("gpuwidget", "static", f"bokeh-{bokeh.__version__}.min.js")
    assert reply.headers["Content-Type"].startswith("application/javascript")
    assert b"Bokeh" in reply.body[:5000] or len(reply.body) > 500_000
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("gpuwidget", "static", "bokeh-0.0.1.min.js")
    assert caught.value.code == 404
