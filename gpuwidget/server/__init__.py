"""gpuwidget's Jupyter server extension: one shared GPU/host sampler streamed to the sidebar.

jupyter_server finds the extension by the top-level module name ``gpuwidget``
(``jupyter-config/server-config/gpuwidget.json`` enables it, and a wheel installs that
file into ``etc/jupyter/jupyter_server_config.d``). ``gpuwidget._jupyter_server_extension_points``
points the server at this module (only the server imports it), where
``_load_jupyter_server_extension`` is called once at start-up. Routes are
described in docs/server-api.md.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from traitlets import Float
from traitlets.config import Configurable

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

# How often the kernel table (pids and notebook paths) is refreshed while anyone listens.
KERNEL_REFRESH_MS = 5000


class GpuWidget(Configurable):
    """Settings of the server extension (``jupyter lab --GpuWidget.interval=0.5``)."""

    interval = Float(1.0, help="Seconds between samples of the shared GPU/host sampler.").tag(config=True)
    history_s = Float(3600.0, help="Seconds of history kept and sent to a new subscriber.").tag(config=True)


def _kernel_pids(serverapp: ServerApp) -> dict[str, int | None]:
    """kernel id -> the kernel process's pid (local kernels; remote ones have none)."""
    manager = serverapp.kernel_manager
    pids: dict[str, int | None] = {}
    for kernel_id in manager.list_kernel_ids():
        try:
            provisioner = manager.get_kernel(kernel_id).provisioner
        except KeyError:
            continue
        pids[kernel_id] = getattr(provisioner, "pid", None)
    return pids


def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
    """Called by jupyter_server once, after its web application exists: add the routes."""
    from jupyter_server.utils import url_path_join
    from tornado.ioloop import PeriodicCallback

    from gpuwidget.server.handlers import DevicesHandler, SnapshotHandler, StreamHandler
    from gpuwidget.server.monitor import Monitor
    from gpuwidget.server.static import BOKEHJS_ROUTE, BokehJSHandler

    config = GpuWidget(parent=serverapp)
    monitor = Monitor(interval=config.interval, history_s=config.history_s)
    web_app = serverapp.web_app
    web_app.settings["gpuwidget_monitor"] = monitor
    base_url = web_app.settings["base_url"]
    routes: list[tuple[str, Any]] = [
        (BOKEHJS_ROUTE, BokehJSHandler),
        (r"/gpuwidget/api/devices", DevicesHandler),
        (r"/gpuwidget/api/snapshot", SnapshotHandler),
        (r"/gpuwidget/api/stream", StreamHandler),
    ]
    web_app.add_handlers(".*$", [(url_path_join(base_url, route), handler) for route, handler in routes])

    async def refresh() -> None:
        if monitor.subscribers:
            await monitor.refresh_kernels(lambda: _kernel_pids(serverapp), serverapp.session_manager.list_sessions)

    PeriodicCallback(lambda: asyncio.ensure_future(refresh()), KERNEL_REFRESH_MS).start()
    serverapp.log.info("gpuwidget server extension loaded (interval %.2f s)", config.interval)
