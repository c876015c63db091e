"""gpuwidget's figures on the Jupyter server's own Prometheus endpoint, ``{base_url}metrics``.

jupyter_server serves ``prometheus_client``'s default registry there, authenticated unless
``ServerApp.authenticate_prometheus`` is False. The extension registers one collector in that
registry (:func:`register`); each scrape reads what the server's shared sampler already holds
(the Monitor's newest row, its process table, the kernels' status files): no driver call, no
waiting, well under a millisecond for 8 GPUs (benchmarks/prometheus.py).

Series (every one carries ``Hostname``). GPU series carry the label names of the vendor's own
exporter, so that they join with its series in PromQL (which are never repeated under their names):
an NVIDIA GPU dcgm-exporter's ``gpu`` (the driver's index, as nvidia-smi and dcgm-exporter number
GPUs), ``UUID`` and ``modelName``, and for a MIG instance ``GPU_I_ID`` (its GPU instance id) and
``GPU_I_PROFILE`` ("3g.40gb"), with ``gpu``, ``UUID`` and ``modelName`` its GPU's (both empty on a
whole GPU); an AMD GPU the labels AMD's device-metrics-exporter always sets, ``gpu_id`` (amd-smi's
index), ``serial_number``, ``card_model``, ``hostname``, ``gpu_partition_id`` and
``gpu_compute_partition_type`` ("spx", "cpx"):

==============================================  ===============================================
``gpuwidget_gpu_sm_active_ratio``               share of SMs busy, 0..1 (NVIDIA GPM, Hopper and newer;
                                                the busy figure, as DCGM_FI_PROF_SM_ACTIVE)
``gpuwidget_gpu_tensor_active_ratio``           share of time a tensor pipe was busy, 0..1 (GPM; as
                                                DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)
``gpuwidget_gpu_dram_active_ratio``             share of DRAM bandwidth used, 0..1 (GPM)
``gpuwidget_gpu_utilization_ratio``             "kernel running": share of time any kernel ran, 0..1
                                                (nvidia-smi's GPU-Util, amd-smi's GFX activity; one
                                                tiny kernel counts as fully busy; absent on MIG)
``gpuwidget_gpu_memory_utilization_ratio``      share of time memory was read or written, 0..1
``gpuwidget_gpu_memory_used_bytes``             ``..._memory_total_bytes``: device memory
``gpuwidget_gpu_power_watts``                   ``..._power_limit_watts``: draw and enforced limit
``gpuwidget_gpu_temperature_celsius``           GPU sensor
``gpuwidget_gpu_sm_clock_hertz``                SM clock
``gpuwidget_gpu_energy_joules_total``           energy since the driver loaded (counter)
``gpuwidget_host_cpu_utilization_ratio``        all cores of the node, 0..1
``gpuwidget_host_memory_{used,total}_bytes``    the node's memory
``gpuwidget_cgroup_cpu_usage_seconds_total``    CPU time of the server's cgroup (container, pod, job)
``gpuwidget_cgroup_cpu_limit_cores``            its CPU quota in cores (absent: no quota)
``gpuwidget_cgroup_memory_{used,limit}_bytes``  its memory charge and limit (limit absent: none)
``gpuwidget_kernel_gpu_memory_used_bytes``      GPU memory a kernel (and its children) holds, per GPU
``gpuwidget_kernel_data_wait_ratio``            running or last watched cell: share of the loop blocked on data
``gpuwidget_kernel_samples_per_second``         ... its samples/s
``gpuwidget_kernel_steps``                      ... its steps so far
``gpuwidget_kernel_watch_info``                 ... ``state`` (running, finished), ``cause`` (the main
                                                finding's rule id, ``none``), ``label``
``gpuwidget_sampler_up``                        1 when the figures above are from a fresh sample
==============================================  ===============================================

Kernel series carry ``kernel_id`` and ``notebook``. A notebook's path (and a watch's label) is
told only to authenticated scrapes: with ``authenticate_prometheus`` off anyone may scrape, so
the ``notebook`` and ``label`` labels are empty.

The sampler runs while anyone listens: a sidebar, or a scraper. A scrape keeps it running for
``GpuWidget.metrics_keepalive_s`` more (starting it off the event loop if it was stopped, so
that scrape has no GPU figures yet and ``gpuwidget_sampler_up`` is 0); figures older than a few
sampling intervals are never exported as current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import psutil
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from gpuwidget.kernelstatus import KernelStatus, read_status, status_path
from gpuwidget.server.monitor import Monitor
from gpuwidget.server.protocol import DeviceInfo, ProcessesMessage
from gpuwidget.sources.cgroup import CgroupLimits, CgroupUsage, read_limits, read_usage

log = logging.getLogger("gpuwidget")

# GPU series' label names by vendor: dcgm-exporter's for NVIDIA, AMD device-metrics-exporter's
# mandatory labels for AMD (its default config: gpu_id, serial_number, card_model, hostname,
# gpu_partition_id, gpu_compute_partition_type).
GPU_LABELS = ["gpu", "UUID", "modelName", "Hostname", "GPU_I_ID", "GPU_I_PROFILE"]
AMD_GPU_LABELS = ["gpu_id", "serial_number", "card_model", "hostname", "gpu_partition_id",
                  "gpu_compute_partition_type"]
KERNEL_LABELS = ["kernel_id", "notebook", "Hostname"]

# GPU column (after ``gpu{i}.``) -> (metric, help, factor to the metric's unit).
GPU_GAUGES: list[tuple[str, str, str, float]] = [
    ("util", "gpuwidget_gpu_utilization_ratio",
     "Kernel running: share of time any kernel ran on the GPU (nvidia-smi's GPU-Util, amd-smi's GFX activity; a few "
     "tiny kernels read as fully busy: gpuwidget_gpu_sm_active_ratio says how much of the GPU worked), 0..1.", 0.01),
    ("mem_util", "gpuwidget_gpu_memory_utilization_ratio", "Share of time device memory was read or written, 0..1.",
     0.01),
    ("mem_used", "gpuwidget_gpu_memory_used_bytes", "Device memory in use, bytes.", 1.0),
    ("mem_total", "gpuwidget_gpu_memory_total_bytes", "Device memory, bytes.", 1.0),
    ("power", "gpuwidget_gpu_power_watts", "Power draw, watts.", 1.0),
    ("power_limit", "gpuwidget_gpu_power_limit_watts", "Enforced power limit, watts.", 1.0),
    ("temperature", "gpuwidget_gpu_temperature_celsius", "GPU temperature, degrees Celsius.", 1.0),
    ("sm_clock", "gpuwidget_gpu_sm_clock_hertz", "SM clock, hertz.", 1.0),
    ("sm_active", "gpuwidget_gpu_sm_active_ratio",
     "SM active: share of the SMs busy, averaged over time (GPM, as DCGM_FI_PROF_SM_ACTIVE), 0..1.", 0.01),
    ("tensor_active", "gpuwidget_gpu_tensor_active_ratio",
     "Tensor active: share of time a tensor core pipe was busy (GPM, as DCGM_FI_PROF_PIPE_TENSOR_ACTIVE), 0..1.",
     0.01),
    ("dram_active", "gpuwidget_gpu_dram_active_ratio", "Share of DRAM bandwidth used (GPM), 0..1.", 0.01),
]
GPU_COUNTERS: list[tuple[str, str, str]] = [
    ("energy_j", "gpuwidget_gpu_energy_joules", "Energy used since the driver loaded, joules."),
]
HOST_GAUGES: list[tuple[str, str, str, float]] = [
    ("cpu.util", "gpuwidget_host_cpu_utilization_ratio", "Busy share of all the node's cores, 0..1.", 0.01),
    ("mem.used", "gpuwidget_host_memory_used_bytes", "The node's memory in use, bytes.", 1.0),
    ("mem.total", "gpuwidget_host_memory_total_bytes", "The node's memory, bytes.", 1.0),
]
KERNEL_FIGURES: list[tuple[Literal["data_wait_fraction", "samples_per_s", "steps"], str, str]] = [
    ("data_wait_fraction", "gpuwidget_kernel_data_wait_ratio",
     "Running or last watched cell: share of its loop blocked waiting for data, 0..1."),
    ("samples_per_s", "gpuwidget_kernel_samples_per_second", "Running or last watched cell: samples per second."),
    ("steps", "gpuwidget_kernel_steps", "Running or last watched cell: training steps so far."),
]

# A sample older than this many sampling intervals (and at least STALE_MIN_S) is not current.
STALE_INTERVALS = 5
STALE_MIN_S = 10.0
# cgroup usage is re-read at most this often (a few file reads: ~0.1 ms), its limits this often.
CGROUP_USAGE_REFRESH_S = 1.0
CGROUP_LIMITS_REFRESH_S = 60.0
# At most this many kernels' status files are looked at per scrape.
MAX_KERNELS = 256
# The keep-alive subscriber wants a sample this rarely (it ignores them; it only keeps the sampler on).
KEEPALIVE_STREAM_INTERVAL_S = 3600.0


class ScrapeKeepalive:
    """Keeps the Monitor sampling while something scrapes: a silent subscriber, dropped after ``keep_s`` idle."""

    def __init__(self, monitor: Monitor, keep_s: float) -> None:
        self.monitor = monitor
        self.keep_s = keep_s
        self._last = -math.inf
        self._token: int | None = None
        self._starting = False
        self._closed = False

    @property
    def active(self) -> bool:
        return self._token is not None

    def touch(self) -> None:
        """A scrape came (on the event loop): start the sampler if needed, without waiting for it."""
        self._last = time.monotonic()
        if self._token is not None or self._starting or self._closed or self.keep_s <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # collected outside the server (a script): nothing to keep alive
        self._starting = True
        loop.create_task(self._start())

    async def _start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.monitor.devices)  # NVML start-up, off the loop
            if self._closed:
                return
            self._token = self.monitor.subscribe(_ignore, KEEPALIVE_STREAM_INTERVAL_S)
            loop.call_later(self.keep_s, self._expire)
        except Exception as exc:  # noqa: BLE001 - the scrape still gets host figures
            log.warning("gpuwidget: could not start the sampler for /metrics: %s", exc)
        finally:
            self._starting = False

    def _expire(self) -> None:
        idle = time.monotonic() - self._last
        if idle < self.keep_s:
            asyncio.get_running_loop().call_later(self.keep_s - idle, self._expire)
            return
        self.stop()

    def close(self) -> None:
        """For good (the collector is unregistered): no later scrape or pending start subscribes again."""
        self._closed = True
        self.stop()

    def stop(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            self.monitor.unsubscribe(token)


def _ignore(_text: str) -> None:
    pass


class GpuWidgetCollector:
    """A ``prometheus_client`` collector over a Monitor; ``collect()`` only reads what is already there."""

    def __init__(self, monitor: Monitor, hostname: str, *,
                 notebooks_allowed: Callable[[], bool] = lambda: True,
                 status_dir: Callable[[], str | None] = lambda: None,
                 keepalive: ScrapeKeepalive | None = None,
                 cgroup_root: str | None = None, proc_cgroup: str | None = None) -> None:
        self.monitor = monitor
        self.hostname = hostname
        self.notebooks_allowed = notebooks_allowed
        self.status_dir = status_dir
        self.keepalive = keepalive
        self._cgroup_args = {key: value for key, value in (("root", cgroup_root), ("proc_cgroup", proc_cgroup))
                             if value is not None}
        self._limits: tuple[float, CgroupLimits] | None = None
        self._usage: tuple[float, CgroupUsage] | None = None
        self._processes: tuple[str, ProcessesMessage] | None = None  # (the monitor's text, parsed)
        self._status_cache: dict[int, tuple[tuple[int, int], KernelStatus | None]] = {}
        self._started_at: dict[int, float | None] = {}  # pid -> process start (unix s)
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        """The families' names, so that registering does not run a collection."""
        return list(self._families().values())

    def _families(self) -> dict[str, Any]:
        families: dict[str, Any] = {}
        # GPU families take their labels per device (each vendor's exporter names them its own way).
        for _, name, text, _ in GPU_GAUGES:
            families[name] = GaugeMetricFamily(name, text)
        for _, name, text in GPU_COUNTERS:
            families[name] = CounterMetricFamily(name, text)
        for _, name, text, _ in HOST_GAUGES:
            families[name] = GaugeMetricFamily(name, text, labels=["Hostname"])
        families["cgroup_cpu"] = CounterMetricFamily(
            "gpuwidget_cgroup_cpu_usage_seconds", "CPU time used by the server's cgroup, seconds.", labels=["Hostname"])
        families["cgroup_cpu_limit"] = GaugeMetricFamily(
            "gpuwidget_cgroup_cpu_limit_cores", "CPU quota of the server's cgroup, cores.", labels=["Hostname"])
        families["cgroup_mem"] = GaugeMetricFamily(
            "gpuwidget_cgroup_memory_used_bytes", "Memory charged to the server's cgroup, bytes.", labels=["Hostname"])
        families["cgroup_mem_limit"] = GaugeMetricFamily(
            "gpuwidget_cgroup_memory_limit_bytes", "Memory limit of the server's cgroup, bytes.", labels=["Hostname"])
        families["kernel_mem"] = GaugeMetricFamily(
            "gpuwidget_kernel_gpu_memory_used_bytes",
            "GPU memory held by a kernel and its child processes, bytes.")
        for _, name, text in KERNEL_FIGURES:
            families[name] = GaugeMetricFamily(name, text, labels=KERNEL_LABELS)
        families["watch_info"] = InfoMetricFamily(
            "gpuwidget_kernel_watch", "Running or last watched cell: state, main cause (a rule id) and label.",
            labels=KERNEL_LABELS)
        families["up"] = GaugeMetricFamily(
            "gpuwidget_sampler_up", "1 when gpuwidget's figures are from a fresh sample, else 0.", labels=["Hostname"])
        return families

    def collect(self) -> Iterator[Metric]:
        if self.keepalive is not None:
            self.keepalive.touch()
        with self._lock:  # a scrape from a thread and one from the loop must not share the caches half-built
            families = self._families()
            host = self.hostname
            fresh = self._collect_samples(families, host)
            families["up"].add_metric([host], 1.0 if fresh else 0.0)
            self._collect_cgroup(families, host)
            self._collect_kernels(families, host, fresh)
        for family in families.values():
            if family.samples:
                yield family

    # ------------------------------------------------------------- parts

    def _collect_samples(self, families: dict[str, Any], host: str) -> bool:
        monitor = self.monitor
        last = monitor.trace.last()
        if last is None:
            return False
        t, values = last
        age = time.time() - (monitor.trace.start_wall + t)
        if age > max(STALE_INTERVALS * monitor.interval, STALE_MIN_S):
            return False
        for column, name, _, factor in HOST_GAUGES:
            value = values.get(column)
            if value is not None:
                families[name].add_metric([host], value * factor)
        for device, labels in self._devices():
            prefix = device["id"] + "."
            for column, name, _, factor in GPU_GAUGES:
                value = values.get(prefix + column)
                if value is None and column == "mem_total":
                    value = device.get("memory_total")
                if value is not None:
                    families[name].add_sample(name, labels, value * factor)
            for column, name, _ in GPU_COUNTERS:
                value = values.get(prefix + column)
                if value is not None:
                    families[name].add_sample(name + "_total", labels, value)
        return True

    def _devices(self) -> list[tuple[DeviceInfo, dict[str, str]]]:
        known = self.monitor.known_devices
        if not known:
            return []
        return [(device, self._gpu_labels(device)) for device in known.get("devices") or []]

    def _gpu_labels(self, device: DeviceInfo) -> dict[str, str]:
        """The labels the GPU's own exporter gives it: AMD's device-metrics-exporter's for an AMD GPU,
        dcgm-exporter's otherwise (a MIG instance named by its GPU's index, UUID and model, and its GPU
        instance id and profile)."""
        index = device.get("driver_index", device.get("index"))
        number = "" if index is None else str(index)
        name = device.get("name") or ""
        if device.get("vendor") == "amd":
            partition = device.get("partition_id")
            values = [number, device.get("serial") or "", name, self.hostname,
                      "0" if partition is None else str(partition), (device.get("compute_partition") or "").lower()]
            return dict(zip(AMD_GPU_LABELS, values))
        if not device.get("is_mig"):
            return dict(zip(GPU_LABELS, [number, device.get("uuid") or "", name, self.hostname, "", ""]))
        instance = device.get("gpu_instance_id")
        profile = device.get("mig_profile") or ""
        model = name.rpartition(" MIG ")[0] or name
        return dict(zip(GPU_LABELS, [number, device.get("parent_uuid") or device.get("uuid") or "", model,
                                     self.hostname, "" if instance is None else str(instance), profile]))

    def _collect_cgroup(self, families: dict[str, Any], host: str) -> None:
        now = time.monotonic()
        if self._limits is None or now - self._limits[0] > CGROUP_LIMITS_REFRESH_S:
            self._limits = (now, read_limits(**self._cgroup_args))
        if self._usage is None or now - self._usage[0] > CGROUP_USAGE_REFRESH_S:
            self._usage = (now, read_usage(**self._cgroup_args))
        limits, usage = self._limits[1], self._usage[1]
        if limits.version is None:
            return
        if usage.cpu_seconds is not None:
            families["cgroup_cpu"].add_metric([host], usage.cpu_seconds)
        if limits.cpu_limit is not None:
            families["cgroup_cpu_limit"].add_metric([host], limits.cpu_limit)
        if usage.mem_bytes is not None:
            families["cgroup_mem"].add_metric([host], float(usage.mem_bytes))
        if limits.mem_limit is not None:
            families["cgroup_mem_limit"].add_metric([host], float(limits.mem_limit))

    def _collect_kernels(self, families: dict[str, Any], host: str, fresh: bool) -> None:
        allowed = self.notebooks_allowed()
        kernels = list(self.monitor.kernels.by_pid.items())[:MAX_KERNELS]
        if fresh:
            self._collect_kernel_memory(families, host, allowed)
        directory = self.status_dir()
        if directory is None:
            return
        seen = set()
        for pid, (kernel_id, notebook) in kernels:
            seen.add(pid)
            status = self._status(directory, pid)
            if status is None:
                continue
            labels = [kernel_id, (notebook or "") if allowed else "", host]
            for key, name, _ in KERNEL_FIGURES:
                if status[key] is not None:
                    families[name].add_metric(labels, status[key])
            families["watch_info"].add_metric(labels, {
                "state": status["state"], "cause": status["cause"], "label": status["label"] if allowed else ""})
        for pid in [pid for pid in self._status_cache if pid not in seen]:
            self._status_cache.pop(pid, None)
            self._started_at.pop(pid, None)

    def _collect_kernel_memory(self, families: dict[str, Any], host: str, allowed: bool) -> None:
        text = self.monitor.processes_text()
        if self._processes is None or self._processes[0] is not text:
            self._processes = (text, self.monitor.processes())
        table = self._processes[1]
        if table.get("t") is None:
            return
        devices = {device["id"]: labels for device, labels in self._devices()}
        held: dict[tuple[str, str | None, str], float] = {}
        for gpu_id, rows in (table.get("gpus") or {}).items():
            for row in rows:
                kernel_id = row.get("kernel_id")
                row_bytes = row.get("memory")
                if kernel_id and row_bytes is not None and gpu_id in devices:
                    key = (kernel_id, row.get("notebook"), gpu_id)
                    held[key] = held.get(key, 0.0) + float(row_bytes)
        family = families["kernel_mem"]
        for (kernel_id, notebook, gpu_id), memory in held.items():
            labels = {"kernel_id": kernel_id, "notebook": (notebook or "") if allowed else "", **devices[gpu_id]}
            family.add_sample(family.name, labels, memory)

    def _status(self, directory: str, pid: int) -> KernelStatus | None:
        """The kernel's status file, re-read only when it changed (a stat per scrape otherwise)."""
        path = status_path(directory, pid)
        try:
            stat = os.stat(path)
        except OSError:
            self._status_cache.pop(pid, None)
            return None
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._status_cache.get(pid)
        if cached is not None and cached[0] == key:
            return cached[1]
        if pid not in self._started_at:
            with contextlib.suppress(psutil.Error):
                self._started_at[pid] = psutil.Process(pid).create_time()
        status = read_status(path, not_before=self._started_at.get(pid))
        self._status_cache[pid] = (key, status)
        return status


_registered: tuple[CollectorRegistry, GpuWidgetCollector] | None = None
_register_lock = threading.Lock()


def register(collector: GpuWidgetCollector, registry: CollectorRegistry = REGISTRY) -> None:
    """Add ``collector`` to ``registry`` (jupyter_server's /metrics serves the default one).

    One gpuwidget collector per process: a second server in the same process (tests) replaces
    the first one's, whose series would otherwise clash.
    """
    global _registered
    with _register_lock:
        _unregister_locked()
        registry.register(collector)  # type: ignore[arg-type]
        _registered = (registry, collector)


def unregister() -> None:
    """Remove the registered collector, if any (and let its keep-alive go)."""
    with _register_lock:
        _unregister_locked()


def _unregister_locked() -> None:
    global _registered
    if _registered is None:
        return
    registry, collector = _registered
    _registered = None
    with contextlib.suppress(KeyError):
        registry.unregister(collector)  # type: ignore[arg-type]
    if collector.keepalive is not None:
        collector.keepalive.close()
