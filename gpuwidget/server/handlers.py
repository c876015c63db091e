"""HTTP and websocket routes of the server extension (see docs/server-api.md).

Every route is authenticated (``@web.authenticated`` / ``@ws_authenticated``) and
authorized against the resource ``gpuwidget``; a cross-origin request is refused with 403.
Blocking reads (NVML start-up, a one-off sample, the history) run in a worker thread, never
on the loop. A stream socket is pinged and dropped when the browser stops answering, and what
waits for a slow reader is bounded (:mod:`gpuwidget.server.outbox`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import ensure_async
from tornado import web
from tornado.websocket import WebSocketHandler

from gpuwidget.server.monitor import Monitor
from gpuwidget.server.outbox import Outbox
from gpuwidget.server.protocol import DevicesReply, SnapshotReply
from gpuwidget.server.static import AUTH_RESOURCE

log = logging.getLogger("gpuwidget")

# The slowest rate a subscriber may ask for: an hour, the span of the history it gets first.
MAX_STREAM_INTERVAL_S = 3600.0
# Stream sockets are pinged at Jupyter's ``ws_ping_interval`` (ms), at most this far apart, and
# closed when a pong does not come back within as long: a browser that vanished (sleep, lost
# network) is let go within 2 x 15 s, plus tornado's 5 s wait for a closing handshake.
STREAM_PING_MAX_MS = 15_000


def seconds_argument(handler: web.RequestHandler, name: str, upper: float = math.inf) -> float | None:
    """A query argument in seconds: absent -> None; not a finite number in [0, ``upper``] -> 400."""
    raw = handler.get_query_argument(name, None)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise web.HTTPError(400, f"{name} must be a number of seconds, not {raw!r}") from None
    if not (math.isfinite(value) and 0 <= value <= upper):
        raise web.HTTPError(400, f"{name} must be between 0 and {upper:g} seconds, not {raw!r}")
    return value


class _MonitorHandler(web.RequestHandler):
    """What every gpuwidget route shares: the server's one Monitor, and a worker thread for blocking calls."""

    @property
    def monitor(self) -> Monitor:
        return self.settings["gpuwidget_monitor"]  # type: ignore[no-any-return]

    async def in_thread(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    async def devices(self) -> DevicesReply:
        """The /devices payload: NVML's start-up in a worker thread the first time, the cached facts after."""
        known = self.monitor.known_devices
        return known if known is not None else await self.in_thread(self.monitor.devices)


class _ApiHandler(APIHandler, _MonitorHandler):
    """JSON routes: origin checked first (403, not jupyter_server's 404), then auth."""

    auth_resource = AUTH_RESOURCE

    async def prepare(self) -> None:  # type: ignore[override]
        # JupyterHandler's preparation (user, host check), then the origin check that
        # APIHandler.prepare would answer with 404.
        await JupyterHandler.prepare(self)
        if not self.check_origin():
            raise web.HTTPError(403, "cross-origin request refused")


class DevicesHandler(_ApiHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        cluster = self.settings.get("gpuwidget_cluster")
        reply: DevicesReply = {**await self.devices(), "cluster": bool(cluster and cluster.configured)}
        await self.finish(json.dumps(reply))


class SnapshotHandler(_ApiHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        window = seconds_argument(self, "window")
        monitor = self.monitor
        devices = await self.devices()
        if not monitor.running:
            await self.in_thread(monitor.read_once)
        now = time.time()
        reply: SnapshotReply = {
            "devices": devices,
            "history": await self.in_thread(monitor.history, window),
            "latest": monitor.latest(),
            "processes": monitor.processes(),
            "stalled": monitor.stalled(now),
            "stale": monitor.stale(now),
        }
        await self.finish(json.dumps(reply))


class StreamHandler(WebSocketMixin, WebSocketHandler, JupyterHandler, _MonitorHandler):  # type: ignore[misc]
    """Samples at the subscriber's rate, after a hello and the last hour of history.

    Pings are tornado's own (its ping closes a socket whose pong is late); jupyter_server's
    mixin keeps its origin check and auth. The mixin states the ping interval in milliseconds
    where tornado reads seconds, so the two properties below say it in tornado's unit.
    """

    auth_resource = AUTH_RESOURCE
    _token: int | None = None
    _interval: float | None = None
    _outbox: Outbox | None = None
    _gone = False

    @property
    def ping_interval(self) -> float:
        """Seconds between pings (tornado's unit); 0 (Jupyter's ``ws_ping_interval=0``) disables them."""
        return min(float(super().ping_interval), STREAM_PING_MAX_MS) / 1000

    @property
    def ping_timeout(self) -> float:
        """Seconds a pong may take; tornado allows no more than the interval."""
        return min(float(super().ping_timeout) / 1000, self.ping_interval)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        allowed = await ensure_async(self.authorizer.is_authorized(self, self.current_user, "read", AUTH_RESOURCE))
        if not allowed:
            raise web.HTTPError(403)
        self._interval = seconds_argument(self, "interval", MAX_STREAM_INTERVAL_S)
        if self._interval == 0:
            raise web.HTTPError(400, "interval must be positive")
        await self.devices()  # NVML start-up, before the upgrade
        await super().get(*args, **kwargs)

    async def open(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        monitor = self.monitor
        outbox = self._outbox = Outbox(self.write_message, self._close_behind)
        outbox.send(monitor.hello_text(), droppable=False)
        history, reached = await monitor.history_messages()
        if self._gone or outbox.closed:
            return  # left while the history was built: never subscribed
        for message in history:  # the history, then the samples since it was built
            outbox.send(message, droppable=False)
        outbox.send(monitor.processes_text(), droppable=False)
        self._token = monitor.subscribe(self._send, self._interval, after_t=reached)

    def _send(self, text: str) -> None:
        assert self._outbox is not None
        self._outbox.send(text)
        if self._outbox.closed:
            self._leave()  # closed under us (ping timeout, reset): stop writing now, not at on_close

    def _close_behind(self, code: int, reason: str) -> None:
        log.info("gpuwidget: closing a stream client from %s: %s", self.request.remote_ip, reason)
        self._leave()
        self.close(code, reason)

    def on_message(self, message: str | bytes) -> None:
        pass  # the client has nothing to say

    def on_close(self) -> None:
        self._gone = True
        self._leave()

    def _leave(self) -> None:
        if self._token is not None:
            self.monitor.unsubscribe(self._token)
            self._token = None
