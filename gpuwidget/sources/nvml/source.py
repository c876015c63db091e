"""The NVML source: per-GPU metrics for the devices CUDA shows this process, one cheap NVML pass per tick.

Metrics per visible device, named ``gpu{cuda_index}.<metric>`` in SI units:

=================  ==========================================================================
``util``           % of time a kernel ran (mean of the driver's samples since the last tick; when the
                   driver has no new sample, as on an idle GPU, nvmlDeviceGetUtilizationRates)
``mem_util``       % of time device memory was read or written
``mem_used``       bytes in use; ``mem_total`` bytes
``power``          W; ``power_limit`` W (enforced limit); ``power_limit_default`` W (the board's default);
                   ``power_limit_min``/``power_limit_max`` W (the limits the board accepts)
``energy_j``       J the GPU used since the driver loaded (a cumulative counter, Volta and newer)
``temperature``    degrees Celsius (GPU sensor)
``sm_clock``       Hz; ``sm_clock_max`` Hz; ``mem_clock`` Hz (the memory clock)
``slowdown``       1 when a clock event reason says the GPU slowed itself (:data:`SLOWDOWN_BITS`), else 0;
                   ``power_capped`` 1 at the software power cap (:data:`POWER_CAP_BIT`); both absent while the
                   clocks are low because the GPU is idle (NVML's own reason, not a slowdown)
``pcie_tx``        bytes/s sent by the GPU; ``pcie_rx`` bytes/s received
``proc_mem``       bytes held on the device by "our" processes (see ``pids``)
``pcie_gen``       PCIe link generation now; ``pcie_width`` lanes now; ``pcie_gen_max``/``pcie_width_max``
                   what the GPU and its slot allow (an idle GPU drops its link speed to save power)
``sm_active``      % of SMs busy (GPM, Hopper and newer; on a MIG instance through its parent with
                   nvmlGpmMigSampleGet, where NVML gives no ``util``); ``sm_occupancy`` % of warp slots used
``tensor_active``  % of time any tensor core pipe was busy (GPM); ``dram_active`` % of DRAM bandwidth
``nvlink_tx``      bytes/s sent over NVLink (GPM); ``nvlink_rx`` bytes/s received
=================  ==========================================================================

A lost GPU (GpuIsLost, ResetRequired; Unknown when the UUID no longer answers, or UNKNOWN_STRIKES
ticks in a row) ends that device with its error recorded; the other devices go on.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from gpuwidget.facts import GpuFacts
from gpuwidget.sources.base import ErrorLog, SourceError
from gpuwidget.sources.gpu import GpuDescription, GpuSource, Opened
from gpuwidget.sources.nvml.devices import _enumerate, _Found, _visible
from gpuwidget.sources.nvml.driver import (
    _CLOCK_EVENTS,
    _COMPUTE_PROCESSES,
    _GRAPHICS_PROCESSES,
    FAILED,
    KIB,
    MHZ,
    MIB,
    NO_PERMISSION,
    Absent,
    _DeviceLost,
    _DeviceUnknown,
    _Driver,
    _load_pynvml,
    _memory_info,
    _text,
)
from gpuwidget.sources.nvml.processes import _plausible
from gpuwidget.sources.pids import OwnProcesses, foreign_pid_namespace, namespace_pids

# Tests freeze time by replacing this (tests/fakenvml.py).
_now: Callable[[], float] = time.monotonic

# nvmlDeviceGetPcieThroughput measures over a 20 ms window and blocks the caller for that long (twice:
# one call for TX, one for RX). Calling it every tick would stall the sampler thread for 40 ms per GPU,
# so each device is asked at most once per PCIE_REFRESH_S, at most one device per tick, and the last
# value is repeated in between. GPUs with GPM report PCIe traffic from GPM instead, without blocking.
PCIE_REFRESH_S = 1.0
# NVML computes GPM metrics from two samples that must be at least 100 ms apart.
GPM_MIN_INTERVAL_S = 0.1
# The enforced power limit changes only when an administrator sets it; re-read it now and then.
POWER_LIMIT_REFRESH_S = 10.0
# NVML_ERROR_UNKNOWN on this many ticks in a row (each time with the UUID query failing too)
# declares the GPU lost; one transient error only loses that tick.
UNKNOWN_STRIKES = 3
# The link's generation and width change with the GPU's power state; a cheap query, re-read now and then.
PCIE_LINK_REFRESH_S = 1.0

# NVML clock-event bits (nvml.h, nvmlClocksEventReason*) that mean the GPU slowed itself down:
# hardware slowdown (0x8), software thermal (0x20), hardware thermal (0x40), hardware power brake (0x80).
SLOWDOWN_BITS = 0x8 | 0x20 | 0x40 | 0x80
# Software power cap (0x4): the GPU holds its power limit. A busy H100 at its default limit sits
# there as a matter of course; the advisor calls it a slowdown only when the limit is below the default.
POWER_CAP_BIT = 0x4
# GPU idle (0x1): clocks are low because nothing runs, on purpose. Application clocks (0x2) are a setting.
CLOCK_EVENT_IDLE = 0x1

# nvmlValueType_t -> the c_nvmlValue_t member that holds a sample of that type.
_SAMPLE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# GPM metric name -> (NVML metric id constant, scale to SI units).
_GPM_METRICS: dict[str, tuple[str, float]] = {
    "sm_active": ("NVML_GPM_METRIC_SM_UTIL", 1.0),
    "sm_occupancy": ("NVML_GPM_METRIC_SM_OCCUPANCY", 1.0),
    "tensor_active": ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 1.0),
    "dram_active": ("NVML_GPM_METRIC_DRAM_BW_UTIL", 1.0),
    "pcie_tx": ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", float(MIB)),
    "pcie_rx": ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", float(MIB)),
    "nvlink_tx": ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", float(MIB)),
    "nvlink_rx": ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", float(MIB)),
}

# Metrics that take one NVML call each: (metric, function, its constant arguments by pynvml name,
# scale from NVML's unit to SI, how often to ask in seconds: 0 every tick, inf once at start). Facts
# that rarely or never change are asked seldom and their last value is repeated every tick.
_READS: tuple[tuple[str, str, tuple[str, ...], float, float], ...] = (
    ("power", "nvmlDeviceGetPowerUsage", (), 1e-3, 0.0),  # mW
    ("energy_j", "nvmlDeviceGetTotalEnergyConsumption", (), 1e-3, 0.0),  # mJ since the driver loaded
    ("temperature", "nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU",), 1.0, 0.0),  # degrees C
    ("sm_clock", "nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM",), MHZ, 0.0),  # MHz
    ("sm_clock_max", "nvmlDeviceGetMaxClockInfo", ("NVML_CLOCK_SM",), MHZ, math.inf),
    ("mem_clock", "nvmlDeviceGetClockInfo", ("NVML_CLOCK_MEM",), MHZ, POWER_LIMIT_REFRESH_S),  # MHz, seldom moves
    ("power_limit", "nvmlDeviceGetEnforcedPowerLimit", (), 1e-3, POWER_LIMIT_REFRESH_S),  # mW
    ("power_limit_default", "nvmlDeviceGetPowerManagementDefaultLimit", (), 1e-3, math.inf),  # mW
    # (min, max) in mW, one element each (_PARTS)
    ("power_limit_min", "nvmlDeviceGetPowerManagementLimitConstraints", (), 1e-3, math.inf),
    ("power_limit_max", "nvmlDeviceGetPowerManagementLimitConstraints", (), 1e-3, math.inf),
    ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", (), 1.0, PCIE_LINK_REFRESH_S),
    ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", (), 1.0, PCIE_LINK_REFRESH_S),  # lanes
    ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", (), 1.0, math.inf),
    ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", (), 1.0, math.inf),
)

# _READS metrics whose function returns a tuple: the element each one takes.
_PARTS = {"power_limit_min": 0, "power_limit_max": 1}

METRICS = (
    "util",
    "mem_util",
    "mem_used",
    "mem_total",
    "power",
    "energy_j",
    "power_limit",
    "power_limit_default",
    "power_limit_min",
    "power_limit_max",
    "temperature",
    "sm_clock",
    "sm_clock_max",
    "mem_clock",
    "slowdown",
    "power_capped",
    "pcie_tx",
    "pcie_rx",
    "pcie_gen",
    "pcie_width",
    "pcie_gen_max",
    "pcie_width_max",
    "proc_mem",
    *(name for name in _GPM_METRICS if not name.startswith("pcie")),
)


# ---------------------------------------------------------------------------------------------------
# One device's state between ticks


class _Gpm:
    """Two GPM samples used alternately; metrics come from each pair at least 100 ms apart."""

    def __init__(self, driver: _Driver, samples: tuple[Any, Any], mig_instance_id: int | None) -> None:
        nvml = driver.nvml
        self.samples = samples
        self.mig_instance_id = mig_instance_id
        self.taken = False  # a first sample exists
        self.ready = False  # a first pair gave metrics
        self.time = -math.inf
        self.values: dict[str, float] = {}
        self.ids: list[tuple[str, int, float]] = [
            (metric, getattr(nvml, constant), scale)
            for metric, (constant, scale) in _GPM_METRICS.items()
            if hasattr(nvml, constant)
        ]
        self.request = nvml.c_nvmlGpmMetricsGet_t()
        self.request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        self.request.numMetrics = len(self.ids)
        for slot, (_, metric_id, _) in enumerate(self.ids):
            self.request.metrics[slot].metricId = metric_id

    @property
    def gives_pcie(self) -> bool:
        return "pcie_tx" in self.values


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


class _Device:
    """A visible device: its handle, cached static facts, and the state carried between ticks."""

    def __init__(self, cuda_index: int, found: _Found) -> None:
        self.cuda_index = cuda_index
        self.label = f"gpu{cuda_index}"
        self.info = found.info
        self.found = found
        self.handle = found.handle
        self.key = {metric: f"{self.label}.{metric}" for metric in METRICS}
        self.off: dict[str, Absent] = {}
        self.lost: str | None = None
        self.held: dict[str, float] = {}  # the last value of each _READS metric asked less than every tick
        self.asked: dict[str, float] = {}  # when each _READS metric was last asked
        self.unknown_strikes = 0  # ticks in a row lost to NVML_ERROR_UNKNOWN
        self.sample_time = 0  # driver timestamp (us) of the newest utilization sample seen
        self.pcie: tuple[float, float] | None = None
        self.pcie_time = -math.inf
        self.procs_off = False
        self.gpm: _Gpm | None = None

    def describe(self) -> GpuFacts:
        return {
            "id": self.label,
            "index": self.cuda_index,
            "vendor": "nvidia",
            "driver_index": self.info.index,
            "uuid": self.info.uuid,
            "name": self.info.name,
            "memory_total": self.info.memory_total,
            "power_limit": self.held.get("power_limit"),
            "sm_clock_max": self.held.get("sm_clock_max"),
            "power_limit_default": self.held.get("power_limit_default"),
            "capability": None if self.info.capability is None else list(self.info.capability),
            "pcie_gen_max": _whole(self.held.get("pcie_gen_max")),
            "pcie_width_max": _whole(self.held.get("pcie_width_max")),
            "is_mig": self.info.is_mig,
            "parent_uuid": self.info.parent_uuid,
            "mig_mode": self.found.mig_enabled,  # a GPU in MIG mode (its instances are the CUDA devices)
            "gpu_instance_id": self.info.gpu_instance_id,
            "mig_profile": self.info.mig_profile,
            "pci_bus_id": self.info.pci_bus_id,
            "arch": None,
            "gpm": self.gpm is not None,
            "lost": self.lost,
        }


# ---------------------------------------------------------------------------------------------------
# The source


class NvmlSource:
    """Per-GPU metrics for the CUDA devices this process can see, one cheap NVML pass per tick.

    ``gpus`` selects CUDA device indexes (as torch numbers them, after CUDA_VISIBLE_DEVICES); ``None``
    means every visible device. ``pids`` returns the process ids whose GPU memory counts as ours for
    ``proc_mem`` (asked at most once a second); by default this process and its descendants.
    ``every_device`` is the machine's view for the server (sidebar, /metrics) rather than one CUDA
    process's: a GPU in MIG mode is read with every one of its instances, where CUDA shows a process
    one instance only (:func:`gpuwidget.sources.nvml.devices._cuda_visible`).
    Without a driver or a GPU the source is ``available = False`` with ``unavailable_reason`` set
    (``driver_found`` says whether NVIDIA's driver answered at all), and ``read()`` returns ``{}``.
    :func:`open_sources` opens one per GPU (:mod:`gpuwidget.sources.gpu`).
    """

    name = "nvml"

    def __init__(
        self,
        gpus: Sequence[int] | None = None,
        pids: Callable[[], Iterable[int]] | None = None,
        every_device: bool = False,
        *,
        _enumerated: tuple[list[_Found], str] | None = None,
    ) -> None:
        self._log = ErrorLog(self.name)
        self.every_device = every_device
        self.errors: list[SourceError] = self._log.errors
        self.available = False
        self.unavailable_reason: str | None = None
        self.driver_found = False  # nvmlInit answered (or the driver is there but not loaded)
        self.missing: list[int] = []  # requested CUDA indexes that CUDA does not have
        self.visible_count = 0  # devices CUDA can see (before the ``gpus`` selection)
        # How CUDA's numbering was matched to NVML's: "torch" (UUIDs), "pci" (exact), "guessed".
        self.cuda_order: str | None = None
        self._devices: list[_Device] = []
        self._lock = threading.Lock()
        # The GPU being read now, named for the user: if a read hangs, the sampler's message
        # says "GPU 1 stopped answering" (Source.busy_with, sources/base.py).
        self.busy_with: str | None = None
        self._closed = False
        self._initialised = False
        self._cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._driver: _Driver | None = None
        self._own: OwnProcesses | None = None
        # NVML lists processes with pids this PID namespace doesn't have (a container): see _proc_mem.
        self.foreign_pid_namespace = len(namespace_pids()) > 1
        # CUDA's devices as this source found them (open_sources hands them to one source per GPU, so
        # that a GPU which hangs is asked by its own source alone, never by the others' start-up).
        self.visible: list[_Found] = []
        self._start(gpus, pids, _enumerated)

    # -- life cycle ------------------------------------------------------------------------------

    def _start(self, gpus: Sequence[int] | None, pids: Callable[[], Iterable[int]] | None,
               enumerated: tuple[list[_Found], str] | None) -> None:
        try:
            nvml = _load_pynvml()
        except Exception as error:
            self._unavailable(f"nvidia-ml-py is not installed ({error})")
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound:
            self._unavailable("no NVIDIA GPU driver (NVML library not found)")
            return
        except nvml.NVMLError_DriverNotLoaded:
            self.driver_found = True
            self._unavailable("the NVIDIA driver is not loaded")
            return
        except Exception as error:
            self.driver_found = True
            self._unavailable(f"NVML failed to start: {error}")
            return
        self._initialised = self.driver_found = True
        driver = self._driver = _Driver(nvml, self._log)
        driver.driver_version = _text(driver.query("nvmlSystemGetDriverVersion"))
        self._own = OwnProcesses(pids, driver.report_once)
        if enumerated is None:
            try:
                gpus_found = _enumerate(driver)
            except Exception as error:  # enumeration must not make the constructor raise
                driver.report_once(f"listing GPUs failed: {error!r}")
                gpus_found = []
            if not gpus_found:
                self._unavailable("the NVIDIA driver lists no GPU")
                return
            visible, self.cuda_order = _visible(
                gpus_found, self._cuda_visible_devices, os.environ.get("CUDA_DEVICE_ORDER"), self.every_device
            )
        else:
            visible, self.cuda_order = enumerated
        self.visible = visible
        if not visible:
            self._unavailable(
                f"no NVIDIA GPU visible to CUDA (CUDA_VISIBLE_DEVICES={self._cuda_visible_devices!r})"
            )
            return
        self.visible_count = len(visible)
        wanted = range(len(visible)) if gpus is None else gpus
        for cuda_index in map(int, wanted):
            if not 0 <= cuda_index < len(visible):
                self.missing.append(cuda_index)
                driver.report_once(f"GPU {cuda_index} requested but only {len(visible)} visible to CUDA")
                continue
            if any(device.cuda_index == cuda_index for device in self._devices):
                continue
            device = _Device(cuda_index, visible[cuda_index])
            try:
                self._prepare(device)
            except _DeviceLost as lost:
                self._end_device(device, str(lost))
            except Exception as error:  # e.g. bindings without GPM structs: the basics still work
                driver.report_once(f"setting up failed: {type(error).__name__}: {error}", device.label)
            self._devices.append(device)
        if not any(device.lost is None for device in self._devices):
            if self.missing and not self._devices:
                self._unavailable(f"GPU {self.missing[0]} is not visible to CUDA ({len(visible)} visible)")
            else:
                self._unavailable("every requested GPU was lost")
            return
        self.available = True
        # Whose pids the driver reports is known from the first listing (describe() says it at once).
        if self._own is not None:
            self._own.refresh(_now())
        for device in self._devices:
            if device.lost is None:
                with contextlib.suppress(Exception):
                    self._proc_mem(device)

    def _unavailable(self, reason: str) -> None:
        self.available = False
        self.unavailable_reason = reason

    def _prepare(self, device: _Device) -> None:
        """Read the facts that change seldom or never (describe() shows them at once), and set up GPM
        where the GPU has it."""
        driver = self._require_driver()
        handle, label = device.handle, device.label
        self._read_table(device, {}, _now(), seldom_only=True)
        # GPM on a MIG instance is read through the parent GPU with the instance's GPU instance id.
        found = device.found
        gpm_handle = found.parent_handle if found.info.is_mig else handle
        support = driver.query("nvmlGpmQueryDeviceSupport", gpm_handle, device=label)
        if isinstance(support, Absent) or not support.isSupportedDevice:
            return
        if found.info.is_mig and found.gpu_instance_id is None:
            return
        first = driver.query("nvmlGpmSampleAlloc", device=label)
        second = driver.query("nvmlGpmSampleAlloc", device=label)
        if isinstance(first, Absent) or isinstance(second, Absent):
            for sample in (first, second):
                if not isinstance(sample, Absent):
                    driver.query("nvmlGpmSampleFree", sample)
            return
        device.gpm = _Gpm(driver, (first, second), found.gpu_instance_id if found.info.is_mig else None)

    def close(self) -> None:
        """Free GPM samples and shut NVML down (once); later reads return ``{}``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            driver = self._driver
            if driver is None or not self._initialised:
                return
            for device in self._devices:
                if device.gpm is not None:
                    for sample in device.gpm.samples:
                        with contextlib.suppress(_DeviceLost):
                            driver.query("nvmlGpmSampleFree", sample, device=device.label)
                    device.gpm = None
            try:
                driver.nvml.nvmlShutdown()
            except Exception as error:
                driver.report_once(f"nvmlShutdown failed: {error}")

    @property
    def closed(self) -> bool:
        """True once nothing more will come: closed, never available, or every GPU lost."""
        return self._closed or not self.available or all(device.lost for device in self._devices)

    def describe(self) -> list[GpuDescription]:
        """Each selected device's static facts: ``index`` its CUDA index, ``driver_index`` the driver's
        (nvidia-smi's) number, ``lost`` why it stopped answering. Empty when unavailable (then
        ``unavailable_reason`` says why)."""
        return [{**device.describe(), "foreign_pid_namespace": self.foreign_pid_namespace}
                for device in self._devices]

    @property
    def driver_version(self) -> str | None:
        return None if self._driver is None else self._driver.driver_version

    @property
    def cuda_visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES as it was when the source started (None: unset)."""
        return self._cuda_visible_devices

    # -- one tick ----------------------------------------------------------------------------------

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        with self._lock:
            if self._closed or not self.available:
                return values
            try:
                now = _now()
                if self._own is not None:
                    self._own.refresh(now)
                for device in self._devices:
                    if device.lost is None:
                        self._guarded(device, values, self._read_device, now)
                self._read_one_pcie(values, now)
            except Exception as error:  # never out of read(): the sampler thread must live on
                self._require_driver().report_once(f"reading failed: {type(error).__name__}: {error}")
        return values

    def _guarded(
        self,
        device: _Device,
        values: dict[str, float],
        step: Callable[[_Device, dict[str, float], float], None],
        now: float,
    ) -> None:
        self.busy_with = f"GPU {device.cuda_index}"
        try:
            step(device, values, now)
            device.unknown_strikes = 0
        except _DeviceUnknown as unknown:
            for key in device.key.values():
                values.pop(key, None)  # this tick's readings of the device are suspect
            if self._confirm_lost(device):
                self._end_device(device, str(unknown))
            else:
                self._require_driver().report_once(
                    f"GPU answered Unknown Error ({unknown}); its tick was skipped, the GPU still answers",
                    device.label,
                )
        except _DeviceLost as lost:
            self._end_device(device, str(lost))
            for key in device.key.values():
                values.pop(key, None)
        except Exception as error:  # our own bug: lose this tick for this device, never the sampler
            self._require_driver().report_once(
                f"reading failed: {type(error).__name__}: {error}", device.label
            )
        finally:
            self.busy_with = None

    def _confirm_lost(self, device: _Device) -> bool:
        """After NVML_ERROR_UNKNOWN: lost when the GPU no longer gives its UUID (a GPU off the bus
        answers nothing), or after UNKNOWN_STRIKES ticks in a row ended that way."""
        try:
            answered = not isinstance(
                self._require_driver().query("nvmlDeviceGetUUID", device.handle, quiet=True), Absent
            )
        except _DeviceLost:
            answered = False
        device.unknown_strikes += 1
        return not answered or device.unknown_strikes >= UNKNOWN_STRIKES

    def _end_device(self, device: _Device, reason: str) -> None:
        device.lost = reason
        self._log.record(f"GPU lost, no more readings from it ({reason})", device.label, time.time())

    def _require_driver(self) -> _Driver:
        assert self._driver is not None
        return self._driver

    def _read_device(self, device: _Device, values: dict[str, float], now: float) -> None:
        """One tick of one device: the _READS table, then the readings that take a struct, a fallback
        or state between ticks (memory, utilisation, clock events, our processes, GPM, PCIe traffic)."""
        driver = self._require_driver()
        query = driver.query
        handle, off, label, key = device.handle, device.off, device.label, device.key

        self._read_table(device, values, now)

        memory = _memory_info(driver, handle, off, label)
        if not isinstance(memory, Absent):
            values[key["mem_used"]] = float(memory.used)
            values[key["mem_total"]] = float(memory.total)

        rates = query("nvmlDeviceGetUtilizationRates", handle, off=off, device=label)
        util = self._sampled_util(device, now)
        if not isinstance(rates, Absent):
            values[key["mem_util"]] = float(rates.memory)
            if util is None:
                util = float(rates.gpu)
        if util is not None:
            values[key["util"]] = util

        events = driver.query_chain(_CLOCK_EVENTS, handle, off=off, device=label)
        if not isinstance(events, Absent):
            flags = clock_event_flags(int(events))
            if flags is not None:
                values[key["slowdown"]], values[key["power_capped"]] = flags

        proc_mem = self._proc_mem(device)
        if proc_mem is not None:
            values[key["proc_mem"]] = proc_mem

        if device.gpm is not None:
            self._read_gpm(device, now)
            if device.gpm is not None:
                for metric, value in device.gpm.values.items():
                    values[key[metric]] = value

        if device.pcie is not None and (device.gpm is None or not device.gpm.gives_pcie):
            values[key["pcie_tx"]], values[key["pcie_rx"]] = device.pcie

    def _read_table(self, device: _Device, values: dict[str, float], now: float, seldom_only: bool = False) -> None:
        """The _READS metrics: asked when due, the last value of a seldom-asked one repeated."""
        driver = self._require_driver()
        for metric, function, constants, scale, every in _READS:
            if seldom_only and every == 0.0:
                continue
            if now - device.asked.get(metric, -math.inf) >= every:
                device.asked[metric] = now
                arguments = [getattr(driver.nvml, name) for name in constants]
                value = driver.query(function, device.handle, *arguments, off=device.off, device=device.label)
                if isinstance(value, Absent):
                    device.held.pop(metric, None)
                else:
                    part = _PARTS.get(metric)
                    device.held[metric] = float(value if part is None else value[part]) * scale
            if metric in device.held:
                values[device.key[metric]] = device.held[metric]
            if every == 0.0:
                device.held.pop(metric, None)  # a per-tick reading is never repeated

    def _sampled_util(self, device: _Device, now: float) -> float | None:
        """Mean of the driver's utilization samples since the previous tick (finer than one poll).

        The driver keeps a buffer of samples taken every 1/6 s to 1 s. NotFound (or nothing newer than
        the last sample seen) happens when the GPU sits idle, as the driver then records nothing: the
        previous mean must not be repeated (an idle GPU would read as busy as it last was), so None
        sends the caller to nvmlDeviceGetUtilizationRates. The first call returns the whole buffer,
        which reaches back before this source existed: only its newest sample is used.
        """
        driver = self._require_driver()
        nvml = driver.nvml
        result = driver.query(
            "nvmlDeviceGetSamples",
            device.handle,
            nvml.NVML_GPU_UTILIZATION_SAMPLES,
            device.sample_time,
            off=device.off,
            device=device.label,
        )
        if isinstance(result, Absent):
            return None
        value_type, samples = result
        if not samples:
            return None
        member = _SAMPLE_MEMBERS.get(value_type, "uiVal")
        if device.sample_time == 0:
            newest = max(samples, key=lambda sample: sample.timeStamp)
            fresh = [newest]
        else:
            fresh = [sample for sample in samples if sample.timeStamp > device.sample_time]
            if not fresh:
                return None
        device.sample_time = max(sample.timeStamp for sample in fresh)
        total = 0.0
        for sample in fresh:
            total += getattr(sample.sampleValue, member)
        return total / len(fresh)

    def _listed(self, device: _Device) -> dict[int, int | None] | None:
        """Every process the driver lists on the device, with the bytes it holds (None where the
        driver won't say); None when the driver won't list processes at all."""
        if device.procs_off:
            return None
        driver = self._require_driver()
        held: dict[int, int | None] = {}
        answered = False
        for chain in (_COMPUTE_PROCESSES, _GRAPHICS_PROCESSES):
            processes = driver.query_chain(chain, device.handle, off=device.off, device=device.label)
            if processes is NO_PERMISSION:
                device.procs_off = True
                driver.report_once(
                    "no permission to list GPU processes; proc_mem is not reported", device.label
                )
                return None
            if isinstance(processes, Absent):
                continue
            if not _plausible(processes, device.info.memory_total):
                processes = self._older_process_list(device, chain)
                if processes is None:
                    return None
            answered = True
            for process in processes:
                # A process with both a compute and a graphics context is listed twice.
                used = process.usedGpuMemory
                previous = held.get(process.pid, 0)
                held[process.pid] = None if used is None or previous is None else max(previous, int(used))
        return held if answered else None

    def _older_process_list(self, device: _Device, chain: tuple[str, ...]) -> list[Any] | None:
        """The list again from the chain's older function, after the newer one gave a misread list.

        Early R535 drivers fill nvmlDeviceGet*RunningProcesses_v3 with 32-byte entries while the
        bindings read 24-byte ones (nvitop works around the same): every entry after the first is
        garbage. The _v2 function has the driver's own layout. If it is missing or misread too,
        per-process memory is left out on this device.
        """
        driver = self._require_driver()
        newer, older = driver.chosen(chain), chain[-1]
        processes = driver.query(older, device.handle, off=device.off, device=device.label, quiet=True)
        if newer != older and not isinstance(processes, Absent) and _plausible(processes, device.info.memory_total):
            driver.pin(chain, older)
            driver.report_once(
                f"{newer} and the driver disagree on the process struct (early R535: 32-byte "
                f"entries); process memory is read with {older}", device.label,
            )
            return list(processes)
        device.procs_off = True
        driver.report_once(
            "the driver's process list is misread by these bindings (early R535 process struct); "
            "proc_mem is not reported", device.label,
        )
        return None

    def _proc_mem(self, device: _Device) -> float | None:
        """Bytes our processes hold on the device, or None when the driver won't say."""
        held = self._listed(device)
        if held is None:
            return None
        ours = {pid: used for pid, used in held.items() if self._own is not None and pid in self._own}
        if not ours and foreign_pid_namespace(held):
            # Host pids: this process's memory is among them under a number we can't know. Leave
            # proc_mem out rather than report 0; the summary takes torch's memory_reserved instead.
            self.foreign_pid_namespace = True
            self._require_driver().report_once(
                "this process runs in its own PID namespace (a container): the driver reports host pids, "
                "so its own GPU memory is not known from NVML (torch's memory_reserved is used instead)",
            )
            return None
        if any(used is None for used in ours.values()):
            # MIG instances without privileges and Windows WDDM list processes without their memory.
            self._require_driver().report_once(
                "the driver lists our process without its memory; proc_mem is not reported", device.label
            )
            return None
        return float(sum(used for used in ours.values() if used is not None))

    def processes(self) -> dict[str, list[tuple[int, int | None]]]:
        """Every process on each watched GPU (``gpu0``: [(pid, bytes or None)]), whoever owns it.

        For the server's process table; never raises. A GPU whose processes can't be listed
        (no permission, lost) is absent.
        """
        out: dict[str, list[tuple[int, int | None]]] = {}
        with self._lock:
            if self._closed or not self.available:
                return out
            for device in self._devices:
                if device.lost is not None:
                    continue
                try:
                    held = self._listed(device)
                except _DeviceLost as lost:
                    self._end_device(device, str(lost))
                    continue
                except Exception as error:  # noqa: BLE001 - a table row is not worth a crash
                    self._require_driver().report_once(f"listing processes failed: {error!r}", device.label)
                    continue
                if held is not None:
                    out[device.label] = sorted(held.items())
        return out

    def _read_gpm(self, device: _Device, now: float) -> None:
        gpm = device.gpm
        assert gpm is not None
        if now - gpm.time < GPM_MIN_INTERVAL_S:
            return  # keep the last values: a pair closer than 100 ms is refused
        driver = self._require_driver()
        current, previous = gpm.samples[1], gpm.samples[0]
        if gpm.mig_instance_id is None:
            taken = driver.query("nvmlGpmSampleGet", device.handle, current, device=device.label)
        else:
            taken = driver.query(
                "nvmlGpmMigSampleGet",
                device.found.parent_handle,
                gpm.mig_instance_id,
                current,
                device=device.label,
            )
        if isinstance(taken, Absent):
            if taken is not FAILED:
                self._drop_gpm(device)
            return
        if gpm.taken:
            gpm.request.sample1 = previous
            gpm.request.sample2 = current
            result = driver.query("nvmlGpmMetricsGet", gpm.request, device=device.label)
            if isinstance(result, Absent):
                if result is not FAILED:
                    self._drop_gpm(device)
                return
            values: dict[str, float] = {}
            for slot, (metric, _, scale) in enumerate(gpm.ids):
                entry = gpm.request.metrics[slot]
                if entry.nvmlReturn == 0 and math.isfinite(entry.value):
                    values[metric] = entry.value * scale
            gpm.values = values
            gpm.ready = True
        gpm.samples = (current, previous)
        gpm.taken = True
        gpm.time = now

    def _drop_gpm(self, device: _Device) -> None:
        gpm = device.gpm
        device.gpm = None
        if gpm is not None:
            for sample in gpm.samples:
                self._require_driver().query("nvmlGpmSampleFree", sample, device=device.label)

    def _read_one_pcie(self, values: dict[str, float], now: float) -> None:
        """Refresh PCIe throughput of the device that waited longest, if due; see PCIE_REFRESH_S."""
        due: _Device | None = None
        for device in self._devices:
            if device.lost is not None or "nvmlDeviceGetPcieThroughput" in device.off:
                continue
            if device.gpm is not None and (device.gpm.gives_pcie or not device.gpm.ready):
                continue  # GPM reports PCIe without blocking (known once its first pair is in)
            if now - device.pcie_time >= PCIE_REFRESH_S and (due is None or device.pcie_time < due.pcie_time):
                due = device
        if due is not None:
            self._guarded(due, values, self._read_pcie, now)

    def _read_pcie(self, device: _Device, values: dict[str, float], now: float) -> None:
        driver = self._require_driver()
        nvml = driver.nvml
        device.pcie_time = now
        counters = []
        for counter in (nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES):
            kib_per_s = driver.query(
                "nvmlDeviceGetPcieThroughput", device.handle, counter, off=device.off, device=device.label
            )
            if isinstance(kib_per_s, Absent):
                return
            counters.append(kib_per_s * float(KIB))
        device.pcie = (counters[0], counters[1])
        values[device.key["pcie_tx"]], values[device.key["pcie_rx"]] = device.pcie


def clock_event_flags(events: int) -> tuple[float, float] | None:
    """NVML's clock-event bitmask as the vendor-neutral (slowdown, power_capped) flags, or None while
    the GPU idles (its clocks are low on purpose: neither a slowdown nor a cap)."""
    if events & CLOCK_EVENT_IDLE:
        return None
    return float(bool(events & SLOWDOWN_BITS)), float(bool(events & POWER_CAP_BIT))


def open_sources(gpus: Sequence[int] | None, pids: Callable[[], Iterable[int]] | None = None,
                 every_device: bool = False) -> Opened:
    """NVIDIA's GPUs, one :class:`NvmlSource` per GPU (:func:`gpuwidget.sources.gpu.open_gpu_sources`).

    A first source finds the GPUs (and the requested indexes CUDA lacks); with more than one GPU, each
    gets a source of its own over the devices the first found (none lists the GPUs again, so a GPU that
    hangs holds up its own source only), and the first is closed.
    """
    first = NvmlSource(gpus=gpus, pids=pids, every_device=every_device)
    opened = Opened("nvidia", driver=first.driver_found, missing=list(first.missing),
                    visible_count=first.visible_count, reason=first.unavailable_reason)
    if not first.available or first.missing:
        first.close()
        return opened
    indexes = [device.cuda_index for device in first._devices if device.lost is None]
    if len(indexes) == 1:
        opened.sources = [cast(GpuSource, first)]
        return opened
    found = (first.visible, first.cuda_order or "pci")
    sources = [NvmlSource(gpus=[index], pids=pids, every_device=every_device, _enumerated=found)
               for index in indexes]
    first.close()  # after the others started: NVML's handles live while any source holds NVML open
    for source in sources:
        if not source.available:
            source.close()
    opened.sources = [cast(GpuSource, source) for source in sources if source.available]
    if not opened.sources:
        opened.reason = "every requested GPU was lost"
    return opened
