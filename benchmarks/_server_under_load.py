"""A Jupyter server with gpuwidget's extension over a fake NVML, for benchmarks/server_load.py and stream_churn.py.

Run as a subprocess: ``python benchmarks/_server_under_load.py PORT TOKEN GPUS INTERVAL OUT [HISTORY_S]``.
It measures the event loop's scheduling lag (a callback due every 10 ms) while it serves, and
writes as JSON to OUT when it receives SIGTERM: the lags (seconds, with the wall time each was
measured at), the number of stream subscribers every 0.25 s, and when each stream socket whose
URL names a ``client`` opened and closed. With HISTORY_S the server starts with that much history.

For a side-by-side baseline the server also has ``/bench/ws?bytes=N``: a websocket made only of
Jupyter's own parts (``JupyterHandler``, ``WebSocketMixin``, ``@ws_authenticated``), which sends a
small hello and then N prebuilt bytes (one shared text), as the stream sends its hello and history.
With ``GPUWIDGET_BENCH_PROFILE=PATH`` the event loop's thread is profiled (cProfile) into PATH.
"""

from __future__ import annotations

import array
import cProfile
import json
import os
import signal
import sys
import time

from _common import setup_paths

setup_paths(fake_nvml=True)

from stream_clients import fill_history  # noqa: E402

from fakenvml import FakeNvml  # noqa: E402

LAG_PERIOD_S = 0.01
SUBSCRIBERS_PERIOD_S = 0.25


def record_stream_events(events: list[tuple[str, str, float]]) -> None:
    """Note when each labelled stream socket (``?client=LABEL``) opens and closes."""
    from gpuwidget.server.handlers import StreamHandler

    opened, closed = StreamHandler.open, StreamHandler.on_close

    async def open_(self: StreamHandler, *args: object, **kwargs: object) -> None:
        label = self.get_query_argument("client", None)
        if label:
            events.append((label, "open", time.time()))
        await opened(self, *args, **kwargs)

    def on_close(self: StreamHandler) -> None:
        label = self.get_query_argument("client", None)
        if label:
            events.append((label, "close", time.time()))
        closed(self)

    StreamHandler.open = open_  # type: ignore[method-assign]
    StreamHandler.on_close = on_close  # type: ignore[method-assign]


def add_baseline_route(app: object) -> None:
    """``/bench/ws?bytes=N``: Jupyter's websocket machinery alone, sending a hello and N shared bytes."""
    from jupyter_server.auth.decorator import ws_authenticated
    from jupyter_server.base.handlers import JupyterHandler
    from jupyter_server.base.websocket import WebSocketMixin
    from jupyter_server.utils import url_path_join
    from tornado.websocket import WebSocketHandler

    payloads: dict[int, bytes] = {}

    class BaselineHandler(WebSocketMixin, WebSocketHandler, JupyterHandler):  # type: ignore[misc]
        @ws_authenticated
        async def get(self, *args: object, **kwargs: object) -> None:
            await super().get(*args, **kwargs)

        def open(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            super().open(*args, **kwargs)
            size = int(self.get_query_argument("bytes", "0"))
            payload = payloads.get(size)
            if payload is None:
                payload = payloads[size] = b'{"type":"history","pad":"' + b"7" * max(0, size - 28) + b'"}'
            self.write_message('{"type":"hello"}')
            self.write_message(payload)

        def on_message(self, message: object) -> None:
            pass

    web_app = app.web_app  # type: ignore[attr-defined]
    web_app.add_handlers(".*$", [(url_path_join(web_app.settings["base_url"], "/bench/ws"), BaselineHandler)])


def main() -> None:
    port, token, gpus, interval, out = sys.argv[1:6]
    history_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
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
        monitor = app.web_app.settings["gpuwidget_monitor"]
        if history_s:
            fill_history(monitor, history_s, float(interval))
        events: list[tuple[str, str, float]] = []
        record_stream_events(events)
        add_baseline_route(app)
        # Raw doubles in one growing buffer: a float object per reading, made throughout a run,
        # would pin the allocator's pages among the server's and skew its RSS figures.
        lags = array.array("d")
        lag_times = array.array("d")
        subscribers: list[tuple[float, int]] = []
        expected = [time.perf_counter() + LAG_PERIOD_S]

        def tick() -> None:
            now = time.perf_counter()
            lags.append(max(0.0, now - expected[0]))
            lag_times.append(time.time())
            expected[0] = now + LAG_PERIOD_S

        PeriodicCallback(tick, LAG_PERIOD_S * 1000).start()
        PeriodicCallback(lambda: subscribers.append((time.time(), monitor.subscribers)),
                         SUBSCRIBERS_PERIOD_S * 1000).start()

        profile_path = os.environ.get("GPUWIDGET_BENCH_PROFILE")
        profiler = cProfile.Profile() if profile_path else None

        def finish(*_: object) -> None:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile_path)
            with open(out, "w") as fh:
                json.dump({"lags": lags.tolist(), "lag_times": lag_times.tolist(), "subscribers": subscribers,
                           "events": events}, fh)
            IOLoop.current().add_callback_from_signal(app.stop)

        signal.signal(signal.SIGTERM, finish)
        if profiler is not None:
            profiler.enable()
        app.start()


if __name__ == "__main__":
    main()
