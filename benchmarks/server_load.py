"""Server cost of the sidebar stream: 10 clients at 10 Hz with 8 (fake) GPUs.

A real Jupyter server with gpuwidget's extension runs in a subprocess over the fake NVML
(zero-latency calls, so the figures are gpuwidget's own cost plus the fake's). Ten
websocket clients subscribe at 0.1 s for ``--seconds``; we measure the server process's
CPU time (psutil), the event loop's scheduling lag (a 10 ms callback inside the server)
and the bytes each client receives. Targets: < 2% of one core, loop lag p99 < 10 ms.

    .venv/bin/python benchmarks/server_load.py [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import parse_args, print_header, table, verdict, write_json

HERE = Path(__file__).resolve().parent
CLIENTS = 10
INTERVAL = 0.1
GPUS = 8
TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(port: int, process: subprocess.Popen) -> None:
    for _ in range(300):
        if process.poll() is not None:
            raise RuntimeError("the server exited early")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


@contextlib.contextmanager
def server_under_load(gpus: int, interval: float, history_s: float = 0.0,
                      ) -> Iterator[tuple[int, subprocess.Popen, dict[str, Any]]]:
    """A Jupyter server with gpuwidget over ``gpus`` fake GPUs in a subprocess: (port, process, report).

    ``report`` is filled, once the block ends and the server stopped, with what the server
    recorded (event-loop lags, subscriber counts, stream socket events; see _server_under_load.py).
    """
    port = free_port()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "server.json"
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": tmp, "JUPYTER_CONFIG_DIR": tmp}
        server = subprocess.Popen(
            [sys.executable, str(HERE / "_server_under_load.py"), str(port), TOKEN, str(gpus), str(interval),
             str(out), str(history_s)], cwd=tmp, env=env)
        try:
            wait_ready(port, server)
            yield port, server, report
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        if out.exists():
            report.update(json.loads(out.read_text()))


async def client(port: int, seconds: float, received: list[int], samples: list[int]) -> None:
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(f"ws://127.0.0.1:{port}/gpuwidget/api/stream?interval={INTERVAL}&token={TOKEN}")
    deadline = time.monotonic() + seconds
    total = count = 0
    while time.monotonic() < deadline:
        message = await ws.read_message()
        if message is None:
            break
        total += len(message)
        count += message.startswith('{"type":"sample"')
    ws.close()
    received.append(total)
    samples.append(count)


async def load(port: int, seconds: float) -> tuple[list[int], list[int]]:
    received: list[int] = []
    samples: list[int] = []
    await asyncio.gather(*(client(port, seconds, received, samples) for _ in range(CLIENTS)))
    return received, samples


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--seconds", {"type": float, "default": 30.0})])
    info = print_header("Server stream: CPU, event-loop lag and bytes with 10 clients at 10 Hz, 8 fake GPUs")
    seconds = 5.0 if args.quick else args.seconds
    with server_under_load(GPUS, INTERVAL) as (port, server, report):
        process = psutil.Process(server.pid)
        time.sleep(1.0)  # start-up work settles
        idle_before = sum(process.cpu_times()[:2])
        time.sleep(3.0)
        idle_cpu = (sum(process.cpu_times()[:2]) - idle_before) / 3.0
        before = sum(process.cpu_times()[:2])
        started = time.perf_counter()
        received, samples = asyncio.run(load(port, seconds))
        elapsed = time.perf_counter() - started
        busy_cpu = (sum(process.cpu_times()[:2]) - before) / elapsed
    lags = np.asarray(report.get("lags") or [np.nan])
    per_client_bps = float(np.mean(received)) / elapsed
    stream_cpu = max(0.0, busy_cpu - idle_cpu)
    rate = float(np.mean(samples)) / elapsed
    rows: list[list[Any]] = [
        ["server CPU while streaming (% of one core)", f"{100 * busy_cpu:.2f}"],
        ["server CPU idle, no subscriber (% of one core)", f"{100 * idle_cpu:.2f}"],
        ["CPU per message written (us)", f"{1e6 * stream_cpu / max(1.0, rate * CLIENTS):.0f}"],
        ["samples per second per client", f"{rate:.1f}"],
        ["bytes per second per client", f"{per_client_bps:,.0f}"],
        ["event-loop lag p50 / p99 / max (ms)",
         f"{1e3 * np.percentile(lags, 50):.2f} / {1e3 * np.percentile(lags, 99):.2f} / {1e3 * lags.max():.2f}"],
    ]
    print()
    table(["figure", "value"], rows)
    verdicts = [
        verdict("server CPU, 10 clients at 10 Hz, 8 GPUs", 100 * busy_cpu, 2.0, higher_is_better=False,
                shown=f"{100 * busy_cpu:.2f}% of a core", target_shown="2%"),
        verdict("event-loop lag p99", 1e3 * float(np.percentile(lags, 99)), 10.0, higher_is_better=False,
                shown=f"{1e3 * np.percentile(lags, 99):.2f} ms", target_shown="10 ms"),
    ]
    write_json(args.json, {"machine": info, "seconds": elapsed, "busy_cpu": busy_cpu, "idle_cpu": idle_cpu,
                           "samples_per_s_per_client": rate, "bytes_per_s_per_client": per_client_bps,
                           "lag_ms": {"p50": 1e3 * float(np.percentile(lags, 50)),
                                      "p99": 1e3 * float(np.percentile(lags, 99))},
                           "verdicts": verdicts})


if __name__ == "__main__":
    main()
