"""The cluster's GPUs, read back from Prometheus for the sidebar: ``GET /gpuwidget/api/cluster``.

The browser never talks to Prometheus: the server asks ``/api/v1/query_range`` (tornado's
non-blocking client, every query at once) for the utilisation, memory and power of every GPU
the configured selector matches, and answers one JSON document (docs/server-api.md):

* from gpuwidget's own series (``gpuwidget_gpu_*``, other Jupyter servers' ``/metrics``), or,
  for the GPUs where only dcgm-exporter runs, from ``DCGM_FI_DEV_GPU_UTIL`` (percent -> 0..1),
  ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB -> bytes) and
  ``DCGM_FI_DEV_POWER_USAGE`` (W). A GPU (by UUID) that both report is read from gpuwidget's;
* grouped by the ``Hostname`` label both exporters set (``instance`` where it is missing);
* each GPU's holder where known: the notebook (or kernel) holding most of its memory per
  gpuwidget, or the pod dcgm-exporter's Kubernetes mapping names.

Failures are answers, not HTTP errors: Prometheus down, slow, refusing the query or
answering nonsense gives 200 with ``error`` saying which, so the sidebar can show it. The
selector is checked when configured: only a ``{...}`` set of label matchers, nothing that could
add PromQL to the queries. Replies are kept :data:`CACHE_S` and concurrent requests for the
same window share one set of queries, so many open sidebars cost Prometheus one.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

from jupyter_server.auth.decorator import authorized
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse

from gpuwidget.server.handlers import _ApiHandler, seconds_argument
from gpuwidget.server.protocol import ClusterGpu, ClusterHost, ClusterReply

# Points per series the sidebar draws (an hour at Prometheus's usual 15 s scrape interval).
TARGET_POINTS = 240
# Prometheus refuses range queries of more than 11,000 points per series.
MAX_POINTS = 11_000
MIN_STEP_S = 1.0
DEFAULT_WINDOW_S = 3600.0
MAX_WINDOW_S = 7 * 24 * 3600.0
# A reply is reused this long (the sidebar refreshes every 15 s; several tabs share one).
CACHE_S = 5.0
MIB = 1024 * 1024

# Label-matcher set: {name op "string", ...}; strings in double or single quotes with escapes.
_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
_STRING = r'"(?:[^"\\\n]|\\.)*"' + r"|'(?:[^'\\\n]|\\.)*'"
_MATCHER = rf"\s*{_NAME}\s*(?:=~|!~|!=|=)\s*(?:{_STRING})\s*"
_SELECTOR = re.compile(rf"\{{(?:{_MATCHER}(?:,{_MATCHER})*,?)?\s*\}}")
_MATCHER_NAMES = re.compile(rf"({_NAME})\s*(?:=~|!~|!=|=)\s*(?:{_STRING})")


def check_selector(selector: str | None) -> str | None:
    """The selector to use (None for none), or ValueError saying why it is refused.

    Accepted: a PromQL label-matcher set such as ``{job="gpu",pod=~"user-.*"}``; nothing else
    (no metric name, function, operator or second selector), and no ``__name__`` matcher, which
    would change the series a query reads.
    """
    if selector is None or not selector.strip():
        return None
    text = selector.strip()
    if not _SELECTOR.fullmatch(text):
        raise ValueError(f"cluster_selector must be a PromQL label-matcher set such as "
                         f'{{job="gpu",pod=~"user-.*"}}, not {selector!r}')
    if any(name == "__name__" for name in _MATCHER_NAMES.findall(text)):
        raise ValueError("cluster_selector may not match __name__: it chooses whose GPUs, not which series")
    return None if re.fullmatch(r"\{\s*\}", text) else text


@dataclass(frozen=True)
class Query:
    key: str  # util, memory_used, memory_free, memory_total, power, holder
    metric: str
    factor: float = 1.0


GPUWIDGET_QUERIES = (
    Query("util", "gpuwidget_gpu_utilization_ratio"),
    Query("memory_used", "gpuwidget_gpu_memory_used_bytes"),
    Query("memory_total", "gpuwidget_gpu_memory_total_bytes"),
    Query("power", "gpuwidget_gpu_power_watts"),
    Query("holder", "gpuwidget_kernel_gpu_memory_used_bytes"),
)
DCGM_QUERIES = (
    Query("util", "DCGM_FI_DEV_GPU_UTIL", 0.01),
    Query("memory_used", "DCGM_FI_DEV_FB_USED", MIB),
    Query("memory_free", "DCGM_FI_DEV_FB_FREE", MIB),
    Query("power", "DCGM_FI_DEV_POWER_USAGE"),
)
SOURCES = (("gpuwidget", GPUWIDGET_QUERIES), ("dcgm", DCGM_QUERIES))


@dataclass
class PrometheusConfig:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    token: str = ""
    selector: str | None = None
    timeout_s: float = 10.0
    connect_timeout_s: float = 3.0

    @property
    def shown_url(self) -> str:
        """The URL without any user:password in it (for messages)."""
        parts = urllib.parse.urlsplit(self.url)
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class PrometheusError(Exception):
    """Why Prometheus gave no data, in words for the sidebar."""


Fetch = Callable[[HTTPRequest], Awaitable[HTTPResponse]]


class RangeSeries(TypedDict, total=False):
    """One series of a Prometheus range query's ``matrix`` result (its JSON, read defensively)."""

    metric: dict[str, str]  # its labels
    values: list[list[Any]]  # [unix s, "value"] pairs, times ascending


class _Gathered(ClusterGpu, total=False):
    """A GPU's reply entry while its series are gathered: whose series it was read from, and dcgm's free memory."""

    source: str  # "gpuwidget" or "dcgm"
    _free: float | None


def plan(window_s: float | None, step_s: float | None, now: float) -> tuple[float, float, float]:
    """(start, end, step): ``end`` on a multiple of the step (replies line up between refreshes)."""
    window = DEFAULT_WINDOW_S if window_s is None else min(max(window_s, MIN_STEP_S), MAX_WINDOW_S)
    step = step_s if step_s is not None else max(MIN_STEP_S, window / TARGET_POINTS)
    step = max(step, MIN_STEP_S, window / (MAX_POINTS - 1))
    step = min(step, window)
    end = math.floor(now / step) * step
    return end - math.floor(window / step) * step, end, step


class Cluster:
    """Answers the cluster route for one configuration (one instance per server)."""

    def __init__(self, config: PrometheusConfig | None, fetch: Fetch | None = None) -> None:
        self.config = config
        self._fetch = fetch
        self._cache: dict[tuple[float, float, float], tuple[float, ClusterReply]] = {}
        self._pending: dict[tuple[float, float, float], asyncio.Future[ClusterReply]] = {}
        self.queries_sent = 0

    @property
    def configured(self) -> bool:
        return self.config is not None and bool(self.config.url)

    async def reply(self, window_s: float | None = None, step_s: float | None = None) -> ClusterReply:
        if self.config is None or not self.config.url:
            return {"configured": False, "source": None, "error": None, "step_s": None, "start": None,
                    "end": None, "selector": None, "hosts": []}
        start, end, step = plan(window_s, step_s, time.time())
        key = (start, end, step)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < CACHE_S:
            return cached[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._build(start, end, step))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        reply = await asyncio.shield(pending)
        self._cache = {key: (time.monotonic(), reply)}
        return reply

    async def _build(self, start: float, end: float, step: float) -> ClusterReply:
        config = self.config
        assert config is not None
        reply: ClusterReply = {"configured": True, "source": None, "error": None, "step_s": step, "start": start,
                                 "end": end, "selector": config.selector, "hosts": []}
        jobs = [(source, query) for source, queries in SOURCES for query in queries]
        outcomes = await asyncio.gather(*(self._range(query, start, end, step) for _, query in jobs),
                                        return_exceptions=True)
        try:
            errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if errors:
                raise errors[0]
            bodies = {(source, query.key): outcome for (source, query), outcome in zip(jobs, outcomes)
                      if not isinstance(outcome, BaseException)}
            # Parsing and aligning an hour of 64 GPUs takes tens of ms: off the event loop.
            gpus = await asyncio.get_running_loop().run_in_executor(
                None, _assemble, config.shown_url, bodies, start, step, int(round((end - start) / step)) + 1)
        except Exception as exc:  # noqa: BLE001 - every failure is told to the sidebar, none raised
            reply["error"] = str(exc) if isinstance(exc, PrometheusError) else \
                f"Prometheus at {config.shown_url}: {type(exc).__name__}: {exc}"
            return reply
        sources = {gpu.pop("source") for gpu in gpus.values()}
        reply["source"] = "gpuwidget" if "gpuwidget" in sources else ("dcgm" if "dcgm" in sources else None)
        hosts: dict[str, list[ClusterGpu]] = {}
        for (host, _), gpu in sorted(gpus.items(), key=lambda item: (item[0][0], _gpu_order(item[1]["gpu"]))):
            hosts.setdefault(host, []).append(gpu)
        reply["hosts"] = [ClusterHost(host=host, gpus=host_gpus) for host, host_gpus in hosts.items()]
        return reply

    async def _range(self, query: Query, start: float, end: float, step: float) -> bytes:
        """The body of one range query; PrometheusError when Prometheus gives none."""
        config = self.config
        assert config is not None
        expression = query.metric + (config.selector or "")
        arguments = urllib.parse.urlencode({"query": expression, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                            "step": f"{step:g}"})
        headers = {"Accept": "application/json", **config.headers}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        request = HTTPRequest(f"{config.url.rstrip('/')}/api/v1/query_range?{arguments}", headers=headers,
                              connect_timeout=config.connect_timeout_s, request_timeout=config.timeout_s,
                              follow_redirects=False)
        self.queries_sent += 1
        fetch = self._fetch or AsyncHTTPClient().fetch
        where = config.shown_url
        try:
            response = await fetch(request)
        except HTTPClientError as exc:
            if exc.code == 599:
                raise PrometheusError(f"Prometheus at {where} did not answer within {config.timeout_s:g} s") from None
            raise PrometheusError(_refusal(where, exc.code, exc.response)) from None
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise PrometheusError(f"Prometheus at {where} cannot be reached: {reason}") from None
        return response.body


def _assemble(where: str, bodies: dict[tuple[str, str], bytes], start: float, step: float,
              points: int) -> dict[tuple[str, str], _Gathered]:
    """Worker thread: the range queries' bodies -> each GPU's reply entry."""
    results = {}
    for (source, key), body in bodies.items():
        query = next(query for query in dict(SOURCES)[source] if query.key == key)
        results[(source, key)] = (query, _matrix(where, body))
    return _gather(results, start, step, points)


def _matrix(where: str, body: bytes) -> list[RangeSeries]:
    try:
        parsed = json.loads(body)
        if parsed.get("status") != "success" or parsed["data"]["resultType"] != "matrix":
            raise ValueError(parsed.get("error") or "not a range-query result")
        result = parsed["data"]["result"]
        if not isinstance(result, list):
            raise ValueError("result is not a list")
        return cast(list[RangeSeries], result)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PrometheusError(f"{where} did not answer like Prometheus's query API ({exc})") from None


def _refusal(where: str, code: int, response: HTTPResponse | None) -> str:
    detail = ""
    if response is not None and response.body:
        try:
            detail = str(json.loads(response.body).get("error") or "")
        except (ValueError, AttributeError):
            detail = ""
    if code in (401, 403):
        return f"Prometheus at {where} refused gpuwidget's credentials (HTTP {code}): set GpuWidget.prometheus_token " \
               "or prometheus_headers"
    if code == 400 or code == 422:
        return f"Prometheus at {where} refused the query (HTTP {code}): {detail or 'bad query'}"
    return f"Prometheus at {where} answered HTTP {code}" + (f": {detail}" if detail else "")


def _gather(results: dict[tuple[str, str], tuple[Query, list[RangeSeries]]], start: float, step: float,
            points: int) -> dict[tuple[str, str], _Gathered]:
    """(host, GPU key) -> the GPU's reply entry (plus its ``source``), gpuwidget's series first."""
    gpus: dict[tuple[str, str], _Gathered] = {}
    by_uuid: dict[str, tuple[str, str]] = {}
    for source, queries in SOURCES:
        taken: set[tuple[str, str]] = set()  # GPUs this source reports
        for query in queries:
            if query.key == "holder":
                continue
            for series in results[(source, query.key)][1]:
                labels = series.get("metric") or {}
                host = labels.get("Hostname") or labels.get("instance") or "unknown host"
                gpu_label = str(labels.get("gpu", ""))
                uuid = labels.get("UUID") or None
                identity = _identity(labels)
                if labels.get("GPU_I_ID"):  # a MIG instance: its GPU's index and its own GPU instance id
                    gpu_label = f"{gpu_label}/GI{labels['GPU_I_ID']}"
                key = by_uuid.get(identity) if identity else None
                key = key or (host, identity or gpu_label)
                entry = gpus.get(key)
                if entry is not None and entry["source"] != source:
                    continue  # gpuwidget's series already describe this GPU
                if entry is None:
                    entry = gpus[key] = {"gpu": gpu_label, "uuid": uuid, "model": labels.get("modelName") or None,
                                         "holder": None, "util": [None] * points,
                                         "memory_used_bytes": [None] * points, "memory_total_bytes": None,
                                         "power_w": [None] * points, "source": source, "_free": None}
                    if identity:
                        by_uuid[identity] = key
                taken.add(key)
                values = _aligned(series.get("values") or [], start, step, points, query.factor)
                if query.key == "util":
                    entry["util"] = values
                elif query.key == "memory_used":
                    entry["memory_used_bytes"] = values
                elif query.key == "power":
                    entry["power_w"] = values
                elif query.key == "memory_total":
                    entry["memory_total_bytes"] = _last(values)
                elif query.key == "memory_free":
                    entry["_free"] = _last(values)
                if source == "dcgm":
                    entry["holder"] = entry["holder"] or _pod(labels)
    for entry in gpus.values():
        free = entry.pop("_free")
        used = _last(entry["memory_used_bytes"])
        if entry["memory_total_bytes"] is None and free is not None and used is not None:
            entry["memory_total_bytes"] = used + free
    _holders(gpus, by_uuid, results[("gpuwidget", "holder")][1], start, step, points)
    return gpus


def _identity(labels: dict[str, str]) -> str:
    """Which GPU a series is of: its UUID, and for a MIG instance (both exporters label it with its GPU's
    UUID) the GPU instance id after it; "" without a UUID."""
    uuid = labels.get("UUID") or ""
    instance = labels.get("GPU_I_ID") or ""
    return f"{uuid}/GI{instance}" if uuid and instance else uuid


def _holders(gpus: dict[tuple[str, str], _Gathered], by_uuid: dict[str, tuple[str, str]],
             series_list: list[RangeSeries], start: float, step: float, points: int) -> None:
    """Each GPU's holder: the notebook (else kernel) holding most of its memory at the newest point."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for series in series_list:
        labels = series.get("metric") or {}
        key = by_uuid.get(_identity(labels))
        if key is None:
            continue
        held = _last(_aligned(series.get("values") or [], start, step, points, 1.0), newest_only=True)
        if held is None:
            continue
        kernel = labels.get("kernel_id") or ""
        name = labels.get("notebook") or (f"kernel {kernel[:8]}" if kernel else "")
        if name and held > best.get(key, (-1.0, ""))[0]:
            best[key] = (held, name)
    for key, (_, name) in best.items():
        gpus[key]["holder"] = name


def _aligned(values: list[list[Any]], start: float, step: float, points: int, factor: float) -> list[float | None]:
    out: list[float | None] = [None] * points
    per_step = 1.0 / step
    isfinite, floor = math.isfinite, math.floor
    for t, text in values:  # [unix s, "value"]: Prometheus's values at start + k * step
        try:
            index = floor((t - start) * per_step + 0.5)
            value = float(text) * factor
        except (TypeError, ValueError):
            continue
        if 0 <= index < points and isfinite(value):
            out[index] = value
    return out


def _last(values: list[float | None], newest_only: bool = False) -> float | None:
    if newest_only:
        return values[-1] if values else None
    return next((value for value in reversed(values) if value is not None), None)


def _pod(labels: dict[str, str]) -> str | None:
    """dcgm-exporter's Kubernetes mapping: the pod the GPU is allocated to (``exported_pod`` when relabelled)."""
    pod = labels.get("exported_pod") or labels.get("pod")
    namespace = labels.get("exported_namespace") or labels.get("namespace")
    if not pod:
        return None
    return f"{namespace}/{pod}" if namespace else pod


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)



class ClusterHandler(_ApiHandler):
    """``GET /gpuwidget/api/cluster?window_s=3600[&step_s=15]``: authenticated and authorized like the others."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        window = seconds_argument(self, "window_s", MAX_WINDOW_S)
        step = seconds_argument(self, "step_s", MAX_WINDOW_S)
        if window == 0 or step == 0:
            raise web.HTTPError(400, "window_s and step_s must be positive")
        cluster: Cluster = self.settings["gpuwidget_cluster"]
        await self.finish(json.dumps(await cluster.reply(window, step)))
