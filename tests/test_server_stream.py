"""The stream survives slow, dead and churning browsers (a real Jupyter server, loopback clients)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time

import numpy as np
import pytest
from stream_clients import OPCODE_CLOSE, OPCODE_PING, RawClient, close_reason, fill_history
from test_server import get_json, read_until
from tornado.httpclient import HTTPClientError

from fakenvml import FakeNvml

# Real-time stream margins and keep-alives: alone, in make test's serial pass (tests/conftest.py).
pytestmark = [pytest.mark.server, pytest.mark.serial]

# Stream sockets here are pinged every 200 ms (Jupyter's setting is in milliseconds).
PING_MS = 200


@pytest.fixture
def ping_ms() -> int:
    return PING_MS


@pytest.fixture
def interval_s() -> float:
    return 0.05


@pytest.fixture
def jp_server_config(ping_ms, interval_s):
    return {
        "ServerApp": {"jpserver_extensions": {"gpuwidget": True}, "allow_unauthenticated_access": False,
                      "tornado_settings": {"ws_ping_interval": ping_ms}},
        "GpuWidget": {"interval": interval_s},
    }


@pytest.fixture
def monitor(jp_serverapp):
    monitor = jp_serverapp.web_app.settings["gpuwidget_monitor"]
    yield monitor
    monitor.close()


@pytest.fixture
def connect_raw(http_server, jp_http_port, jp_base_url, jp_auth_header):
    """Connect a :class:`RawClient` (``http_server`` starts the server jp_fetch would start)."""
    clients: list[RawClient] = []

    async def connect(receive_buffer: int | None = None, query: str = "") -> RawClient:
        client = await RawClient.connect(jp_http_port, f"{jp_base_url}gpuwidget/api/stream{query}",
                                         jp_auth_header, receive_buffer)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        client.abort()


async def wait_until(condition, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(step)
    return condition()


def outboxes(monitor) -> list:
    """The live subscribers' outboxes (each subscriber's send is its handler's bound ``_send``)."""
    return [subscriber.send.__self__._outbox for subscriber in list(monitor._subscribers.values())]


# ------------------------------------------------------------------------------------------ pings


async def test_a_browser_that_stops_answering_pings_is_closed_and_unsubscribed(connect_raw, monitor):
    client = await connect_raw()
    assert await wait_until(lambda: monitor.subscribers == 1, 10)
    started = time.monotonic()
    pings = 0
    opcode = payload = None
    while time.monotonic() < started + 5:  # read everything, answer nothing: its network went away
        opcode, payload = await asyncio.wait_for(client.frame(), 10)
        pings += opcode == OPCODE_PING
        if opcode == OPCODE_CLOSE:
            break
    closed_after = time.monotonic() - started
    assert opcode == OPCODE_CLOSE, f"still open after {closed_after:.1f} s"
    assert pings >= 1
    assert close_reason(payload)[1] == "ping timed out"
    # A ping 0.2 s in, 0.2 s for its pong: closed within a second, not tornado's 30000 "seconds".
    assert closed_after < 2.0
    assert await wait_until(lambda: monitor.subscribers == 0, 2.0)


async def test_a_browser_that_answers_pings_stays_subscribed(jp_ws_fetch, monitor):
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        first = await read_until(ws, "sample")
        deadline = time.monotonic() + 8 * PING_MS / 1000
        while time.monotonic() < deadline:  # eight pings, each answered while tornado's client reads
            last = await read_until(ws, "sample")
        assert last["t"] > first["t"] + 1.0 and monitor.subscribers == 1
    finally:
        ws.close()


@pytest.mark.parametrize("ping_ms", [30_000])
async def test_the_ping_interval_is_given_to_tornado_in_seconds_and_capped(jp_serverapp, ping_ms):
    from gpuwidget.server.handlers import STREAM_PING_MAX_MS, StreamHandler

    handler = StreamHandler.__new__(StreamHandler)
    handler.application = jp_serverapp.web_app
    # Jupyter's default 30000 (ms) as tornado would have read it: 8 h 20 min between pings.
    assert handler.ping_interval == STREAM_PING_MAX_MS / 1000 == 15.0
    assert 0 < handler.ping_timeout <= handler.ping_interval


# ------------------------------------------------------------------------------ slow consumers


# No pings: the backlog alone must let the client go. Samples at 100 Hz fill the kernel's ~3 MB of
# socket buffers in seconds.
@pytest.mark.parametrize(("ping_ms", "interval_s"), [(0, 0.01)])
async def test_a_client_that_stops_reading_has_samples_dropped_then_is_closed(
        connect_raw, fake_nvml, monitor, monkeypatch, caplog):
    from gpuwidget.server import outbox

    monkeypatch.setattr(outbox, "STALLED_CLOSE_S", 1.0)
    fake = FakeNvml.gpus(8)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()
    fill_history(monitor)  # then 100 samples a second of 8 GPUs: more than the kernel's socket buffers hold
    await connect_raw(receive_buffer=4096)  # never reads
    assert await wait_until(lambda: monitor.subscribers == 1, 10)
    [box] = outboxes(monitor)
    most_unsent = 0

    def dropping() -> bool:
        nonlocal most_unsent
        most_unsent = max(most_unsent, box.unsent)
        return box.dropped > 0

    with caplog.at_level(logging.INFO, logger="gpuwidget"):
        # ~5 s here: the history (~0.14 MB) fills little of the kernel's buffers, 100 samples a second
        # the rest; a loaded machine samples slower, hence the margin.
        assert await wait_until(dropping, 40, step=0.01), "the kernel's buffers never filled"
        assert await wait_until(lambda: monitor.subscribers == 0, 5.0)
    assert most_unsent <= outbox.MAX_UNSENT
    assert box.closed and "too far behind" in caplog.text


# --------------------------------------------------------------------------------------- churn


@pytest.mark.parametrize("ping_ms", [30_000])  # the tabs share the server's loop: a late pong is not the point here
async def test_fifty_reconnecting_tabs_share_history_built_off_the_event_loop(
        jp_ws_fetch, fake_nvml, monitor, monkeypatch):
    fake = FakeNvml.gpus(8)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()
    assert fill_history(monitor) > 8 * 8  # every GPU's columns
    loop_thread = threading.current_thread()
    build_threads: list[threading.Thread] = []
    build = monitor._build_history

    def counted():
        build_threads.append(threading.current_thread())
        return build()

    monkeypatch.setattr(monitor, "_build_history", counted)
    lags: list[float] = []

    async def probe() -> None:  # the event loop's lateness for a 10 ms sleep
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - started - 0.01)

    async def tab() -> int:
        ws = await jp_ws_fetch("gpuwidget", "api", "stream")
        try:
            assert (await ws.read_message()).startswith('{"type":"hello"')
            history = await ws.read_message()
            assert history.startswith('{"type":"history"')
            return len(history)
        finally:
            ws.close()

    lag_probe = asyncio.ensure_future(probe())
    ticks = monitor.trace.version
    try:
        sizes = [size for _ in range(2) for size in await asyncio.gather(*(tab() for _ in range(50)))]
    finally:
        lag_probe.cancel()
    rows_meanwhile = monitor.trace.version - ticks
    assert min(sizes) > 50_000  # an hour of 8 GPUs, as the sidebar draws it
    assert loop_thread not in build_threads
    assert len(build_threads) <= rows_meanwhile + 2  # one build per row at most, not one per tab
    # Unshared and on the loop this was 100 builds of ~60 ms: 6 s of stall (the margin is for a loaded machine).
    assert max(lags) < 2.0, f"event loop stalled {max(lags):.2f} s"


async def test_clients_vanishing_mid_history_leave_no_unretrieved_task_errors(
        connect_raw, fake_nvml, monitor):
    fake = FakeNvml.gpus(8)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()
    fill_history(monitor)
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        clients = [await connect_raw(receive_buffer=4096) for _ in range(10)]
        await wait_until(lambda: monitor.subscribers == 10, 10)
        for client in clients:
            client.abort()  # the history (~0.14 MB, the 4 kB receive buffers hold less) is still being written to each
        assert await wait_until(lambda: monitor.subscribers == 0, 10)
        await asyncio.sleep(0.2)
        gc.collect()
        await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(previous)
    assert not [message for message in reported if "never retrieved" in message]


# ----------------------------------------------------------------------------- bad requests, once


@pytest.mark.parametrize("interval", ["inf", "-inf", "nan", "-1", "0", "1e300", "3601"])
async def test_a_stream_interval_that_is_not_a_usable_number_of_seconds_is_refused(
        jp_ws_fetch, monitor, interval):
    with pytest.raises(HTTPClientError) as caught:
        await jp_ws_fetch("gpuwidget", "api", "stream", params={"interval": interval})
    assert caught.value.code == 400
    assert monitor.subscribers == 0


@pytest.mark.parametrize("window", ["nan", "inf", "-5"])
async def test_a_snapshot_window_that_is_not_a_number_of_seconds_is_refused(jp_fetch, monitor, window):
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("gpuwidget", "api", "snapshot", params={"window": window})
    assert caught.value.code == 400


async def test_sixteen_concurrent_first_requests_open_the_gpus_once(jp_fetch, fake_nvml, monitor):
    fake = FakeNvml.gpus(2)
    real_init = fake.nvmlInitWithFlags

    def slow_init(flags: int) -> None:  # a driver slow to start: the requests overlap inside it
        time.sleep(0.2)
        real_init(flags)

    fake.nvmlInitWithFlags = slow_init  # type: ignore[method-assign]
    fake_nvml(fake)
    monitor.close()  # forget sources built before the fake was installed
    fake.reset_counts()
    replies = await asyncio.gather(*(get_json(jp_fetch, "devices") for _ in range(16)))
    assert all(len(reply["devices"]) == 2 for reply in replies)
    # One set of sources: the GPUs listed once, then a source per GPU (an init each, one to find them).
    assert fake.count("nvmlDeviceGetCount") == 1
    assert fake.count("nvmlInitWithFlags") + fake.count("nvmlInit") == 1 + 2
    monitor.close()
    assert fake.inits == 0  # nothing leaked: every init was shut down


def test_the_snapshot_history_keeps_four_significant_digits_and_nulls_for_gaps():
    from gpuwidget.server.monitor import Monitor
    from gpuwidget.trace import Trace

    monitor = Monitor(interval=1.0, history_s=100.0)
    trace = Trace(start_clock=0.0, start_wall=1000.0)
    trace.append(1.0, {"gpu0.mem_used": 81_234_567_890.0, "gpu0.util": 37.298767, "gpu0.sm_clock": 1.41e9})
    trace.append(2.0, {"gpu0.util": 12.0})
    trace.now = lambda: 3.0  # type: ignore[method-assign]
    monitor.trace = trace
    history = monitor.history()
    assert history["t"] == [1001.0, 1002.0]
    assert history["columns"]["gpu0.mem_used"] == [81_230_000_000.0, None]  # a missing reading is null
    assert history["columns"]["gpu0.util"] == [37.3, 12.0]
    assert history["columns"]["gpu0.sm_clock"] == [1.41e9, None]  # the snapshot has every column
    # The stream's history: the sidebar's columns only, 3 digits, large numbers as digits and an exponent.
    text = monitor.history_text()
    assert '"gpu0.mem_used":[812e8,null]' in text and '"gpu0.util":[37.3,12.0]' in text
    stream = json.loads(text)
    assert stream["t"] == [1001.0, 1002.0] and set(stream["columns"]) == {"gpu0.mem_used", "gpu0.util"}
    assert stream["columns"]["gpu0.mem_used"] == [81_200_000_000.0, None]


# One GPU's columns as the NVML source writes them (8 fake GPUs write 17 each); the sidebar draws six.
GPU_COLUMNS = ("util", "mem_used", "mem_total", "mem_util", "power", "power_limit", "temperature", "sm_clock",
               "sm_clock_max", "energy_j", "pcie_tx", "pcie_rx", "pcie_gen", "pcie_width", "slowdown")
DRAWN = ("util", "mem_used", "power", "temperature", "pcie_tx", "pcie_rx")


def hour_of_eight_gpus(spike_at: int, dip_at: int):
    """A Trace of an hour at 1 s for 8 GPUs and the host, with a one-sample spike of gpu3.util to 100 %
    at row ``spike_at`` and a one-sample dip of gpu5.mem_used to 0 at row ``dip_at``."""
    from gpuwidget.trace import Trace

    rng = np.random.default_rng(1)
    trace = Trace(start_clock=0.0, start_wall=1_800_000_000.0)
    for i in range(3600):
        row = {f"gpu{g}.{name}": float(rng.uniform(0.4, 0.6) * scale) for g in range(8)
               for name, scale in zip(GPU_COLUMNS, (100, 8e10, 1.4e11, 100, 700, 700, 80, 2e9, 2e9, 1e6 + i,
                                                    2.5e10, 2.5e10, 5, 16, 1))}
        row.update({"cpu.util": float(rng.uniform(5, 15)), "mem.used": 3.2e10 + i * 1e6, "mem.total": 1.37e11})
        if i == spike_at:
            row["gpu3.util"] = 100.0
        if i == dip_at:
            row["gpu5.mem_used"] = 0.0
        trace.append(float(i), row)
    trace.now = lambda: 3599.5  # type: ignore[method-assign]
    return trace


def test_the_stream_history_of_8_gpus_over_an_hour_is_small_and_draws_the_same_chart():
    from gpuwidget.server.monitor import STREAM_HISTORY_POINTS, STREAM_HISTORY_RAW_ROWS, Monitor

    monitor = Monitor(interval=1.0, history_s=3600.0)
    monitor.trace = trace = hour_of_eight_gpus(spike_at=1234, dip_at=2345)
    everything = json.dumps(monitor.history())  # the snapshot's shape, every column: what the stream sent before
    text = monitor.history_text()
    history = json.loads(text)
    assert len(text) < 250_000 and len(text) < len(everything) / 10, (len(text), len(everything))  # 0.22 MB, 2.6 MB
    # What the sidebar draws, for every GPU and the host; nothing it does not.
    assert set(history["columns"]) == {f"gpu{g}.{name}" for g in range(8) for name in DRAWN} | {"cpu.util", "mem.used"}
    t = history["t"]
    assert all(len(column) == len(t) for column in history["columns"].values())
    assert len(t) <= STREAM_HISTORY_POINTS and all(a < b for a, b in zip(t, t[1:]))
    rows = trace.window()
    wall = np.round(trace.start_wall + rows.t, 3)
    assert t[0] == wall[0] and t[-1] == wall[-1]  # the whole hour, up to the newest row itself
    # The newest rows as sampled (the live samples continue them), to 3 significant digits of each column.
    assert t[-STREAM_HISTORY_RAW_ROWS:] == wall[-STREAM_HISTORY_RAW_ROWS:].tolist()
    for name in ("gpu0.util", "gpu7.mem_used", "cpu.util"):
        tail = np.asarray(history["columns"][name][-STREAM_HISTORY_RAW_ROWS:])
        assert np.allclose(tail, rows[name][-STREAM_HISTORY_RAW_ROWS:], rtol=0,
                           atol=np.nanmax(rows[name]) * 0.006)
    # A one-sample spike and a one-sample dip an hour's chart would show keep their height, near their time.
    util = np.asarray(history["columns"]["gpu3.util"])
    assert util.max() == 100.0 and abs(t[int(util.argmax())] - wall[1234]) < 3600 / (STREAM_HISTORY_POINTS / 2)
    memory = np.asarray(history["columns"]["gpu5.mem_used"])
    assert memory.min() == 0.0 and abs(t[int(memory.argmin())] - wall[2345]) < 3600 / (STREAM_HISTORY_POINTS / 2)
    # Each bucket's extremes: the reduced line spans what every column did.
    for name in ("gpu1.power", "gpu6.temperature", "mem.used"):
        column, raw = np.asarray(history["columns"][name]), rows[name]
        assert column.max() == pytest.approx(raw.max(), rel=0.005)
        assert column.min() == pytest.approx(raw.min(), rel=0.005)


async def test_a_tab_gets_the_hour_of_8_gpus_as_the_sidebar_draws_it_then_every_new_row_once(
        jp_ws_fetch, fake_nvml, monitor):
    from gpuwidget.server.monitor import STREAM_HISTORY_RAW_ROWS

    fake = FakeNvml.gpus(8)
    fake.real_time = True
    fake_nvml(fake)
    monitor.close()
    fill_history(monitor)  # an hour at 1 s; the sampler goes on at 20 rows a second
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        assert json.loads(await ws.read_message())["type"] == "hello"
        text = await ws.read_message()
        samples: list[float] = []
        while len(samples) < 5:
            message = json.loads(await asyncio.wait_for(ws.read_message(), 10))
            if message["type"] == "sample":
                samples.append(message["t"])
    finally:
        ws.close()
    history = json.loads(text)
    assert history["type"] == "history" and len(text) < 200_000  # every column of the same hour: 2.2 MB
    # What the sidebar draws (the fake GPUs' PCIe rates appear only once the live sampler read twice).
    assert {f"gpu{g}.{name}" for g in range(8) for name in ("util", "mem_used", "power", "temperature")} | \
        {"cpu.util", "mem.used"} <= set(history["columns"])
    assert {name.split(".", 1)[1] for name in history["columns"]} <= {*DRAWN, "util", "used"}
    assert history["t"][0] < time.time() - 3500  # the whole hour
    # Its newest minute as sampled, then every live row once, in order.
    times = history["t"][-STREAM_HISTORY_RAW_ROWS:] + samples
    rows = [round(monitor.trace.start_wall + t, 3) for t in monitor.trace.window().t]
    assert times == [t for t in rows if times[0] <= t <= times[-1]]


def test_the_stream_history_names_the_columns_the_sidebar_draws():
    """The server's list of drawn metrics is the TypeScript client's (labextension/src/protocol.ts)."""
    import re
    from pathlib import Path

    from gpuwidget.server.monitor import STREAM_HISTORY_METRICS

    source = (Path(__file__).parents[1] / "labextension" / "src" / "protocol.ts").read_text()
    listed = re.search(r"HISTORY_METRICS[^=]*=\s*\[([^\]]*)\]", source)
    assert listed is not None
    assert tuple(re.findall(r"'([^']+)'", listed.group(1))) == STREAM_HISTORY_METRICS


async def test_a_tab_reconnecting_within_a_second_finds_the_sampler_still_running(jp_ws_fetch, monitor):
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    await read_until(ws, "sample")
    sampler = monitor._sampler
    ws.close()
    assert await wait_until(lambda: monitor.subscribers == 0, 5)
    await asyncio.sleep(0.3)  # the sidebar's first retry comes after 0.4-0.6 s
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        await read_until(ws, "sample")
        assert monitor._sampler is sampler and monitor.running
    finally:
        ws.close()
    assert await wait_until(lambda: not monitor.running, 5)  # and it still stops once nobody is back


# ------------------------------------------------------------------------------- stalled sources


async def test_a_gpu_that_stops_answering_goes_stale_with_its_last_values_and_the_others_go_on(
        jp_ws_fetch, jp_fetch, fake_nvml, monitor, monkeypatch):
    from gpuwidget import sampler

    monkeypatch.setattr(sampler, "SOURCE_DEADLINE_S", 0.3)
    monkeypatch.setattr(sampler, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(sampler, "WATCHDOG_LATE_S", 0.1)
    fake = FakeNvml.gpus(3)
    fake.real_time = True
    fake.set(1, util=64, memory_used=35 * 2**30)
    lost, query, released, hang = fake.gpu(1), fake.nvmlDeviceGetMemoryInfo, threading.Event(), threading.Event()

    def memory_info(gpu, *args):  # GPU 1 falls off the bus once the test says so
        if gpu is lost and hang.is_set():
            released.wait(30)
        return query(gpu, *args)

    # On the fake itself, not on pynvml: the fake's uninstall then takes it away with the rest.
    fake.nvmlDeviceGetMemoryInfo = memory_info  # type: ignore[method-assign]
    fake_nvml(fake)
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        hello = await read_until(ws, "hello")
        assert hello["stalled"] == [] and hello["stale"] == {}
        before = await read_until(ws, "sample", 100, lambda message: "gpu1.mem_used" in message["values"])
        assert before["stale"] == {}
        hang.set()
        first = await read_until(ws, "sample", 400, lambda message: message["stalled"])
        [stalled] = first["stalled"]
        assert stalled["source"] == "GPU 1" and stalled["devices"] == ["gpu1"] and stalled["since_s"] >= 0
        assert stalled["at"] == pytest.approx(first["t"] - stalled["since_s"], abs=0.15)
        # Only GPU 1 is stale: its last values, when they were read, and how old they are.
        assert set(first["stale"]) == {"gpu1"}
        stale = first["stale"]["gpu1"]
        assert stale["source"] == "GPU 1" and stale["hung"] is True
        assert stale["values"]["gpu1.util"] == 64.0 and stale["values"]["gpu1.mem_used"] == 35 * 2**30
        assert before["t"] <= stale["t"] <= stalled["at"] + 0.15
        assert stale["age_s"] == pytest.approx(first["t"] - stale["t"], abs=0.15)
        assert not any(name.startswith("gpu1.") for name in first["values"])
        # The other GPUs and the host go on, sample after sample; GPU 1's values only age.
        later = await read_until(ws, "sample", 100, lambda message: message["t"] >= first["t"] + 0.5)
        assert {"cpu.util", "gpu0.util", "gpu0.mem_used", "gpu2.util", "gpu2.mem_used"} <= set(later["values"])
        assert not any(name.startswith("gpu1.") for name in later["values"])
        assert later["stale"]["gpu1"]["t"] == stale["t"]
        assert later["stale"]["gpu1"]["age_s"] >= stale["age_s"] + 0.4
        assert later["stalled"][0]["since_s"] > stalled["since_s"]
        # A tab opened now is told at once, as is a snapshot; the history keeps every GPU.
        other = await jp_ws_fetch("gpuwidget", "api", "stream")
        try:
            told = await read_until(other, "hello")
            assert [entry["source"] for entry in told["stalled"]] == ["GPU 1"]
            assert told["stale"]["gpu1"]["values"] == stale["values"]
            history = await read_until(other, "history")
            assert {"gpu0.util", "gpu1.util", "gpu2.util"} <= set(history["columns"])
            assert history["columns"]["gpu1.util"][-1] is None and history["columns"]["gpu0.util"][-1] is not None
        finally:
            other.close()
        snapshot = await get_json(jp_fetch, "snapshot")
        assert snapshot["stalled"][0]["source"] == "GPU 1" and snapshot["stalled"][0]["at"] == stalled["at"]
        assert snapshot["stale"]["gpu1"]["t"] == stale["t"] and "gpu0.util" in snapshot["latest"]["values"]
    finally:
        ws.close()
    # A later sampler never asks the stuck source again (it would hang a thread per restart).
    assert await wait_until(lambda: not monitor.running, 5)
    await get_json(jp_fetch, "snapshot")
    ws = await jp_ws_fetch("gpuwidget", "api", "stream")
    try:
        restarted = await read_until(ws, "sample")
        assert restarted["stalled"][0]["source"] == "GPU 1" and set(restarted["stale"]) == {"gpu1"}
        await read_until(ws, "sample", 100, lambda message: message["t"] >= restarted["t"] + 0.5)
        gpu_sources = monitor._sources.gpus.sources
        assert monitor._sampler.sources == [monitor._sources.host, gpu_sources[0], gpu_sources[2]]
        assert not monitor._sampler.stats.stalled
    finally:
        ws.close()
        released.set()
    # The hung source is closed on a thread of its own once its read returns: let that happen now,
    # not during a later test (its NVML shutdown would end that test's fake driver).
    [hung] = monitor._hung
    monitor.close()
    assert await wait_until(lambda: hung.closed and not hung._lock.locked(), 10)


class _Gpus:
    """One source for several GPUs, whose read hangs once told to (after naming ``busy_with`` or not)."""

    name = "gpus"

    def __init__(self, indexes: list[int], names_the_gpu: bool) -> None:
        self.indexes, self.names_the_gpu = indexes, names_the_gpu
        self.errors: list = []
        self.busy_with: str | None = None
        self.hang, self.released = threading.Event(), threading.Event()
        self.closed = False

    def describe(self) -> list[dict]:
        return [{"id": f"gpu{i}", "index": i, "name": "H100"} for i in self.indexes]

    def read(self) -> dict[str, float]:
        values = {}
        for index in self.indexes:
            self.busy_with = f"GPU {index}" if self.names_the_gpu else None
            if index == 1 and self.hang.is_set():
                self.released.wait(30)
            values[f"gpu{index}.util"] = 10.0 * index
        self.busy_with = None
        return values

    def processes(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("names_the_gpu", [True, False])
def test_one_source_for_several_gpus_takes_them_all_stale_and_marks_the_one_it_names_as_hung(
        monkeypatch, names_the_gpu):
    from gpuwidget import sampler
    from gpuwidget.server.monitor import Monitor, MonitorSources
    from gpuwidget.sources.gpu import GpuSources
    from gpuwidget.sources.host import HostSource

    monkeypatch.setattr(sampler, "SOURCE_DEADLINE_S", 0.3)
    monkeypatch.setattr(sampler, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(sampler, "WATCHDOG_LATE_S", 0.1)
    gpus = _Gpus([0, 1, 2], names_the_gpu)
    monitor = Monitor(interval=0.05, sources=lambda: MonitorSources(
        HostSource(per_core=False, process=False), GpuSources([gpus])))  # type: ignore[list-item]
    sent: list[dict] = []
    try:
        assert [device["id"] for device in monitor.devices()["devices"]] == ["gpu0", "gpu1", "gpu2"]
        token = monitor.subscribe(lambda text: sent.append(json.loads(text)))
        deadline = time.monotonic() + 10
        while not any(message.get("values", {}).get("gpu2.util") == 20.0 for message in sent):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gpus.hang.set()
        while not any(message.get("stale") for message in sent):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        monitor.unsubscribe(token)
    finally:
        gpus.released.set()
        monitor.close()
    stale = next(message for message in sent if message.get("stale"))
    label = "GPU 1" if names_the_gpu else "gpus"
    assert stale["stalled"][0]["source"] == label
    assert stale["stalled"][0]["devices"] == ["gpu0", "gpu1", "gpu2"]
    # The GPU it named stopped answering; the others stopped with it (their last values kept).
    assert {device: entry["hung"] for device, entry in stale["stale"].items()} == {
        "gpu0": not names_the_gpu, "gpu1": True, "gpu2": not names_the_gpu}
    assert {device: entry["values"] for device, entry in stale["stale"].items()} == {
        "gpu0": {"gpu0.util": 0.0}, "gpu1": {"gpu1.util": 10.0}, "gpu2": {"gpu2.util": 20.0}}


@pytest.mark.parametrize("interval_s", [0.2])
async def test_a_tab_served_a_reused_history_gets_every_row_once_from_it_its_catch_up_and_live(
        jp_ws_fetch, monitor, monkeypatch):
    builds = []
    build = monitor._build_history
    monkeypatch.setattr(monitor, "_build_history", lambda: builds.append(1) or build())
    first = await jp_ws_fetch("gpuwidget", "api", "stream")  # keeps the sampler running
    try:
        await read_until(first, "sample")
        seen = []
        for _ in range(4):  # each tab comes a few rows after the last one's history was built
            ws = await jp_ws_fetch("gpuwidget", "api", "stream")
            try:
                history = await read_until(ws, "history")
                times = list(history["t"])
                while len(times) < len(history["t"]) + 3:
                    message = json.loads(await asyncio.wait_for(ws.read_message(), 10))
                    if message["type"] == "sample":
                        times.append(message["t"])
                seen.append(times)
            finally:
                ws.close()
    finally:
        first.close()
    rows = [round(monitor.trace.start_wall + t, 3) for t in monitor.trace.window().t]
    for times in seen:
        assert times == sorted(set(times)), "a row came twice or out of order"
        assert times == [t for t in rows if times[0] <= t <= times[-1]], "a row is missing"
    # Most tabs got the history already built, followed by the rows since (a fresh build each misses nothing).
    assert len(builds) <= 2, f"{len(builds)} builds for {len(seen) + 1} tabs"
