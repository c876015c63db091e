"""The sidebar stream under churn: 50 tabs reconnecting 100 times each, 10 that never read, 8 fake GPUs, 1 h of history.

A real Jupyter server with gpuwidget's extension runs in a subprocess over the fake NVML,
sampling every second, with an hour of history already kept. Ten raw websocket clients
connect and never read a byte (a frozen or vanished browser: no reads, no pongs); fifty
clients each connect, read the hello and the history, and disconnect, a hundred times, as
fast as they can (``--pause 0``, a stress: far more connections a second than tabs make) or
pausing between tries like the sidebar's first retry (``--pause 0.5``).
Measured: the server's event-loop lag while they churn (a callback due every 10 ms inside
the server), its RSS before, at peak and once every client has gone, and how long each
stalled client stayed subscribed. Targets: lag p99 < 10 ms, RSS back within 20 MB of the
start, every stalled client closed within 60 s.

Baselines for the same churn (``--endpoint``): ``jupyter`` connects the tabs to a websocket made
of Jupyter's own parts alone (authentication, handshake, ping, close) that sends a small hello and
a small second message; ``jupyter-history`` has it send, as the second message, prebuilt bytes as
long as the stream's history. What the stream costs beyond the second is gpuwidget's own.

With several endpoints (``--endpoint stream,jupyter``, ``--rounds N``) each runs on a fresh server in turn
and the table shows them side by side: on a shared machine the load drifts, and runs taken together
compare best.

    .venv/bin/python benchmarks/stream_churn.py [--pause S] [--endpoint E[,E...]] [--rounds N] [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import numpy as np
import psutil
from _common import parse_args, print_header, setup_paths, table, verdict, write_json
from server_load import TOKEN, server_under_load

setup_paths(fake_nvml=True)

from stream_clients import RawClient  # noqa: E402

GPUS = 8
INTERVAL_S = 1.0  # the extension's default
HISTORY_S = 3600.0
TABS, CYCLES, STALLED = 50, 100, 10
STALLED_LIMIT_S = 60.0  # a stalled client must be let go within a minute
# From the start, how long to wait for the stalled clients to be let go before reading RSS...
SETTLE_S = 75.0
# ...and at least this long after the last tab left: the server hands freed memory back 20 s
# after it went idle (gpuwidget.server.monitor.TRIM_AFTER_IDLE_S), once closed sockets are gone.
AFTER_S = 25.0
# Before the tabs come, the server's CPU is read this long with only the stalled clients: what it
# spends per second whoever connects (the sampler, pings), taken out of the cost per connection.
IDLE_S = 5.0
# The sidebar spreads its retries by +-20% so that tabs do not reconnect in step.
JITTER = 0.2
RSS_PERIOD_S = 0.5


ENDPOINTS = ("stream", "jupyter", "jupyter-history")


def stream_path(label: str | None = None) -> str:
    """The stream's URL; a ``label`` has the server note when that socket opens and closes."""
    return f"/gpuwidget/api/stream?token={TOKEN}" + (f"&client={label}" if label else "")


def baseline_path(size: int) -> str:
    """The Jupyter-only websocket of _server_under_load.py, sending a hello and ``size`` bytes."""
    return f"/bench/ws?token={TOKEN}&bytes={size}"


async def cpu_rate(process: psutil.Process, seconds: float) -> float:
    """The server's CPU seconds per second over ``seconds`` (its sampler, the stalled clients' pings)."""
    before = sum(process.cpu_times()[:2])
    await asyncio.sleep(seconds)
    return (sum(process.cpu_times()[:2]) - before) / seconds


async def history_size(port: int) -> int:
    """Bytes of the history the stream sends a new tab now."""
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(f"ws://127.0.0.1:{port}{stream_path()}", max_message_size=64 * 2**20)
    await ws.read_message()
    history = await ws.read_message()
    ws.close()
    return len(history or "")


async def tab(port: int, index: int, cycles: int, pause_s: float, sizes: list[int], path: str) -> None:
    from tornado.websocket import websocket_connect

    for cycle in range(cycles):
        if cycle and pause_s:
            await asyncio.sleep(pause_s * random.uniform(1 - JITTER, 1 + JITTER))
        ws = await websocket_connect(f"ws://127.0.0.1:{port}{path}", max_message_size=64 * 2**20)
        hello = await ws.read_message()
        history = await ws.read_message()
        assert isinstance(hello, str) and hello.startswith('{"type":"hello"'), hello
        assert isinstance(history, str) and history.startswith('{"type":"history"')
        sizes.append(len(history))
        ws.close()


async def churn(port: int, tabs: int, cycles: int, stalled: int, settle_s: float, process: psutil.Process,
                rss: list[tuple[float, int]], pause_s: float = 0.0, endpoint: str = "stream",
                size: int = 0) -> dict[str, Any]:
    """Run the tabs beside the stalled clients, then wait for the server to let go of everything.

    That is ``settle_s`` from the start (or nothing, for 0) and at least :data:`AFTER_S` after the last tab left.
    """
    async def watch_rss() -> None:
        while True:
            rss.append((time.time(), process.memory_info().rss))
            await asyncio.sleep(RSS_PERIOD_S)

    path = stream_path() if endpoint == "stream" else \
        baseline_path((size or await history_size(port)) if endpoint == "jupyter-history" else 0)
    watcher = asyncio.ensure_future(watch_rss())
    frozen = [await RawClient.connect(port, stream_path(f"stalled-{n}"), receive_buffer=4096) for n in range(stalled)]
    idle_cpu = await cpu_rate(process, IDLE_S)
    sizes: list[int] = []
    started, cpu_before = time.time(), sum(process.cpu_times()[:2])
    await asyncio.gather(*(tab(port, n, cycles, pause_s, sizes, path) for n in range(tabs)))
    ended, cpu_s = time.time(), sum(process.cpu_times()[:2]) - cpu_before
    if settle_s:
        await asyncio.sleep(max(0.0, started + settle_s - time.time(), ended + AFTER_S - time.time()))
    watcher.cancel()
    rss_end = process.memory_info().rss
    for client in frozen:
        client.abort()
    return {"started": started, "ended": ended, "rss_end": rss_end, "history_bytes": float(np.median(sizes)),
            "connections": len(sizes), "cpu_s": cpu_s, "idle_cpu": idle_cpu}


def stalled_durations(events: list[list[Any]]) -> list[float]:
    """Seconds each stalled client stayed open (inf for one never closed)."""
    opened: dict[str, float] = {}
    closed: dict[str, float] = {}
    for label, kind, at in events:
        if label.startswith("stalled-"):
            (opened if kind == "open" else closed)[label] = at
    return [closed.get(label, float("inf")) - at for label, at in sorted(opened.items())]


def measure(endpoint: str, args: Any, tabs: int, cycles: int, stalled: int, settle: float) -> dict[str, Any]:
    """One churn against ``endpoint`` on a fresh server: the figures of the table, by name."""
    rss: list[tuple[float, int]] = []
    with server_under_load(GPUS, INTERVAL_S, HISTORY_S) as (port, server, report):
        process = psutil.Process(server.pid)
        time.sleep(2.0)  # start-up work settles
        rss_start = process.memory_info().rss
        load = os.getloadavg()[0]
        run = asyncio.run(churn(port, tabs, cycles, stalled, settle, process, rss, args.pause, endpoint, args.bytes))
    rss_end = run["rss_end"]
    lag_times = np.asarray(report.get("lag_times") or [np.nan])
    lags = np.asarray(report.get("lags") or [np.nan])
    during = lags[(lag_times >= run["started"]) & (lag_times <= run["ended"])]
    if not len(during):
        during = np.asarray([np.nan])
    held = stalled_durations(report.get("events") or []) if settle else []
    seconds = run["ended"] - run["started"]
    p50, p99, worst = (1e3 * float(np.percentile(during, q)) for q in (50, 99, 100))
    return {"endpoint": endpoint, "load": load, "connections": run["connections"], "seconds": seconds,
            "cpu_ms_per_connection": 1e3 * (run["cpu_s"] - run["idle_cpu"] * seconds) / max(1, run["connections"]),
            "idle_cpu_s_per_s": run["idle_cpu"], "history_bytes": run["history_bytes"],
            "lag_ms": {"p50": p50, "p99": p99, "max": worst},
            "rss_mb": {"start": rss_start / 2**20, "peak": max([v for _, v in rss] or [rss_start]) / 2**20,
                       "end": rss_end / 2**20},
            "stalled_held_s": held}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [
        ("--pause", {"type": float, "default": 0.0, "help": "seconds a tab waits before reconnecting"}),
        ("--endpoint", {"default": "stream",
                        "help": f"one of {', '.join(ENDPOINTS)}, or several with commas (stream,jupyter): each on a "
                                "fresh server, in turn, side by side in one table"}),
        ("--rounds", {"type": int, "default": 1, "help": "run the endpoints in turn this many times"}),
        ("--cycles", {"type": int, "default": CYCLES, "help": "reconnects per tab"}),
        ("--bytes", {"type": int, "default": 0,
                     "help": "jupyter-history: bytes of its second message (default: the stream's history now)"}),
        ("--settle", {"type": float, "default": SETTLE_S,
                      "help": "seconds from the start before RSS is read (0: lag only, RSS and stalled not judged)"})])
    endpoints = args.endpoint.split(",")
    if not set(endpoints) <= set(ENDPOINTS):
        raise SystemExit(f"--endpoint: each of {', '.join(ENDPOINTS)}, not {args.endpoint!r}")
    info = print_header("Server stream under churn: 50 tabs x 100 reconnects, 10 stalled clients, 8 fake GPUs, 1 h")
    tabs, cycles, stalled, settle = (10, 5, 2, 0.0) if args.quick else (TABS, args.cycles, STALLED, args.settle)
    runs = [measure(endpoint, args, tabs, cycles, stalled, settle)
            for _ in range(args.rounds) for endpoint in endpoints]

    def row(label: str, cell: Any) -> list[Any]:
        return [label, *(cell(run) for run in runs)]

    rows: list[list[Any]] = [
        row("load average (1 min) at its start", lambda run: f"{run['load']:.1f}"),
        row("connections served (hello + history each)",
            lambda run: f"{run['connections']} in {run['seconds']:.1f} s"),
        row("history message (median bytes)", lambda run: f"{run['history_bytes']:,.0f}"),
        row("server CPU per connection, beyond idle (ms)", lambda run: f"{run['cpu_ms_per_connection']:.2f}"),
        row("event-loop lag p50 / p99 / max (ms)",
            lambda run: "{p50:.2f} / {p99:.2f} / {max:.1f}".format(**run["lag_ms"])),
        row("server RSS start / peak / after (MB)", lambda run: "{start:.0f} / {peak:.0f} / {end:.0f}".format(
            **run["rss_mb"])),
        row("stalled clients let go after (s, longest)",
            lambda run: f"{max(run['stalled_held_s']):.1f}" if run["stalled_held_s"] else "not measured"),
    ]
    print(f"\n  pause {args.pause:g} s between a tab's tries; {tabs} tabs x {cycles} cycles, {stalled} stalled clients")
    table(["figure", *(run["endpoint"] for run in runs)], rows)
    verdicts = []
    for run in runs:
        p99, held = run["lag_ms"]["p99"], run["stalled_held_s"]
        verdicts.append(verdict(f"{run['endpoint']}: event-loop lag p99 while {tabs} tabs churn", p99, 10.0,
                                higher_is_better=False, shown=f"{p99:.2f} ms", target_shown="10 ms"))
        if settle:
            grown = run["rss_mb"]["end"] - run["rss_mb"]["start"]
            verdicts.append(verdict(f"{run['endpoint']}: server RSS once every client left, over its start", grown,
                                    20.0, higher_is_better=False, shown=f"{grown:+.1f} MB", target_shown="20 MB"))
        if held:
            verdicts.append(verdict(f"{run['endpoint']}: longest a stalled client stayed subscribed", max(held),
                                    STALLED_LIMIT_S, higher_is_better=False, shown=f"{max(held):.1f} s",
                                    target_shown="60 s"))
    write_json(args.json, {"machine": info, "tabs": tabs, "cycles": cycles, "stalled": stalled, "pause_s": args.pause,
                           "runs": runs, "verdicts": verdicts})


if __name__ == "__main__":
    main()
