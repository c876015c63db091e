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

from traitlets import Bool, Dict, Float, TraitError, Unicode, validate
from traitlets.config import Configurable

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

# How often the kernel table (pids and notebook paths) is refreshed while anyone listens.
KERNEL_REFRESH_MS = 5000


class GpuWidget(Configurable):
    """Settings of the server extension (``jupyter lab --GpuWidget.interval=0.5``)."""

    interval = Float(1.0, help="Seconds between samples of the shared GPU/host sampler.").tag(config=True)
    history_s = Float(3600.0, help="Seconds of history kept and sent to a new subscriber.").tag(config=True)

    # Prometheus: gpuwidget's figures on the server's own /metrics, and the cluster read back from Prometheus.
    metrics = Bool(True, help="Add gpuwidget's series to the server's {base_url}metrics.").tag(config=True)
    metrics_hostname = Unicode(
        "", help="The Hostname label of gpuwidget's series (default, as dcgm-exporter: $NODE_NAME if set, "
                 "else the host name; in a pod, the node's name makes them join dcgm-exporter's).").tag(config=True)
    metrics_keepalive_s = Float(
        300.0, help="Seconds a scrape of /metrics keeps the shared sampler running (0: scrapes never start it)."
    ).tag(config=True)
    prometheus_url = Unicode(
        "", help="Prometheus's base URL (http://prometheus:9090); set, the sidebar shows the cluster's GPUs.",
    ).tag(config=True)
    prometheus_headers = Dict(
        per_key_traits=None, value_trait=Unicode(), default_value={},
        help="Extra HTTP headers for Prometheus (e.g. X-Scope-OrgID for Mimir or Thanos).").tag(config=True)
    prometheus_token = Unicode("", help="Bearer token sent to Prometheus.").tag(config=True)
    cluster_selector = Unicode(
        "", help='PromQL label matchers choosing the cluster\'s GPUs, e.g. {job="gpu",pod=~"user-.*"}.',
    ).tag(config=True)
    prometheus_timeout_s = Float(10.0, help="Seconds a Prometheus query may take.").tag(config=True)
    prometheus_connect_timeout_s = Float(3.0, help="Seconds to connect to Prometheus.").tag(config=True)
    gpu_hour_price = Float(
        None, allow_none=True,
        help="What one GPU-hour costs (any currency). Kernels this server starts inherit it (as "
             "$GPUWIDGET_GPU_HOUR_PRICE), so a watched cell's report shows its cost and idle cost; "
             "%%gpuwatch --price overrides it.").tag(config=True)
    measure_budget = Float(
        None, allow_none=True,
        help="Seconds the panel's Measure button and --tune take in all, for the kernels this server starts "
             "(as $GPUWIDGET_MEASURE_BUDGET), instead of what each plan announces (about 35 s a change); "
             "%%gpuwatch --budget overrides it.").tag(config=True)

    @validate("gpu_hour_price")
    def _check_price(self, proposal: Any) -> float | None:
        price = proposal["value"]
        if price is not None and not (price > 0 and price != float("inf")):
            raise TraitError(f"gpu_hour_price must be a positive number per GPU-hour, not {price!r}")
        return price

    @validate("measure_budget")
    def _check_budget(self, proposal: Any) -> float | None:
        from gpuwidget.options import MAX_BUDGET_S, MIN_BUDGET_S

        budget = proposal["value"]
        if budget is not None and not MIN_BUDGET_S <= budget <= MAX_BUDGET_S:
            raise TraitError(f"measure_budget must be seconds from {MIN_BUDGET_S:g} to {MAX_BUDGET_S:g}, "
                             f"not {budget!r}")
        return budget

    @validate("prometheus_url")
    def _check_url(self, proposal: Any) -> str:
        url = str(proposal["value"]).strip()
        if url and not url.startswith(("http://", "https://")):
            raise TraitError(f"prometheus_url must be an http:// or https:// URL, not {url!r}")
        return url

    @validate("cluster_selector")
    def _check_selector(self, proposal: Any) -> str:
        from gpuwidget.server.cluster import check_selector

        try:
            return check_selector(proposal["value"]) or ""
        except ValueError as exc:
            raise TraitError(str(exc)) from None


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

    from gpuwidget.server.cluster import ClusterHandler
    from gpuwidget.server.handlers import DevicesHandler, SnapshotHandler, StreamHandler
    from gpuwidget.server.monitor import Monitor
    from gpuwidget.server.static import BOKEHJS_ROUTE, BokehJSHandler
    from gpuwidget.server.subshells import untrack_subshell_requests

    config = GpuWidget(parent=serverapp)
    share_with_kernels(config)
    monitor = Monitor(interval=config.interval, history_s=config.history_s)
    web_app = serverapp.web_app
    web_app.settings["gpuwidget_monitor"] = monitor
    base_url = web_app.settings["base_url"]
    routes: list[tuple[str, Any]] = [
        (BOKEHJS_ROUTE, BokehJSHandler),
        (r"/gpuwidget/api/devices", DevicesHandler),
        (r"/gpuwidget/api/snapshot", SnapshotHandler),
        (r"/gpuwidget/api/stream", StreamHandler),
        (r"/gpuwidget/api/cluster", ClusterHandler),
    ]
    _add_prometheus(serverapp, config, monitor)
    web_app.add_handlers(".*$", [(url_path_join(base_url, route), handler) for route, handler in routes])
    untrack_subshell_requests(serverapp)  # a live plot's widget comms must not make the page say "Idle"

    async def refresh() -> None:
        if monitor.subscribers:
            await monitor.refresh_kernels(lambda: _kernel_pids(serverapp), serverapp.session_manager.list_sessions)

    PeriodicCallback(lambda: asyncio.ensure_future(refresh()), KERNEL_REFRESH_MS).start()
    serverapp.log.info("gpuwidget server extension loaded (interval %.2f s)", config.interval)


def share_with_kernels(config: GpuWidget) -> None:
    """Hand ``gpu_hour_price`` and ``measure_budget`` to the kernels this server starts: they inherit its
    environment, and a watch reads them from there (gpuwidget.options.PRICE_ENV and BUDGET_ENV)."""
    import os

    from gpuwidget.options import BUDGET_ENV, PRICE_ENV

    for name, value in ((PRICE_ENV, config.gpu_hour_price), (BUDGET_ENV, config.measure_budget)):
        if value is not None:
            os.environ[name] = repr(value)


def _add_prometheus(serverapp: ServerApp, config: GpuWidget, monitor: Any) -> None:
    """The collector on jupyter_server's /metrics, and the cluster route's Prometheus settings."""
    import os
    import socket

    from gpuwidget.server.cluster import Cluster, PrometheusConfig
    from gpuwidget.server.metrics import GpuWidgetCollector, ScrapeKeepalive, register

    settings = serverapp.web_app.settings
    prometheus = None
    if config.prometheus_url:
        prometheus = PrometheusConfig(
            url=config.prometheus_url, headers=dict(config.prometheus_headers), token=config.prometheus_token,
            selector=config.cluster_selector or None, timeout_s=config.prometheus_timeout_s,
            connect_timeout_s=config.prometheus_connect_timeout_s)
    settings["gpuwidget_cluster"] = Cluster(prometheus)
    if not config.metrics:
        return
    register(GpuWidgetCollector(
        monitor, config.metrics_hostname or os.environ.get("NODE_NAME") or socket.gethostname(),
        notebooks_allowed=lambda: bool(settings.get("authenticate_prometheus", True)),
        status_dir=lambda: getattr(serverapp.kernel_manager, "connection_dir", None) or serverapp.runtime_dir,
        keepalive=ScrapeKeepalive(monitor, config.metrics_keepalive_s)))
