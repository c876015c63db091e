"""A Jupyter server with gpuwidget's extension over a fake NVML, for benchmarks/server_load.py.

Run as a subprocess: ``python benchmarks/_server_under_load.py PORT TOKEN GPUS INTERVAL OUT``.
It measures the event loop's scheduling lag (a callback due every 10 ms) while it serves,
and writes the lags (seconds) as JSON to OUT when it receives SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from _common import setup_paths

setup_paths(fake_nvml=True)

from fakenvml import FakeNvml  # noqa: E402

LAG_PERIOD_S = 0.01


def main() -> None:
    port, token, gpus, interval, out = sys.argv[1:6]
    fake = FakeNvml.gpus(int(gpus))
    fake.real_time = True
    with fake.patched():
        from jupyter_server.serverapp import ServerApp
        from tornado.ioloop import IOLoop, PeriodicCallback

        app = ServerApp()
        app.initialize([
            f"--port={port}", "--ip=127.0.0.1", "--no-browser", f"--IdentityProvider.token={token}",
            "--ServerApp.jpserver_extensions={'gpuwidget': True}", f"--GpuWidget.interval={interval}",
            "--allow-root", "--ServerApp.log_level=WARN",
        ])
        lags: list[float] = []
        expected = [time.perf_counter() + LAG_PERIOD_S]

        def tick() -> None:
            now = time.perf_counter()
            lags.append(max(0.0, now - expected[0]))
            expected[0] = now + LAG_PERIOD_S

        PeriodicCallback(tick, LAG_PERIOD_S * 1000).start()

        def finish(*_: object) -> None:
            with open(out, "w") as fh:
                json.dump({"lags": lags}, fh)
            IOLoop.current().add_callback_from_signal(app.stop)

        signal.signal(signal.SIGTERM, finish)
        app.start()


if __name__ == "__main__":
    main()
