"""The cluster view through a real Prometheus (Debian's package): two gpuwidget servers and a dcgm-exporter file.

One setup for the module (tests/prom.py): Prometheus scrapes node-a and node-b (Jupyter servers
over 8 fake GPUs each) every second, and a dcgm-exporter file with node-a's GPUs and dgx-c's.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets import TraitError

from gpuwidget.server import GpuWidget
from gpuwidget.server.cluster import SOURCES, Cluster, PrometheusConfig, check_selector

import prom

# Runs a real Prometheus and judges its time-outs: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

WINDOW = {"window_s": "30", "step_s": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[prom.ClusterSetup]:
    with prom.cluster(tmp_path_factory.mktemp("prom")) as started:
        yield started


def get_json(url: str, token: str | None = None) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("application/json")
        return json.loads(reply.read())


def cluster_route(setup: prom.ClusterSetup, **params: str) -> dict:
    viewer = setup.viewer
    return get_json(viewer.api(f"gpuwidget/api/cluster?{urllib.parse.urlencode(params or WINDOW)}"), viewer.token)


def newest(values: list) -> float | None:
    return next((value for value in reversed(values) if value is not None), None)


def complete(reply: dict, hosts: dict[str, int]) -> bool:
    """Every expected host with its GPU count, and a value in every GPU's series."""
    found = {host["host"]: host["gpus"] for host in reply["hosts"]}
    return {host: len(gpus) for host, gpus in found.items()} == hosts and all(
        newest(gpu["util"]) is not None and newest(gpu["power_w"]) is not None
        for gpus in found.values() for gpu in gpus)


def wait_for(read, hosts: dict[str, int], timeout: float = 45) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        reply = read()
        if complete(reply, hosts):
            return reply
        assert time.monotonic() < deadline, f"the cluster never showed {hosts}: {json.dumps(reply)[:2000]}"
        time.sleep(0.5)


def by_host(reply: dict) -> dict[str, dict[str, dict]]:
    return {host["host"]: {gpu["gpu"]: gpu for gpu in host["gpus"]} for host in reply["hosts"]}


def read_with(setup: prom.ClusterSetup, selector: str | None):
    cluster = Cluster(PrometheusConfig(url=setup.prometheus_url, selector=check_selector(selector)))
    return lambda: asyncio.run(cluster.reply(30, 1))


def scraped(setup: prom.ClusterSetup, query: str, count: int, timeout: float = 45) -> None:
    """Wait until Prometheus has ``count`` series for ``query`` (both servers' GPUs scraped, say)."""
    deadline = time.monotonic() + timeout
    url = f"{setup.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    while len(get_json(url)["data"]["result"]) != count:
        assert time.monotonic() < deadline, f"Prometheus never had {count} series of {query}"
        time.sleep(0.5)


def test_the_cluster_route_reads_both_exporters_and_prefers_gpuwidgets_own_series(setup):
    # Until a server's sampler is up, its GPUs are dcgm-exporter's alone (node-a's are in both): wait
    # until both servers' GPUs were in 2 s ago (the route's window ends on a whole second).
    scraped(setup, "gpuwidget_gpu_power_watts offset 2s", 16)
    reply = wait_for(lambda: cluster_route(setup), {"node-a": 8, "node-b": 8, "dgx-c": 4})
    assert reply["configured"] and reply["error"] is None and reply["selector"] is None
    assert reply["source"] == "gpuwidget" and reply["step_s"] == 1
    assert reply["end"] - reply["start"] == 30 and all(len(gpu["util"]) == 31 for gpu in reply["hosts"][0]["gpus"])
    gpus = by_host(reply)
    for number, host in enumerate(prom.HOSTS):
        for index in range(8):
            gpu = gpus[host][str(index)]
            assert gpu["uuid"] == prom.gpu_uuid(number, index) and gpu["model"] == prom.MODEL
            assert newest(gpu["util"]) == pytest.approx(prom.gpu_util_percent(number, index) / 100)
            assert newest(gpu["memory_used_bytes"]) == prom.gpu_memory_used(number, index)
            assert gpu["memory_total_bytes"] == prom.GPU_MEMORY_TOTAL
            # node-a's GPUs are in dcgm-exporter's file too: gpuwidget's figure is the one read.
            assert newest(gpu["power_w"]) == pytest.approx(prom.gpu_power_w(number, index))
    assert newest(gpus["node-a"]["7"]["util"]) == 0  # the idle one
    # dgx-c runs only dcgm-exporter: percent -> 0..1, MiB -> bytes, total = used + free, its pod as holder.
    for index in range(prom.DCGM_GPUS):
        gpu = gpus["dgx-c"][str(index)]
        assert newest(gpu["util"]) == pytest.approx(prom.gpu_util_percent(2, index) / 100)
        assert newest(gpu["memory_used_bytes"]) == prom.gpu_memory_used(2, index)
        assert gpu["memory_total_bytes"] == prom.GPU_MEMORY_TOTAL
        assert newest(gpu["power_w"]) == pytest.approx(prom.gpu_power_w(2, index) + prom.DCGM_POWER_OFFSET_W)
    assert gpus["dgx-c"]["0"]["holder"] == "research/train-llm-0" and gpus["dgx-c"]["1"]["holder"] is None


def test_the_selector_chooses_whose_gpus_are_read(setup):
    dcgm_only = wait_for(read_with(setup, '{job="dcgm"}'), {"node-a": 8, "dgx-c": 4})
    assert dcgm_only["source"] == "dcgm" and dcgm_only["selector"] == '{job="dcgm"}'
    node_a = by_host(dcgm_only)["node-a"]["2"]
    assert newest(node_a["power_w"]) == pytest.approx(prom.gpu_power_w(0, 2) + prom.DCGM_POWER_OFFSET_W)
    jupyter_pods = wait_for(read_with(setup, "{pod=~'jupyter-.*', Hostname!=\"node-a\"}"), {"node-b": 8})
    assert jupyter_pods["source"] == "gpuwidget"
    nothing = read_with(setup, '{job="no-such-job"}')()
    assert nothing["hosts"] == [] and nothing["source"] is None and nothing["error"] is None


def test_gpuwidget_and_dcgm_series_join_on_dcgm_label_names(setup):
    """The README's PromQL: gpuwidget's figure next to dcgm-exporter's for the same GPU, joined on UUID."""
    query = "gpuwidget_gpu_utilization_ratio - on (UUID) group_left () (DCGM_FI_DEV_GPU_UTIL / 100)"
    deadline = time.monotonic() + 30
    while True:
        result = get_json(f"{setup.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': query})}")
        rows = result["data"]["result"]
        if len(rows) == 8:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    assert {row["metric"]["Hostname"] for row in rows} == {"node-a"}
    assert all(float(row["value"][1]) == pytest.approx(0) for row in rows)


def test_prometheus_unreachable_slow_or_refusing_the_query_gives_a_clear_message(setup):
    port = prom.free_port()  # nobody listens there
    down = asyncio.run(Cluster(PrometheusConfig(url=f"http://user:secret@127.0.0.1:{port}")).reply(30, 1))
    assert down["configured"] and down["hosts"] == [] and down["source"] is None
    assert down["error"].startswith(f"Prometheus at http://127.0.0.1:{port} cannot be reached")
    assert "secret" not in down["error"]
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        slow = asyncio.run(Cluster(PrometheusConfig(url=url, timeout_s=0.5)).reply(30, 1))
    assert slow["error"] == f"Prometheus at {url} did not answer within 0.5 s"
    refused = asyncio.run(Cluster(PrometheusConfig(url=setup.prometheus_url, selector='{job=~"("}')).reply(30, 1))
    assert refused["error"].startswith(f"Prometheus at {setup.prometheus_url} refused the query (HTTP 400): ")
    assert "parse" in refused["error"] or "error" in refused["error"]
    not_prometheus = setup.dcgm_url.rsplit("/", 1)[0]  # an HTTP server, but not Prometheus
    wrong = asyncio.run(Cluster(PrometheusConfig(url=not_prometheus)).reply(30, 1))
    assert wrong["error"] == f"Prometheus at {not_prometheus} answered HTTP 404"


def test_the_cluster_route_needs_the_servers_login(setup):
    with pytest.raises(urllib.error.HTTPError) as refused:
        get_json(setup.viewer.api("gpuwidget/api/cluster"))
    assert refused.value.code == 403
    devices = get_json(setup.viewer.api("gpuwidget/api/devices"), setup.viewer.token)
    assert devices["cluster"] is True
    other = setup.servers[1]
    assert get_json(other.api("gpuwidget/api/devices"), other.token)["cluster"] is False
    unset = get_json(other.api("gpuwidget/api/cluster"), other.token)
    assert unset["configured"] is False and unset["hosts"] == []


@pytest.mark.parametrize("selector", [
    '{job="gpu"} or vector(1)',
    'up{job="gpu"}',
    '{job="gpu"}[5m]',
    '{job="gpu"} offset 1h',
    '{job="a\\"} or vector(1) or {x="y"}',
    '{job="gpu"}}',
    '{__name__="up"}',
    "{job=gpu}",
    "sum(up)",
])
def test_a_selector_that_would_add_promql_is_refused(selector):
    with pytest.raises(ValueError):
        check_selector(selector)
    with pytest.raises(TraitError):
        GpuWidget(cluster_selector=selector)


def test_prometheus_url_must_be_http():
    with pytest.raises(TraitError):
        GpuWidget(prometheus_url="prometheus:9090")
    assert GpuWidget(prometheus_url=" https://prom.example.org/ ").prometheus_url == "https://prom.example.org/"


def test_label_matcher_sets_are_accepted():
    assert check_selector('{job="gpu",pod=~"user-.*"}') == '{job="gpu",pod=~"user-.*"}'
    assert check_selector(" { namespace != 'kube-system' , pod!~\"x\\\"y\" , } ") == \
        "{ namespace != 'kube-system' , pod!~\"x\\\"y\" , }"
    assert check_selector("") is None and check_selector("{}") is None
    assert GpuWidget(cluster_selector='{job="gpu"}').cluster_selector == '{job="gpu"}'


# The README's PromQL examples, checked by Prometheus's own engine (promtool) on series labelled
# as gpuwidget's collector and dcgm-exporter label them.
README_QUERIES = {
    "utilisation of the GPUs each notebook holds":
        "(DCGM_FI_DEV_GPU_UTIL / 100) * on (UUID) group_right () (gpuwidget_kernel_gpu_memory_used_bytes > bool 0)",
    "starved cells with their cause":
        "gpuwidget_kernel_data_wait_ratio * on (kernel_id, Hostname) group_left (cause) gpuwidget_kernel_watch_info"
        " > 0.5",
}


def test_the_readme_promql_joins_work_in_prometheus(tmp_path):
    import subprocess

    from gpuwidget.server.metrics import GPU_LABELS, KERNEL_LABELS

    if not os.access(prom.PROMTOOL, os.X_OK):
        pytest.skip(f"needs {prom.PROMTOOL} (make prometheus)")
    assert set(GPU_LABELS) == {"gpu", "UUID", "modelName", "Hostname", "GPU_I_ID", "GPU_I_PROFILE"}
    assert set(KERNEL_LABELS) == {"kernel_id", "notebook", "Hostname"}
    gpu = 'gpu="0",UUID="GPU-1",modelName="H100",Hostname="node-a"'
    kernel = 'kernel_id="k1",notebook="work/train.ipynb",Hostname="node-a"'
    held = f'{gpu},kernel_id="k1",notebook="work/train.ipynb"'  # a kernel's memory on a GPU
    tests = f"""
rule_files: []
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'DCGM_FI_DEV_GPU_UTIL{{{gpu},job="dcgm"}}'
        values: '50 50'
      - series: 'gpuwidget_kernel_gpu_memory_used_bytes{{{held},job="jupyter"}}'
        values: '3e9 3e9'
      - series: 'gpuwidget_kernel_data_wait_ratio{{{kernel},job="jupyter"}}'
        values: '0.8 0.8'
      - series: 'gpuwidget_kernel_watch_info{{{kernel},state="finished",cause="dataloader-starved",job="jupyter"}}'
        values: '1 1'
    promql_expr_test:
      - expr: '{README_QUERIES["utilisation of the GPUs each notebook holds"]}'
        eval_time: 1m
        exp_samples:
          - labels: '{{{held},job="jupyter"}}'
            value: 0.5
      - expr: '{README_QUERIES["starved cells with their cause"]}'
        eval_time: 1m
        exp_samples:
          - labels: '{{{kernel},job="jupyter",cause="dataloader-starved"}}'
            value: 0.8
"""
    (tmp_path / "readme_test.yml").write_text(tests)
    result = subprocess.run([prom.PROMTOOL, "test", "rules", str(tmp_path / "readme_test.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for query in README_QUERIES.values():
        assert " ".join(query.split()) in " ".join(readme.split()), query


def test_an_hour_backfilled_is_read_at_the_sidebars_resolution(tmp_path):
    """The sidebar's request (window_s=3600, default step): 241 points per GPU from a Prometheus
    holding an hour of history (tests/prom.py's backfill, as the browser tests use it)."""
    prom.require_prometheus()
    jobs = [("jupyter-node-a", "127.0.0.1:1", {"pod": "jupyter-node-a"}, 0),
            ("jupyter-node-b", "127.0.0.1:2", {"pod": "jupyter-node-b"}, 1), ("dcgm", "127.0.0.1:3", {}, -1)]
    history_end = math.floor(time.time()) - 59.5  # half a second off the steps (multiples of 15 s)
    data = prom.backfill(tmp_path, prom.history_openmetrics(jobs, history_end, 3600))
    port = prom.free_port()
    process = prom.start_prometheus(tmp_path, prom.prometheus_config([]), port, data=data)
    try:
        reply = asyncio.run(Cluster(PrometheusConfig(url=f"http://127.0.0.1:{port}")).reply(3600))
    finally:
        prom.stop_process(process)
    assert reply["error"] is None and reply["step_s"] == 15 and reply["end"] - reply["start"] == 3600
    gpus = by_host(reply)
    assert {host: len(host_gpus) for host, host_gpus in gpus.items()} == {"node-a": 8, "node-b": 8, "dgx-c": 4}
    util = gpus["node-b"]["3"]["util"]
    assert len(util) == 241 and sum(value is not None for value in util) >= 230  # the last minute is not backfilled
    # Each step shows the newest backfilled sample at or before it (samples every 15 s up to history_end).
    for j, value in enumerate(util):
        k = math.floor((reply["start"] + 15 * j - (history_end - 3600)) / 15 + 1e-6)  # the sample's number
        if 0 <= k <= 240:
            assert value == pytest.approx(prom.history_util_percent(1, 3, k) / 100), j
    assert set(gpus["node-a"]["7"]["util"]) <= {0.0, None}  # idle all hour
    assert gpus["dgx-c"]["0"]["holder"] == "research/train-llm-0"


def test_the_token_and_headers_reach_prometheus_and_a_refusal_says_so():
    """A Prometheus behind an auth proxy (as in Mimir, Thanos or a hosted service): 401 without credentials."""
    import http.server
    import threading

    seen: list[dict[str, str]] = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append({**self.headers, "path": self.path})
            ok = self.headers.get("Authorization") == "Bearer s3cret" and self.headers.get("X-Scope-OrgID") == "team"
            body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}} if ok
                              else {"status": "error", "error": "unauthorized"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        refused = asyncio.run(Cluster(PrometheusConfig(url=url)).reply(60))
        assert refused["error"] == (f"Prometheus at {url} refused gpuwidget's credentials (HTTP 401): "
                                    "set GpuWidget.prometheus_token or prometheus_headers")
        allowed = asyncio.run(Cluster(PrometheusConfig(url=url, token="s3cret", headers={"X-Scope-OrgID": "team"},
                                                       selector='{job="gpu"}')).reply(60))
    finally:
        server.shutdown()
        server.server_close()
    assert allowed["error"] is None and allowed["hosts"] == [] and allowed["source"] is None
    assert len(seen) == 2 * 9 and all(headers["Accept"] == "application/json" for headers in seen)
    queries = [urllib.parse.parse_qs(urllib.parse.urlsplit(headers["path"]).query)["query"][0] for headers in seen[9:]]
    assert sorted(queries) == sorted(f'{query.metric}{{job="gpu"}}' for _, source in SOURCES for query in source)
