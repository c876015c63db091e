"""Prometheus: what a scrape of gpuwidget's series costs the server, and how fast the cluster route answers.

(a) Scrape cost: the collector's ``collect()`` plus its text exposition (``generate_latest`` over a
    registry holding only gpuwidget's collector), on the server's thread, for a Monitor over
    8 fake GPUs (tests/fakenvml.py) with a sampled row, 4 kernels holding GPU memory and each
    with a watch status file. Every scrape is measured "cold" (the cgroup usage cache expired,
    as at Prometheus's 15 s interval); status files unchanged since the last scrape are only
    stat'ed. Thread CPU time and wall time per scrape, and the share of ``collect()`` alone (the
    rest is prometheus_client's formatting: label escaping and validation). Target: < 1 ms for 8 GPUs.
(b) Cluster route: 64 GPUs (8 hosts x 8) over the last hour at a 15 s resolution, backfilled into
    a real Prometheus (Debian's 2.42) with ``promtool tsdb create-blocks-from openmetrics``, then
    ``Cluster.reply(3600)`` (the route's whole work: 9 range queries at once through tornado's
    client, parsing, alignment) timed with its cache cleared, and the JSON reply's size.
    Target: < 500 ms (the sidebar refreshes every 15 s).

    .venv/bin/python benchmarks/prometheus.py [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths(fake_nvml=True)

SCRAPE_TARGET_MS = 1.0
ROUTE_TARGET_MS = 500.0
HOSTS = 8
GPUS_PER_HOST = 8
STEP_S = 15
WINDOW_S = 3600


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# ------------------------------------------------------------------ (a) scrape


def scrape_cost(scrapes: int) -> dict[str, Any]:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from gpuwidget.kernelstatus import StatusWriter
    from gpuwidget.server.metrics import GpuWidgetCollector
    from gpuwidget.server.monitor import KernelDirectory, Monitor

    from fakenvml import GIB, FakeNvml

    workdir = Path(tempfile.mkdtemp(prefix="gpuwidget-scrape-"))
    kernels = [subprocess.Popen(["sleep", "600"]) for _ in range(4)]
    try:
        fake = FakeNvml.gpus(8)
        for index, kernel in enumerate(kernels):
            fake.processes(index, compute=[(kernel.pid, 4 * GIB)])
        with fake.patched():
            monitor = Monitor(interval=1.0)
            monitor.devices()
            monitor.kernels = KernelDirectory({kernel.pid: (f"kernel-{n:04d}-aaaa-bbbb", f"work/train-{n}.ipynb")
                                               for n, kernel in enumerate(kernels)})
            monitor.read_once()
            for n, kernel in enumerate(kernels):  # what each kernel's watch would have written
                writer = StatusWriter(str(workdir), label=f"cell {n}")
                writer.path = os.path.join(str(workdir), f"gpuwidget-status-{kernel.pid}.json")
                writer.finished({"steps": 1200, "samples_per_s": 850.0, "data_wait_fraction": 0.42},
                                "dataloader-starved")
            collector = GpuWidgetCollector(monitor, "node-a", status_dir=lambda: str(workdir))
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)  # type: ignore[arg-type]
            text = generate_latest(registry)
            series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
            cpu_us: list[float] = []
            wall_us: list[float] = []
            collect_us: list[float] = []
            for _ in range(scrapes):
                collector._usage = None
                c0 = time.thread_time()
                list(collector.collect())
                collect_us.append((time.thread_time() - c0) * 1e6)
            for _ in range(scrapes):
                monitor.trace.start_wall = time.time() - monitor.trace.last()[0]  # type: ignore[index]
                collector._usage = None  # a scrape every 15 s finds the 1 s cgroup cache expired
                c0, w0 = time.thread_time(), time.perf_counter()
                generate_latest(registry)
                cpu_us.append((time.thread_time() - c0) * 1e6)
                wall_us.append((time.perf_counter() - w0) * 1e6)
            monitor.close()
    finally:
        for kernel in kernels:
            kernel.kill()
            kernel.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"series": series, "bytes": len(text), "scrapes": scrapes,
            "cpu_us_median": median(cpu_us), "cpu_us_p99": p99(cpu_us), "collect_cpu_us_median": median(collect_us),
            "wall_us_median": median(wall_us), "wall_us_p99": p99(wall_us)}


# ------------------------------------------------------------------ (b) cluster route


def openmetrics(end: int) -> str:
    """An hour of 64 GPUs' gpuwidget series at 15 s, as OpenMetrics with timestamps, for promtool."""
    lines: list[str] = []
    metrics = [
        ("gpuwidget_gpu_utilization_ratio", lambda h, g, k: ((h * 7 + g * 13 + k) % 100) / 100),
        ("gpuwidget_gpu_memory_used_bytes", lambda h, g, k: float((10 + (g + k) % 60) * 2**30)),
        ("gpuwidget_gpu_memory_total_bytes", lambda h, g, k: float(80 * 2**30)),
        ("gpuwidget_gpu_power_watts", lambda h, g, k: 100.0 + (h + g + k) % 500),
    ]
    start = end - WINDOW_S
    for name, value in metrics:
        lines.append(f"# TYPE {name} gauge")
        for host in range(HOSTS):
            for gpu in range(GPUS_PER_HOST):
                number = 0xC000 + 0x100 * host + gpu
                labels = (f'job="jupyter",instance="node-{host}:8888",gpu="{gpu}",'
                          f'UUID="GPU-{number:08x}-1111-2222-3333-{number:012x}",'
                          f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-{host}"')
                for k, t in enumerate(range(start, end + 1, STEP_S)):
                    lines.append(f"{name}{{{labels}}} {value(host, gpu, k)} {t}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def route_latency(repeats: int) -> dict[str, Any]:
    import prom

    if not os.access(prom.PROMETHEUS, os.X_OK) or not os.access(prom.PROMTOOL, os.X_OK):
        print(f"  skipped: {prom.PROMETHEUS} and {prom.PROMTOOL} are needed (make prometheus)")
        return {"skipped": True}
    workdir = Path(tempfile.mkdtemp(prefix="gpuwidget-route-"))
    try:
        end = int(time.time()) // STEP_S * STEP_S
        source = workdir / "backfill.om"
        source.write_text(openmetrics(end))
        data = workdir / "tsdb"
        t0 = time.perf_counter()
        subprocess.run([prom.PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                       check=True, capture_output=True)
        backfill_s = time.perf_counter() - t0
        port = prom.free_port()
        process = prom.start_prometheus(workdir, prom.prometheus_config([]), port, data=data)
        try:
            url = f"http://127.0.0.1:{port}"
            timings, waits, size, gpus = asyncio.run(_time_route(url, repeats))
        finally:
            prom.stop_process(process)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"gpus": gpus, "points_per_series": WINDOW_S // STEP_S + 1, "backfill_s": backfill_s,
            "repeats": repeats, "ms_median": median(timings), "ms_max": max(timings),
            "queries_answered_ms_median": median(waits),
            "ms_stdev": statistics.pstdev(timings), "reply_bytes": size}


async def _time_route(url: str, repeats: int) -> tuple[list[float], list[float], int, int]:
    from gpuwidget.server.cluster import Cluster, PrometheusConfig

    cluster = Cluster(PrometheusConfig(url=url))
    reply = await cluster.reply(WINDOW_S)  # warm: Prometheus loads the block's index
    gpus = sum(len(host["gpus"]) for host in reply["hosts"])
    if reply["error"] or gpus != HOSTS * GPUS_PER_HOST:
        raise RuntimeError(f"the backfilled GPUs are not all there: {reply['error']}, {gpus} GPUs")
    from tornado.httpclient import AsyncHTTPClient

    timings = []
    answered: list[float] = []
    client = AsyncHTTPClient()

    async def fetch(request: Any) -> Any:
        response = await client.fetch(request)
        answered.append(time.perf_counter())
        return response

    waits = []
    for _ in range(repeats):
        cluster = Cluster(PrometheusConfig(url=url), fetch=fetch)  # no cached reply
        answered.clear()
        t0 = time.perf_counter()
        reply = await cluster.reply(WINDOW_S)
        timings.append((time.perf_counter() - t0) * 1000)
        waits.append((max(answered) - t0) * 1000)
        size = len(json.dumps(reply))
    return timings, waits, size, gpus


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    info = print_header("Prometheus: scrape cost and cluster route latency")
    scrape = scrape_cost(200 if args.quick else 3000)
    print("\n(a) one scrape of gpuwidget's series, 8 GPUs + 4 kernels with status files")
    table(["series", "bytes", "CPU us median", "CPU us p99", "wall us median", "wall us p99",
           "of which collect() us"],
          [[scrape["series"], scrape["bytes"], scrape["cpu_us_median"], scrape["cpu_us_p99"],
            scrape["wall_us_median"], scrape["wall_us_p99"], scrape["collect_cpu_us_median"]]])
    verdicts = [verdict("scrape, 8 GPUs (CPU median)", scrape["cpu_us_median"] / 1000, SCRAPE_TARGET_MS,
                        higher_is_better=False, shown=f"{scrape['cpu_us_median'] / 1000:.3f} ms",
                        target_shown=f"{SCRAPE_TARGET_MS:g} ms")]
    print(f"\n(b) cluster route, {HOSTS * GPUS_PER_HOST} GPUs x 1 h at {STEP_S} s through a real Prometheus")
    route = route_latency(3 if args.quick else 20)
    if not route.get("skipped"):
        table(["GPUs", "points/series", "median ms", "max ms", "all 9 answered ms", "reply bytes", "backfill s"],
              [[route["gpus"], route["points_per_series"], route["ms_median"], route["ms_max"],
                route["queries_answered_ms_median"], route["reply_bytes"], route["backfill_s"]]])
        verdicts.append(verdict("cluster route, 64 GPUs x 1 h (median)", route["ms_median"], ROUTE_TARGET_MS,
                                higher_is_better=False, shown=f"{route['ms_median']:.0f} ms",
                                target_shown=f"{ROUTE_TARGET_MS:g} ms"))
    write_json(args.json, {"machine": info, "scrape": scrape, "route": route, "verdicts": verdicts})


if __name__ == "__main__":
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
