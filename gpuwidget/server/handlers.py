"""HTTP and websocket routes of the server extension (see docs/server-api.md).

Every route is authenticated (``@web.authenticated`` / ``@ws_authenticated``) and
authorized against the resource ``gpuwidget``; a cross-origin request is refused with 403.
Blocking reads (NVML start-up, a one-off sample) run in a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import ensure_async
from tornado import web
from tornado.websocket import WebSocketClosedError, WebSocketHandler

from gpuwidget.server.monitor import Monitor
from gpuwidget.server.static import AUTH_RESOURCE


class _ApiHandler(APIHandler):
    """JSON routes: origin checked first (403, not jupyter_server's 404), then auth."""

    auth_resource = AUTH_RESOURCE

    async def prepare(self) -> None:  # type: ignore[override]
        # JupyterHandler's preparation (user, host check), then the origin check that
        # APIHandler.prepare would answer with 404.
        await JupyterHandler.prepare(self)
        if not self.check_origin():
            raise web.HTTPError(403, "cross-origin request refused")

    @property
    def monitor(self) -> Monitor:
        return self.settings["gpuwidget_monitor"]

    async def in_thread(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)


class DevicesHandler(_ApiHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self.finish(json.dumps(await self.in_thread(self.monitor.devices)))


class SnapshotHandler(_ApiHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        raw = self.get_query_argument("window", None)
        try:
            window = None if raw is None else float(raw)
        except ValueError:
            raise web.HTTPError(400, f"window must be a number of seconds, not {raw!r}") from None
        monitor = self.monitor
        devices = await self.in_thread(monitor.devices)
        if not monitor.running:
            await self.in_thread(monitor.read_once)
        await self.finish(json.dumps({
            "devices": devices,
            "history": monitor.history(window),
            "latest": monitor.latest(),
            "processes": monitor.processes(),
        }))


class StreamHandler(WebSocketMixin, WebSocketHandler, JupyterHandler):  # type: ignore[misc]
    """Samples at the subscriber's rate, after a hello and the last hour of history."""

    auth_resource = AUTH_RESOURCE
    _token: int | None = None

    @property
    def monitor(self) -> Monitor:
        return self.settings["gpuwidget_monitor"]

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        allowed = await ensure_async(self.authorizer.is_authorized(self, self.current_user, "read", AUTH_RESOURCE))
        if not allowed:
            raise web.HTTPError(403)
        raw = self.get_query_argument("interval", None)
        try:
            self._interval = None if raw is None else float(raw)
        except ValueError:
            raise web.HTTPError(400, f"interval must be a number of seconds, not {raw!r}") from None
        if self._interval is not None and not self._interval > 0:
            raise web.HTTPError(400, "interval must be positive")
        await asyncio.get_running_loop().run_in_executor(None, self.monitor.devices)  # NVML start-up
        await super().get(*args, **kwargs)

    async def open(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        monitor = self.monitor
        self._send(monitor.hello_text())
        self._send(monitor.history_text())
        self._send(monitor.processes_text())
        self._token = monitor.subscribe(self._send, self._interval)

    def _send(self, text: str) -> None:
        try:
            self.write_message(text)
        except WebSocketClosedError:
            self._leave()

    def on_message(self, message: str | bytes) -> None:
        pass  # the client has nothing to say

    def on_close(self) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._token is not None:
            self.monitor.unsubscribe(self._token)
            self._token = None
