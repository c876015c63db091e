"""The server's one shared sampler: read the GPUs and the host once, serialise once, fan out.

A :class:`Monitor` runs a :class:`gpuwidget.sampler.Sampler` (the GPU drivers and psutil on its own
thread, never on the event loop) while at least one subscriber is connected. After each
tick the new row is turned into one JSON text and handed to the event loop, which writes
that same text to every subscriber whose rate wants this tick. Every few seconds the
processes holding GPU memory are listed (on the sampler thread) and matched to this
server's kernels and notebooks (whose pids and paths the event loop keeps up to date).

A new subscriber's history is what the sidebar draws, no more: the columns of its charts
(:data:`STREAM_HISTORY_METRICS`), at most :data:`STREAM_HISTORY_POINTS` points per column (each
bucket's minimum and maximum, so a one-sample spike keeps its height; the newest
:data:`STREAM_HISTORY_RAW_ROWS` rows as sampled) and 3 significant digits, written short
(``258e8``): an hour of 8 GPUs is ~0.1 MB instead of ~2.9 MB of every column. It is built in a
worker thread and the same bytes go to every subscriber: fifty reconnecting tabs cost one
build, not fifty on the loop. A history a few rows old is served again, followed by the
sample messages of the rows since (kept as sent to everyone): rebuilding it every tick
took more of the server's CPU per connection than everything else gpuwidget does for one.

Each GPU is a source of its own (:func:`gpuwidget.sources.gpu.open_gpu_sources`). A source whose
read stops returning (a GPU falling off the bus) is dropped by the sampler's watchdog, the other
GPUs go on being read, and the hung one stays dropped for the life of the server: later samplers, snapshots and process
tables never ask it again, and it is closed on a thread of its own. The sidebar learns which
one from ``stalled`` in the hello and in every sample (and the snapshot):
``[{"source": "GPU 1", "since_s": 12.4, "at": <unix s>, "devices": ["gpu1"]}]``, ``since_s`` counted
to the message's time, and which devices' readings stopped with it from ``stale``: each one's last
values and their age (``{"gpu1": {"source": "GPU 1", "hung": true, "t": <unix s>, "age_s": 14.4,
"values": {...}}}``).
The GPUs are read through one source each, so only the hung GPU stops (the others miss the
watchdog's few seconds); ``"hung": true`` marks it. A source that reads several GPUs takes all of them
with it: the one it names (``busy_with``, or every one when it names none) is the hung one, the
others are stale with ``"hung": false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import psutil

from gpuwidget import heap
from gpuwidget.sampler import Sampler
from gpuwidget.server.protocol import (
    DeviceInfo,
    DevicesReply,
    History,
    Latest,
    ProcessesMessage,
    ProcessInfo,
    Reading,
    StaleDevices,
    StalledSource,
)
from gpuwidget.sources.base import Source
from gpuwidget.sources.gpu import NO_GPU, GpuDescription, GpuSource, GpuSources, open_gpu_sources
from gpuwidget.sources.host import HostSource
from gpuwidget.sources.lineage import ancestors
from gpuwidget.sources.pids import foreign_pid_namespace
from gpuwidget.trace import Trace, finite_list, finite_or_none

log = logging.getLogger("gpuwidget")

# The snapshot's history (every column) is reduced to at most this many points (spikes kept).
HISTORY_POINTS = 2000
# Significant digits kept in the history (relative to each column's largest value): a plot
# 300 px high resolves 3; 4 keep the text a half of full precision's (1.6 MB, not 2.9, for
# 8 GPUs over an hour) and its encoding a third of the time.
HISTORY_DIGITS = 4
# The stream's history (docs/server-api.md): the columns the sidebar's charts draw (GPU metrics by
# suffix, host metrics by name; labextension/src/protocol.ts HISTORY_METRICS says the same), at most
# this many points per column (a chart ~350 px wide gets a minimum and a maximum per pixel) of
# which the newest rows are as sampled, and this many significant digits (a chart is 64 px high).
STREAM_HISTORY_METRICS = ("util", "sm_active", "mem_used", "power", "temperature", "pcie_tx", "pcie_rx", "cpu.util",
                          "mem.used")
STREAM_HISTORY_POINTS = 800
STREAM_HISTORY_RAW_ROWS = 60
STREAM_HISTORY_DIGITS = 3
# How often the process table is rebuilt (it costs a few driver calls and psutil lookups).
PROCESSES_EVERY_S = 5.0
# Parents walked up from a GPU process to find the kernel it belongs to (workers, shells).
PARENT_DEPTH = 8
ANOTHER_USER = "another user"
# In a container the driver lists host pids, which this PID namespace cannot resolve: nobody's, as far as we can tell.
HOST_PID_USER = "unknown (host pid: this server runs in a container)"
# Seconds the sampler goes on after the last subscriber left: a tab that reconnects (the sidebar
# retries after 0.5 s) finds it running, with no restart of its threads and no gap in the data.
STOP_AFTER_IDLE_S = 1.0
# Seconds after the sampler stopped before freed memory is handed back: a closed socket's
# handler lives until its cancelled ping timer falls due (asyncio keeps the timer's context,
# which reaches the handler), at most the stream's 15 s ping interval later.
TRIM_AFTER_IDLE_S = 20.0
# A first snapshot reads twice this far apart: utilisation is a difference of counters.
FIRST_READING_GAP_S = 0.1
# A built history is served again while at most this many rows behind the trace and this young;
# the rows since follow it as the sample messages everyone already got. An hour of 8 GPUs takes
# ~60 ms of a thread to build (and competes with the loop for the GIL): once a second it was
# 0.7 ms of server CPU per connection under churn; with 5 rows of catch-up, a fifth of that.
HISTORY_CATCH_UP_ROWS = 5
HISTORY_REUSE_S = 10.0

# What /devices tells of each device (docs/server-api.md); a MIG instance carries its GPU instance id
# and profile (dcgm-exporter's GPU_I_ID, GPU_I_PROFILE), an AMD GPU its partitions and serial number
# (AMD's device-metrics-exporter labels), ``gpm`` says whether SM activity is read.
# ``foreign_pid_namespace``: this server runs in a PID namespace of its own (a container), where the
# driver lists no process of the host's: a GPU in use may show none (the sidebar says so).
DEVICE_KEYS = ("id", "index", "vendor", "driver_index", "uuid", "name", "memory_total", "power_limit", "is_mig",
               "parent_uuid", "pci_bus_id", "mig_mode", "gpu_instance_id", "mig_profile", "compute_partition",
               "memory_partition", "partition_id", "serial", "gpm", "foreign_pid_namespace")

Send = Callable[[str], None]


@dataclass
class MonitorSources:
    """The server's sources by role: the host always, one source per GPU (there may be none)."""

    host: HostSource
    gpus: GpuSources

    def all(self) -> list[Source]:
        return [self.host, *self.gpus.sources]


@dataclass(frozen=True)
class _Covered:
    """The devices a GPU source reads: their ids (``gpu3``, the metric prefix) and CUDA indexes."""

    ids: tuple[str, ...]
    indexes: tuple[int, ...]

    def named(self, label: str) -> str | None:
        """The device ``label`` (the sampler's "GPU 3", from ``busy_with``) names, if it is one of these."""
        return next((device for device, index in zip(self.ids, self.indexes, strict=True)
                     if label == f"GPU {index}"), None)


@dataclass(frozen=True)
class _Stale:
    """A device whose readings stopped: with which source (its label), whether it is the device that
    stopped answering (else it was read by the same source), and its last values (wall time)."""

    source: str
    hung: bool
    t: float | None
    values: dict[str, Reading]


@dataclass
class Subscriber:
    send: Send
    every: int = 1  # write every n-th tick
    sent: int = 0
    after_t: float = -math.inf  # its history reached this time: samples up to it are not sent again


@dataclass(frozen=True)
class _History:
    """A built history message: from which trace, up to which row and time, when built."""

    trace: Trace
    rows: int  # trace.rows_total when the build began
    last_t: float  # wall time of its newest point (-inf when empty)
    data: bytes
    built: float  # time.monotonic()


@dataclass
class KernelDirectory:
    """What the event loop knows about this server's kernels: pid -> (kernel id, notebook path)."""

    by_pid: dict[int, tuple[str, str | None]] = field(default_factory=dict)


def _encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _message(kind: str, **fields: Any) -> str:
    return _encode({"type": kind, **fields})


class Monitor:
    """One sampler for all subscribers of a Jupyter server."""

    def __init__(self, interval: float = 1.0, history_s: float = 3600.0,
                 sources: Callable[[], MonitorSources] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError("interval must be a positive number of seconds")
        self.interval = interval
        self.history_s = history_s
        self._make_sources = sources or default_sources
        self._loop = loop
        self._subscribers: dict[int, Subscriber] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        # Held while sources are built: sixteen concurrent first requests build one set (one driver start).
        self._sources_lock = threading.Lock()
        self._sampler: Sampler | None = None
        self._sources: MonitorSources | None = None
        self._devices: DevicesReply | None = None
        # The shared history message, the build under way, and the newest sample messages sent to
        # everyone as (row number, wall time, text): what a reused history is followed by.
        self._history: _History | None = None
        self._history_build: asyncio.Future[_History] | None = None
        self._recent_samples: deque[tuple[int, float, str]] = deque(maxlen=HISTORY_CATCH_UP_ROWS)
        self._hello: tuple[DevicesReply, str] | None = None
        # One thread builds histories, one at a time: a build peaks at ~25 MB of temporaries, and
        # builds spread over the loop's default executor left that much in each thread's malloc
        # arena (+70 MB of server RSS after 50 tabs reconnected for 3 s, not handed back).
        self._history_thread: ThreadPoolExecutor | None = None
        self.trace = Trace()
        self.kernels = KernelDirectory()
        self._processes_text = _message("processes", t=None, gpus={})
        self._last_processes = -math.inf
        self._user = _current_user()
        self.ticks = 0
        # Sources that stopped answering, kept across samplers: label -> wall time it stopped.
        self._stalled: dict[str, float] = {}
        self._hung: list[Source] = []
        # Devices whose readings stopped (by id), and each device's newest values (wall time, values).
        self._stale: dict[str, _Stale] = {}
        self._last_values: dict[str, tuple[float, dict[str, Reading]]] = {}
        # What each GPU source reads (by id(source)), known once the devices were described.
        self._covered: dict[int, _Covered] = {}

    # ------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._sampler is not None and self._sampler.running

    def _ensure_sources(self) -> MonitorSources:
        with self._sources_lock:
            if self._sources is None:
                self._sources = self._make_sources()
                self._devices = None
            return self._sources

    def start(self) -> None:
        with self._lock:
            if self.running:
                return
            self._sampler = Sampler(self._answering(), self.trace, self.interval, [self._on_tick])
            self._sampler.start()

    def stop(self, wait: bool = True) -> None:
        """Stop sampling; with ``wait=False`` the thread is joined elsewhere (never block the loop)."""
        with self._lock:
            sampler, self._sampler = self._sampler, None
        if sampler is None:
            return
        if wait:
            sampler.stop(final_tick=False)
            self._note_stalled(sampler)
        else:
            threading.Thread(target=self._stop_idle, args=(sampler,), daemon=True,
                             name="gpuwidget-monitor-stop").start()

    def _stop_idle(self, sampler: Sampler) -> None:
        """Off the loop, once the last subscriber left: stop sampling, and later hand freed memory back.

        Serving histories of megabytes to many sockets leaves the allocator's heaps fragmented:
        after 50 tabs reconnected 500 times, 25-50 MB of the server's RSS was free memory glibc
        kept (Python's own objects had grown by 1 MB). ``malloc_trim`` returns it, once the
        closed sockets are gone (see :data:`TRIM_AFTER_IDLE_S`) and if nobody came back.
        """
        sampler.stop(final_tick=False)
        self._note_stalled(sampler)
        time.sleep(TRIM_AFTER_IDLE_S)
        if not self._subscribers:
            heap.trim()

    def close(self) -> None:
        self.stop()
        if self._history_thread is not None:
            self._history_thread.shutdown(wait=False)
            self._history_thread = None
        with self._sources_lock:
            sources, self._sources = self._sources, None
        for source in sources.all() if sources is not None else []:
            if self._is_hung(source):  # its close would wait on the read that never returned
                threading.Thread(target=source.close, daemon=True, name="gpuwidget-monitor-close").start()
            else:
                source.close()
        # Sources opened after this start afresh: nothing of theirs has stopped answering.
        self._hung, self._stalled, self._stale, self._covered = [], {}, {}, {}
        self._last_values.clear()

    # ------------------------------------------------------------- sources that stopped answering

    def _answering(self) -> list[Source]:
        """The sources still worth reading: all of them but those that once hung."""
        return [source for source in self._ensure_sources().all() if not self._is_hung(source)]

    def _is_hung(self, source: Source) -> bool:
        return any(source is hung for hung in self._hung)

    def _note_stalled(self, sampler: Sampler) -> None:
        """Remember what ``sampler`` dropped (by label, with the wall time it stopped), and which devices'
        readings stopped with it; each tick and at its stop."""
        for entry in sampler.stats.stalled:
            self._stalled.setdefault(entry["source"], self.trace.start_wall + entry["at_s"])
        # The sampler drops a source and records its entry together: the two lists keep one order.
        for source, entry in zip(sampler.hung_sources, sampler.stats.stalled, strict=False):
            if not self._is_hung(source):
                self._hung.append(source)
                self._devices_stopped(source, entry["source"])

    def _devices_stopped(self, source: Source, label: str) -> None:
        """Mark stale the devices ``source`` read: the one its label names (or, naming none, every one)
        stopped answering; any others it read are no longer read either."""
        covered = self._covered.get(id(source))
        if covered is None:
            return  # never described: no device of it was shown
        named = covered.named(label)
        for device in covered.ids:
            if device not in self._stale:
                t, values = self._last_values.get(device, (None, {}))
                self._stale[device] = _Stale(label, named in (None, device), t, values)

    def stalled(self, at: float | None = None) -> list[StalledSource]:
        """Each source that stopped answering: its label, seconds since then (to ``at``, default now), when,
        and the devices whose readings stopped with it."""
        end = time.time() if at is None else at
        return [{"source": label, "since_s": round(max(0.0, end - since), 1), "at": round(since, 3),
                 "devices": [device for device, stale in self._stale.items() if stale.source == label]}
                for label, since in self._stalled.items()]

    def stale(self, at: float | None = None) -> StaleDevices:
        """Each device whose readings stopped: the source that stopped (its label), whether this device is
        the one that stopped answering, the wall time of its last values, their age (to ``at``, default
        now), and the values themselves."""
        end = time.time() if at is None else at
        return {device: {"source": stale.source, "hung": stale.hung,
                         "t": None if stale.t is None else round(stale.t, 3),
                         "age_s": None if stale.t is None else round(max(0.0, end - stale.t), 1),
                         "values": stale.values}
                for device, stale in self._stale.items()}

    # ------------------------------------------------------------- subscribers

    def subscribe(self, send: Send, interval: float | None = None, after_t: float = -math.inf) -> int:
        """Register a subscriber; the first one starts the sampler. Returns a token.

        ``interval`` is a finite number of seconds (the handler refuses others with 400);
        samples up to ``after_t`` (what its history reached) are not sent to it.
        """
        every = 1 if not interval else max(1, math.ceil(interval / self.interval - 1e-9))
        with contextlib.suppress(RuntimeError):  # fan-out happens on the loop the subscribers live on
            self._loop = asyncio.get_running_loop()
        with self._lock:
            token = self._next_id
            self._next_id += 1
            self._subscribers[token] = Subscriber(send, every, after_t=after_t)
        self.start()
        return token

    def unsubscribe(self, token: int) -> None:
        """Forget a subscriber; the last one leaving stops the sampler (off the event loop) soon after."""
        with self._lock:
            self._subscribers.pop(token, None)
            idle = not self._subscribers
        if not idle:
            return
        try:
            asyncio.get_running_loop().call_later(STOP_AFTER_IDLE_S, self._stop_if_idle)
        except RuntimeError:  # called off the loop: nothing to wait on
            self.stop(wait=False)

    def _stop_if_idle(self) -> None:
        if not self._subscribers:
            self.stop(wait=False)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    # ------------------------------------------------------------- data

    @property
    def known_devices(self) -> DevicesReply | None:
        """The /devices payload if :meth:`devices` has built it (then reading it costs nothing), else None."""
        return self._devices

    def devices(self) -> DevicesReply:
        """Static facts (the /devices payload). Blocking the first time (the drivers' start-up): call it in a thread."""
        sources = self._ensure_sources()
        with self._sources_lock:
            if self._devices is not None:
                return self._devices
            gpus = sources.gpus
            host_facts = sources.host.describe()
            self._devices = {
                "gpu_found": gpus.found,
                "message": None if gpus.found else gpus.message or NO_GPU,
                "devices": [
                    cast(DeviceInfo, {key: device.get(key) for key in DEVICE_KEYS})
                    # a hung GPU's device stays listed: the sidebar shows its last values, greyed
                    for source in gpus.sources for device in self._cover(source) if not device.get("lost")
                ],
                "host": {"cpu_count": host_facts.get("cpu_count"), "mem_total": host_facts.get("mem_total")},
                "interval": self.interval,
                "history_s": self.history_s,
            }
            return self._devices

    def _cover(self, source: GpuSource) -> list[GpuDescription]:
        """A GPU source's devices; what it reads is remembered for when it stops answering."""
        devices = [device for device in source.describe() if isinstance(device.get("id"), str)]
        self._covered[id(source)] = _Covered(tuple(device["id"] for device in devices),
                                             tuple(int(device.get("index") or 0) for device in devices))
        return devices

    def history(self, window_s: float | None = None) -> History:
        """The last ``window_s`` seconds (at most the history kept), reduced for plotting."""
        t, columns = self._history_frame(window_s)
        return {"t": t, "columns": {name: _for_plot(values) for name, values in columns.items()}}

    def _history_frame(self, window_s: float | None) -> tuple[list[float], dict[str, np.ndarray]]:
        """(wall-clock times, each column's values) of the last ``window_s`` seconds, reduced for plotting."""
        window = self.history_s if window_s is None else max(0.0, min(window_s, self.history_s))
        end = self.trace.now()
        frame = self.trace.plot_view(self.trace.columns, HISTORY_POINTS, t0=end - window) if self.trace.columns \
            else None
        if frame is None or not len(frame):
            return [], {}
        return np.round(self.trace.start_wall + frame.t, 3).tolist(), frame.mean

    def latest(self) -> Latest:
        last = self.trace.last()
        if last is None:
            return {"t": None, "values": {}}
        t, values = last
        # Rounded as the history's times are (np.round), so a row sent live and again in a history reads the same.
        return {"t": float(np.round(self.trace.start_wall + t, 3)),
                "values": {k: finite_or_none(v) for k, v in values.items()}}

    def hello_text(self) -> str:
        """The hello message; encoded once while no source has stalled (then it carries a clock)."""
        devices = self.devices()
        if self._stalled:
            now = time.time()
            return _message("hello", devices=devices, stalled=self.stalled(now), stale=self.stale(now))
        if self._hello is None or self._hello[0] is not devices:
            self._hello = (devices, _message("hello", devices=devices, stalled=[], stale={}))
        return self._hello[1]

    def history_text(self) -> str:
        """The history message, encoded one column at a time."""
        return self._history_text()[0]

    def _history_text(self) -> tuple[str, float]:
        """(the stream's history message, the wall time of its newest row), encoded one column at a time.

        json's C encoder holds the GIL for a whole call: one call over a large history would
        stop the event loop for its duration even from a worker thread; one call per column
        lets the loop in between.
        """
        t, values = self._stream_frame()
        columns = ",".join(f"{_encode(name)}:{_short_numbers(column)}" for name, column in values.items())
        return f'{{"type":"history","t":{_encode(t)},"columns":{{{columns}}}}}', (t[-1] if t else -math.inf)

    def _stream_frame(self) -> tuple[list[float], dict[str, np.ndarray]]:
        """The history the sidebar draws: its columns over :attr:`history_s`, the older rows reduced to
        buckets' minimum and maximum, the newest :data:`STREAM_HISTORY_RAW_ROWS` as sampled.

        The raw tail makes the history end at the newest row itself, so the samples after it
        (catch-up, then live) continue it without a row lost or repeated.
        """
        trace = self.trace
        names = [name for name in trace.columns if _in_stream_history(name)]
        if not names:
            return [], {}
        t0 = trace.now() - self.history_s
        frame = trace.window(t0, None, names)
        n = len(frame)
        if n <= STREAM_HISTORY_POINTS:
            t, columns = frame.t, frame.mean
        else:
            raw = STREAM_HISTORY_RAW_ROWS
            older = trace.plot_view(names, STREAM_HISTORY_POINTS - raw, t0=t0, t1=float(frame.t[n - raw - 1]))
            t = np.concatenate([older.t, frame.t[n - raw:]])
            columns = {name: np.concatenate([older.mean[name], frame.mean[name][n - raw:]]) for name in names}
        return np.round(trace.start_wall + t, 3).tolist(), columns

    async def history_messages(self) -> tuple[list[bytes | str], float]:
        """What a new subscriber gets before live samples: the history (UTF-8), then the sample
        messages of the rows it lacks; and the wall time they reach (later samples are live).

        The history is built off the event loop, shared by every subscriber, and served again
        while at most :data:`HISTORY_CATCH_UP_ROWS` rows behind (and :data:`HISTORY_REUSE_S` old).
        A subscriber that goes away while it waits does not cancel the build the others wait on.
        Nothing here awaits after the catch-up is chosen: the caller subscribes in the same step,
        so no row falls between the catch-up and the live samples.
        """
        history = self._history
        if history is None or not self._reusable(history):
            if self._history_build is None or self._history_build.done():
                if self._history_thread is None:
                    self._history_thread = ThreadPoolExecutor(1, thread_name_prefix="gpuwidget-history")
                self._history_build = asyncio.get_running_loop().run_in_executor(
                    self._history_thread, self._build_history)
            history = await asyncio.shield(self._history_build)
        catch_up = [(t, text) for _, t, text in self._recent_samples if t > history.last_t]
        return [history.data, *(text for _, text in catch_up)], max([history.last_t, *(t for t, _ in catch_up)])

    def _reusable(self, history: _History) -> bool:
        """Whether ``history`` plus the kept sample messages still give a new subscriber every row."""
        if history.trace is not self.trace:
            return False
        rows = self.trace.rows_total
        if rows == history.rows:
            return True
        kept = [row for row, _, _ in self._recent_samples]
        return (rows - history.rows <= HISTORY_CATCH_UP_ROWS and time.monotonic() - history.built <= HISTORY_REUSE_S
                and bool(kept) and kept[0] <= history.rows + 1)

    def _build_history(self) -> _History:
        """Worker thread: encode the history once; the loop serves it (with catch-up) for a few rows."""
        trace, rows, built = self.trace, self.trace.rows_total, time.monotonic()
        text, last_t = self._history_text()
        self._history = _History(trace, rows, last_t, text.encode(), built)
        return self._history

    def processes_text(self) -> str:
        return self._processes_text

    def processes(self) -> ProcessesMessage:
        return cast(ProcessesMessage, json.loads(self._processes_text))

    def read_once(self) -> None:
        """A synchronous reading (for a snapshot when no subscriber keeps the sampler running).

        Run in a worker thread. Rates need an interval, so a first reading is taken twice.
        """
        sampler = Sampler(self._answering(), self.trace, self.interval, [self._on_tick])
        if not len(self.trace):
            sampler.tick()
            time.sleep(FIRST_READING_GAP_S)
        sampler.tick()

    # ------------------------------------------------------------- sampler thread

    def _on_tick(self, trace: Trace) -> None:
        """Sampler-thread hook: serialise the new row once and pass it to the event loop."""
        self.ticks += 1
        sampler = self._sampler
        if sampler is not None:
            self._note_stalled(sampler)
        latest = self.latest()
        self._remember(latest["t"], latest["values"])
        text = _message("sample", t=latest["t"], values=latest["values"], stalled=self.stalled(latest["t"]),
                        stale=self.stale(latest["t"]))
        row = (trace.rows_total, -math.inf if latest["t"] is None else latest["t"], text)
        now = trace.now()
        processes = None
        if now - self._last_processes >= PROCESSES_EVERY_S:
            self._last_processes = now
            processes = self._list_processes(latest["t"])
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fan_out, row, processes)
        else:
            self._fan_out(row, processes)

    def _remember(self, t: float | None, values: Mapping[str, float | None]) -> None:
        """Keep each device's newest values: what a device shows, greyed, once its readings stop."""
        devices = self._devices
        if t is None or devices is None:
            return
        ids = {device["id"] for device in devices["devices"]}
        newest: dict[str, dict[str, Reading]] = {}
        for name, value in values.items():
            device = name.partition(".")[0]
            if device in ids and value is not None:
                newest.setdefault(device, {})[name] = value
        for device, readings in newest.items():
            self._last_values[device] = (t, readings)

    def _list_processes(self, t: float | None) -> str:
        sources = self._sources
        # A GPU source that hung holds its lock inside the read that never returned: don't wait on it.
        listed: dict[str, list[tuple[int, int | None]]] = {}
        for source in sources.gpus.sources if sources is not None else []:
            if not self._is_hung(source):
                listed.update(source.processes())
        host_pids = foreign_pid_namespace(pid for rows in listed.values() for pid, _ in rows)
        gpus = {label: [self._describe_process(pid, memory, host_pids) for pid, memory in rows]
                for label, rows in listed.items()}
        self._processes_text = _message("processes", t=t, gpus=gpus)
        return self._processes_text

    def _describe_process(self, pid: int, memory: int | None, host_pid: bool = False) -> ProcessInfo:
        row: ProcessInfo = {"pid": pid, "memory": memory, "user": ANOTHER_USER, "name": None,
                               "kernel_id": None, "notebook": None}
        if host_pid:  # a local process with the same number would be a stranger's, or the user's by chance
            row["user"] = HOST_PID_USER
            return row
        try:
            process = psutil.Process(pid)
            if process.username() != self._user:
                return row  # another user's process: its memory only, never its name or command
            row["user"] = "you"
            row["name"] = process.name()
            kernels = self.kernels.by_pid
            owner = next((ancestor for ancestor in ancestors(pid, PARENT_DEPTH) if ancestor in kernels), None)
            if owner is not None:
                row["kernel_id"], row["notebook"] = kernels[owner]
        except (psutil.Error, KeyError):
            pass  # gone, or in another pid namespace: keep the anonymous row
        return row

    # ------------------------------------------------------------- event loop

    def _fan_out(self, row: tuple[int, float, str], processes: str | None) -> None:
        self._recent_samples.append(row)
        _, t, text = row
        for token, subscriber in list(self._subscribers.items()):
            try:
                if t <= subscriber.after_t:
                    continue  # its history or catch-up had this row
                if subscriber.sent % subscriber.every == 0:
                    subscriber.send(text)
                subscriber.sent += 1
                if processes is not None:
                    subscriber.send(processes)
            except Exception:  # noqa: BLE001 - a closed socket unsubscribes, it does not stop others
                self.unsubscribe(token)

    async def refresh_kernels(self, kernel_pids: Callable[[], Mapping[str, int | None]],
                              sessions: Callable[[], Awaitable[list[dict[str, Any]]]]) -> None:
        """Rebuild pid -> (kernel id, notebook path) from the kernel and session managers."""
        paths = {}
        try:
            for session in await sessions():
                kernel = session.get("kernel") or {}
                if kernel.get("id"):
                    paths[kernel["id"]] = session.get("path")
        except Exception as exc:  # noqa: BLE001 - a table without notebook names is still useful
            log.debug("gpuwidget: listing sessions failed: %s", exc)
        by_pid = {}
        for kernel_id, pid in kernel_pids().items():
            if pid:
                by_pid[int(pid)] = (kernel_id, paths.get(kernel_id))
        self.kernels = KernelDirectory(by_pid)


def default_sources() -> MonitorSources:
    # The sidebar shows neither per-core CPU nor the server process itself.
    # The machine's view: every MIG instance, not the one a CUDA process would see.
    return MonitorSources(HostSource(per_core=False, process=False),
                          open_gpu_sources(pids=lambda: (), every_device=True))


def _for_plot(values: np.ndarray) -> list[float | None]:
    """A history column rounded to :data:`HISTORY_DIGITS` significant digits of its largest value."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    decimals = HISTORY_DIGITS - 1 - math.floor(math.log10(top)) if top > 0 else 0
    return finite_list(np.round(values, decimals))


def _in_stream_history(name: str) -> bool:
    """Whether the sidebar draws column ``name`` (``gpu3.util``, ``cpu.util``): see :data:`STREAM_HISTORY_METRICS`."""
    return name in STREAM_HISTORY_METRICS or (
        name.startswith("gpu") and name.rpartition(".")[2] in STREAM_HISTORY_METRICS)


_WHOLE_NUMBER = re.compile(r"-?[1-9][0-9]*")


def _short_numbers(values: np.ndarray) -> str:
    """A column as a JSON array, :data:`STREAM_HISTORY_DIGITS` significant digits of its largest value.

    Large magnitudes are written as a whole number and an exponent (``[258e8,null,0]`` for bytes,
    5 characters a value where ``25800000000.0`` took 13); small ones as the shortest decimal
    (``37.3``). Non-finite values (no reading) are ``null``.
    """
    finite = np.isfinite(values)
    top = float(np.abs(values[finite]).max()) if finite.any() else 0.0
    decimals = STREAM_HISTORY_DIGITS - 1 - math.floor(math.log10(top)) if top > 0 else 0
    if decimals > 0:
        return _encode(finite_list(np.round(values, decimals)))
    scaled = np.where(finite, np.rint(values / 10.0 ** -decimals), 0).astype(np.int64).astype(object)
    scaled[~finite] = None
    text = _encode(scaled.tolist())
    return _WHOLE_NUMBER.sub(rf"\g<0>e{-decimals}", text) if decimals < 0 else text


def _current_user() -> str | None:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (containers): everything is "another user"
        return None
