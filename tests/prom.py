"""A small real cluster for tests: Prometheus scraping two Jupyter servers with gpuwidget and a dcgm-exporter file.

:func:`start_cluster` starts, on loopback and free ports:

* two Jupyter servers (subprocesses of this file, each over a fake NVML of 8 GPUs with their own
  UUIDs and utilisations, ``GpuWidget.metrics_hostname`` ``node-a`` and ``node-b``); the first one
  (under a JupyterHub-like base URL) has ``GpuWidget.prometheus_url`` set, so its
  ``/gpuwidget/api/cluster`` reads the others back; with ``lab=True`` it is a JupyterLab;
* a static file in dcgm-exporter's format, served by a tiny HTTP server: node-a's 8 GPUs (the same
  UUIDs as gpuwidget's) and 4 GPUs of ``dgx-c``, where only dcgm-exporter runs;
* Prometheus (``/usr/bin/prometheus``, scrape interval 1 s, TSDB in a temporary folder) scraping
  all three, Jupyter's ``/metrics`` with the servers' tokens as bearer tokens.

It returns a :class:`ClusterSetup` with every URL, for tests/test_prometheus.py and the
sidebar's browser tests (tests/ui/). Where the ``prometheus`` package is missing,
:func:`require_prometheus` skips with the way to install it.

Run as ``python tests/prom.py jupyter ...`` it is one of those Jupyter servers (used by
:func:`start_cluster`; the fake NVML has to be installed in the server's own process).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROMETHEUS = os.environ.get("GPUWIDGET_PROMETHEUS", "/usr/bin/prometheus")
PROMTOOL = os.environ.get("GPUWIDGET_PROMTOOL", "/usr/bin/promtool")
HERE = Path(__file__).resolve().parent
GIB = 1024**3
MIB = 1024**2
SCRAPE_INTERVAL_S = 1

# The two gpuwidget hosts, and the dcgm-only host.
HOSTS = ("node-a", "node-b")
DCGM_HOST = "dgx-c"
DCGM_GPUS = 4


def require_prometheus() -> None:
    """Skip the calling test (module) when Debian's prometheus package is not installed."""
    import pytest

    if not (os.access(PROMETHEUS, os.X_OK)):
        pytest.skip(f"tests with a real Prometheus need {PROMETHEUS}: run `make prometheus` as root "
                    "(apt-get install -y prometheus)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ what each host reports


def gpu_uuid(host_number: int, index: int) -> str:
    """Distinct UUIDs per host (host 0 = node-a, 1 = node-b, 2 = dgx-c)."""
    number = 0xB000 + 0x100 * host_number + index
    return f"GPU-{number:08x}-1111-2222-3333-{number:012x}"


def gpu_util_percent(host_number: int, index: int) -> int:
    """Each GPU its own utilisation; the last GPU of each host idle."""
    return 0 if index == 7 or (host_number == 2 and index == DCGM_GPUS - 1) else 10 * (index + 1) + host_number


def gpu_memory_used(host_number: int, index: int) -> int:
    return (index + 1 + host_number) * GIB


def gpu_power_w(host_number: int, index: int) -> float:
    return 100.0 + 10 * index + host_number


GPU_MEMORY_TOTAL = 80 * GIB
# dcgm-exporter reads power its own way: its figure differs a little from NVML's (and tells whose series were read).
DCGM_POWER_OFFSET_W = 0.5
MODEL = "NVIDIA H100 80GB HBM3"


DCGM_GPUS_LISTED = [(0, HOSTS[0], index) for index in range(8)] + [(2, DCGM_HOST, index) for index in range(DCGM_GPUS)]


def dcgm_labels(host_number: int, host: str, index: int) -> dict[str, str]:
    """The labels dcgm-exporter puts on one GPU's series (dgx-c's GPU 0 mapped to a Kubernetes pod)."""
    labels = {"gpu": str(index), "UUID": gpu_uuid(host_number, index),
              "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0", "device": f"nvidia{index}", "modelName": MODEL,
              "Hostname": host, "DCGM_FI_DRIVER_VERSION": "580.65.06"}
    if host == DCGM_HOST and index == 0:
        labels.update({"namespace": "research", "pod": "train-llm-0", "container": "trainer"})
    return labels


def dcgm_values(host_number: int, index: int, util_percent: float | None = None) -> dict[str, float]:
    """dcgm-exporter's readings of one GPU in its own units (percent, MiB, W)."""
    util = gpu_util_percent(host_number, index) if util_percent is None else util_percent
    used = gpu_memory_used(host_number, index) if util_percent is None else _memory_for(util)
    return {"DCGM_FI_DEV_GPU_UTIL": util, "DCGM_FI_DEV_FB_USED": used // MIB,
            "DCGM_FI_DEV_FB_FREE": (GPU_MEMORY_TOTAL - used) // MIB,
            "DCGM_FI_DEV_POWER_USAGE": (gpu_power_w(host_number, index) if util_percent is None
                                        else _power_for(util)) + DCGM_POWER_OFFSET_W,
            "DCGM_FI_DEV_GPU_TEMP": 60}


DCGM_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
}


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{key}="{value}"' for key, value in labels.items())


def dcgm_text() -> str:
    """dcgm-exporter's exposition for node-a's 8 GPUs and dgx-c's 4 (units as dcgm reports them)."""
    lines = []
    for name, text in DCGM_HELP.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
        for host_number, host, index in DCGM_GPUS_LISTED:
            lines.append(f"{name}{{{_labels(dcgm_labels(host_number, host, index))}}} "
                         f"{dcgm_values(host_number, index)[name]}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ an hour of history (backfill)


def history_util_percent(host_number: int, index: int, k: int) -> float:
    """A GPU's utilisation at step ``k`` of the backfilled past: jobs of ~10 minutes, some GPUs idle between."""
    if index == 7 or (host_number == 2 and index == DCGM_GPUS - 1):
        return 0.0  # always idle, as now
    job = (k + 11 * index + 29 * host_number) // 40
    if (job + index + host_number) % 4 == 0:
        return 0.0
    return float(min(100, max(5, gpu_util_percent(host_number, index) + 25 * ((k * (index + 3)) % 7 - 3) // 3)))


def _memory_for(util_percent: float) -> int:
    return int((2 + util_percent * 0.6) * GIB) if util_percent > 0 else GIB // 2


def _power_for(util_percent: float) -> float:
    return 90.0 + 5.0 * util_percent


def history_openmetrics(jobs: Sequence[tuple[str, str, dict[str, str], int]], end: float, window_s: float = 3600,
                        step_s: float = 15) -> str:
    """OpenMetrics with timestamps (for ``promtool tsdb create-blocks-from openmetrics``): the past
    ``window_s`` up to ``end`` of every GPU, labelled exactly as Prometheus labels the live scrapes,
    so the backfilled and the scraped samples are one series.

    ``jobs``: (job, instance, target labels, host number) per gpuwidget server, and ("dcgm", instance, {}, -1).
    """
    families: dict[str, list[str]] = {}
    steps = int(window_s // step_s)
    times = [end - (steps - k) * step_s for k in range(steps + 1)]
    for job, instance, target_labels, host_number in jobs:
        scrape_labels = {"job": job, "instance": instance, **target_labels}
        if host_number >= 0:
            for index in range(8):
                labels = _labels({"gpu": str(index), "UUID": gpu_uuid(host_number, index), "modelName": MODEL,
                                  "Hostname": HOSTS[host_number], **scrape_labels})
                for k, t in enumerate(times):
                    util = history_util_percent(host_number, index, k)
                    for name, value in (("gpuwidget_gpu_utilization_ratio", util / 100),
                                        ("gpuwidget_gpu_memory_used_bytes", float(_memory_for(util))),
                                        ("gpuwidget_gpu_memory_total_bytes", float(GPU_MEMORY_TOTAL)),
                                        ("gpuwidget_gpu_power_watts", _power_for(util))):
                        families.setdefault(name, []).append(f"{name}{{{labels}}} {value} {t:.3f}")
            continue
        for number, host, index in DCGM_GPUS_LISTED:
            labels = _labels({**dcgm_labels(number, host, index), **scrape_labels})
            for k, t in enumerate(times):
                for name, value in dcgm_values(number, index, history_util_percent(number, index, k)).items():
                    families.setdefault(name, []).append(f"{name}{{{labels}}} {value} {t:.3f}")
    lines: list[str] = []
    for name, samples in families.items():
        lines.append(f"# TYPE {name} gauge")
        lines += samples
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def backfill(workdir: Path, text: str) -> Path:
    """A TSDB folder holding ``text`` (OpenMetrics), built by promtool; Prometheus starts on it."""
    source = workdir / "history.om"
    source.write_text(text)
    data = workdir / "tsdb"
    subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                   check=True, capture_output=True, timeout=120)
    return data


# ------------------------------------------------------------------ pieces


@dataclass
class JupyterServer:
    hostname: str
    url: str  # with the base URL, ending in "/"
    token: str
    port: int
    base_url: str
    process: subprocess.Popen | None = None
    log: Path | None = None

    def api(self, path: str) -> str:
        return f"{self.url}{path}"


@dataclass
class ClusterSetup:
    servers: list[JupyterServer]
    prometheus_url: str
    dcgm_url: str
    workdir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    http_servers: list[http.server.HTTPServer] = field(default_factory=list)

    @property
    def viewer(self) -> JupyterServer:
        """The server whose cluster route reads Prometheus (the first)."""
        return self.servers[0]

    def close(self) -> None:
        for process in self.processes:
            stop_process(process)
        for server in self.http_servers:
            server.shutdown()
            server.server_close()


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def serve_text(text: str, port: int = 0) -> http.server.ThreadingHTTPServer:
    """A loopback HTTP server answering ``text`` on /metrics (a thread of this process)."""
    body = text.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="dcgm-file").start()
    return server


def prometheus_config(jobs: Sequence[tuple[str, str, str, str | None, dict[str, str]]],
                      interval_s: int = SCRAPE_INTERVAL_S) -> str:
    """YAML for Prometheus: one job per (name, host:port, metrics path, bearer token or None, target labels)."""
    lines = ["global:", f"  scrape_interval: {interval_s}s", f"  scrape_timeout: {interval_s}s",
             f"  evaluation_interval: {interval_s}s", "scrape_configs:"]
    for name, target, path, token, labels in jobs:
        lines += [f"  - job_name: {name}", f"    metrics_path: {path}"]
        if token:
            lines += ["    authorization:", "      type: Bearer", f"      credentials: {token}"]
        lines += ["    static_configs:", f"      - targets: ['{target}']"]
        if labels:
            lines += ["        labels:"] + [f"          {key}: '{value}'" for key, value in labels.items()]
    return "\n".join(lines) + "\n"


def start_prometheus(workdir: Path, config: str, port: int, data: Path | None = None,
                     extra: Sequence[str] = ()) -> subprocess.Popen:
    """Prometheus on 127.0.0.1:``port`` with ``config``; returns once it is ready."""
    config_file = workdir / "prometheus.yml"
    config_file.write_text(config)
    data = data or workdir / "tsdb"
    log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - the process keeps writing to it
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config_file}", f"--storage.tsdb.path={data}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/-/ready", process, workdir / "prometheus.log", 60)
    return process


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            time.sleep(0.2)
    stop_process(process)
    raise RuntimeError(f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


def start_jupyter(workdir: Path, number: int, port: int, *, base_url: str = "/", lab: bool = False,
                  args: Sequence[str] = ()) -> JupyterServer:
    """One Jupyter server (subprocess) over 8 fake GPUs as host ``HOSTS[number]``; not yet waited for."""
    hostname = HOSTS[number]
    token = f"token-{hostname}"
    root = workdir / hostname
    root.mkdir(exist_ok=True)
    server = JupyterServer(hostname, f"http://127.0.0.1:{port}{base_url}", token, port, base_url,
                           log=workdir / f"{hostname}.log")
    command = [sys.executable, str(Path(__file__).resolve()), "jupyter", "--number", str(number),
               "--app", "lab" if lab else "server", "--",
               f"--port={port}", "--ip=127.0.0.1", "--no-browser", f"--IdentityProvider.token={token}",
               f"--ServerApp.base_url={base_url}", f"--ServerApp.root_dir={root}",
               "--ServerApp.jpserver_extensions={'gpuwidget': True}", f"--GpuWidget.metrics_hostname={hostname}",
               "--GpuWidget.interval=0.5", "--ServerApp.log_level=WARN", *args]
    if os.geteuid() == 0:
        command.append("--allow-root")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(workdir / f"runtime-{hostname}")}
    with open(server.log, "w") as log:  # type: ignore[arg-type]
        server.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
                                          start_new_session=True)
    return server


@contextlib.contextmanager
def cluster(workdir: Path | None = None, *, lab: bool = False, viewer_args: Sequence[str] = (),
            selector: str | None = None, history_s: float = 0) -> Iterator[ClusterSetup]:
    """:func:`start_cluster` as a context manager (everything stopped at the end)."""
    setup = start_cluster(workdir, lab=lab, viewer_args=viewer_args, selector=selector, history_s=history_s)
    try:
        yield setup
    finally:
        setup.close()


def start_cluster(workdir: Path | None = None, *, lab: bool = False, viewer_args: Sequence[str] = (),
                  selector: str | None = None, history_s: float = 0) -> ClusterSetup:
    """Two gpuwidget Jupyter servers, a dcgm-exporter file and Prometheus scraping them, all ready.

    The first server (base URL ``/user/alice/``; a JupyterLab with ``lab=True``, plus
    ``viewer_args``) reads the cluster from the Prometheus (``GpuWidget.prometheus_url``, and
    ``cluster_selector`` when ``selector`` is given). With ``history_s``, Prometheus starts with
    that much past of every GPU, backfilled with promtool (jobs come and go, some GPUs stay idle),
    and the live scrapes go on from there: a sidebar shows a full hour at once. Call
    :meth:`ClusterSetup.close` when done. From a browser test::

        with prom.cluster(tmp_path, lab=True, history_s=3600) as setup:
            page.goto(f"{setup.viewer.url}lab?token={setup.viewer.token}")
    """
    require_prometheus()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="gpuwidget-prom-"))
    ports = [free_port() for _ in range(3)]
    prometheus_port = ports[2]
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    viewer = [f"--GpuWidget.prometheus_url={prometheus_url}", *viewer_args]
    if selector:
        viewer.append(f"--GpuWidget.cluster_selector={selector}")
    servers: list[JupyterServer] = []
    setup = ClusterSetup(servers, prometheus_url, "", workdir)
    try:
        servers.append(start_jupyter(workdir, 0, ports[0], base_url="/user/alice/", lab=lab, args=viewer))
        servers.append(start_jupyter(workdir, 1, ports[1]))
        setup.processes += [server.process for server in servers if server.process is not None]
        dcgm = serve_text(dcgm_text())
        setup.http_servers.append(dcgm)
        setup.dcgm_url = f"http://127.0.0.1:{dcgm.server_address[1]}/metrics"
        jobs = [(f"jupyter-{server.hostname}", f"127.0.0.1:{server.port}", f"{server.base_url}metrics",
                 server.token, {"pod": f"jupyter-{server.hostname}"}) for server in servers]
        jobs.append(("dcgm", f"127.0.0.1:{dcgm.server_address[1]}", "/metrics", None, {}))
        data = None
        if history_s:
            past = [(name, target, labels, number) for number, (name, target, _, _, labels) in enumerate(jobs)]
            past[-1] = ("dcgm", past[-1][1], {}, -1)
            data = backfill(workdir, history_openmetrics(past, time.time() - 2 * SCRAPE_INTERVAL_S, history_s))
        setup.processes.append(start_prometheus(workdir, prometheus_config(jobs), prometheus_port, data=data))
        for server in servers:
            assert server.process is not None and server.log is not None
            wait_ready(f"{server.url}api/status?token={server.token}", server.process, server.log, 90)
    except BaseException:
        setup.close()
        raise
    return setup


# ------------------------------------------------------------------ the Jupyter server process


def _serve_jupyter(number: int, app: str, argv: list[str]) -> None:
    from fakenvml import FakeNvml, make_gpu

    fake = FakeNvml([make_gpu(index, uuid=gpu_uuid(number, index), util=gpu_util_percent(number, index),
                              memory_used=gpu_memory_used(number, index), memory_total=GPU_MEMORY_TOTAL,
                              power_mw=int(gpu_power_w(number, index) * 1000), name=MODEL)
                     for index in range(8)], real_time=True)
    with fake.patched():
        if app == "lab":
            from jupyterlab.labapp import LabApp

            LabApp.launch_instance(argv=argv)
        else:
            from jupyter_server.serverapp import ServerApp

            ServerApp.launch_instance(argv=argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    jupyter = commands.add_parser("jupyter", help="a Jupyter server over 8 fake GPUs (host HOSTS[number])")
    jupyter.add_argument("--number", type=int, default=0)
    jupyter.add_argument("--app", choices=("server", "lab"), default="server")
    jupyter.add_argument("argv", nargs="*")
    up = commands.add_parser("up", help="start the whole setup and print its URLs until interrupted")
    up.add_argument("--lab", action="store_true", help="the first server a JupyterLab")
    up.add_argument("--history", type=float, default=0, help="seconds of backfilled past (e.g. 3600)")
    options = parser.parse_args()
    if options.command == "jupyter":
        _serve_jupyter(options.number, options.app, options.argv)
        return
    with cluster(lab=options.lab, history_s=options.history) as setup:
        print(f"prometheus {setup.prometheus_url}\ndcgm {setup.dcgm_url}")
        for server in setup.servers:
            print(f"{server.hostname} {server.url}?token={server.token}")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    main()
