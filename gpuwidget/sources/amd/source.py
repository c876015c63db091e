"""The AMD source: per-GPU readings of the devices HIP shows this process, through AMD SMI (amdsmi).

Columns are the vendor-neutral ones of :mod:`gpuwidget.sources.gpu`, named ``gpu{hip_index}.<metric>``:

=================  ==========================================================================
``util``           GFX engine activity % (amdsmi_get_gpu_activity: the share of time the GPU ran work,
                   amd-smi's "GFX_ACTIVITY", as nvidia-smi's utilisation is "kernel running")
``mem_util``       memory controller (UMC) activity %
``mem_used``       VRAM bytes in use; ``mem_total`` bytes (amdsmi_get_gpu_vram_usage, MiB)
``power``          W, the socket's power now (its average where the GPU reports no current figure: MI200)
``power_limit``    W enforced; ``power_limit_default``/``_min``/``_max`` W (amdsmi_get_power_cap_info, uW)
``energy_j``       J since the driver loaded (amdsmi_get_energy_count: counter x resolution in uJ)
``temperature``    degrees Celsius at the hotspot (junction), the edge sensor where there is none
``sm_clock``       Hz of the GFX clock; ``sm_clock_max`` Hz; ``mem_clock`` Hz (amdsmi_get_clock_info,
                   amdsmi_get_clk_freq where that is not supported)
``slowdown``       1 while a thermal limit holds the clocks (amdsmi_get_violation_status: socket, VR, HBM
                   thermal or PROCHOT active), else 0; ``power_capped`` 1 while package power tracking
                   (PPT) caps it. Without violation status: the throttle status of amdsmi_get_gpu_metrics_info
``pcie_total``     bytes/s over PCIe, both directions (AMD reports no direction); ``pcie_gen``/``pcie_width``
                   and their maxima (amdsmi_get_pcie_info, asked at most once a second as AMD advises)
``proc_mem``       VRAM bytes held by "our" processes (amdsmi_get_gpu_process_list)
=================  ==========================================================================

amdsmi gives no compute-unit activity (``sm_active``) nor matrix-core activity (``tensor_active``):
AMD's exporter reads those through the ROCm profiler. Here they are absent, and the busy figure is
the GFX activity, labelled "kernel running" as NVIDIA's utilisation is. A GPU split into compute
partitions (XCPs) is listed by amdsmi as one device per partition, each with ``compute_partition``
("CPX") and its ``partition_id``; each is a HIP device of its own.

A device that answers as a GPU gone does (NOT_FOUND, FILE_ERROR, I/O...) and then no longer gives
its PCI address, or does so SUSPECT_STRIKES ticks in a row, is lost; the other devices go on.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from gpuwidget.facts import GpuFacts
from gpuwidget.sources.amd.devices import (
    Found,
    enumerate_devices,
    in_torch_order,
    visibility,
    visible,
)
from gpuwidget.sources.amd.driver import (
    MHZ,
    MIB,
    NO_DRIVER,
    Absent,
    _DeviceSuspect,
    _Driver,
    _load_amdsmi,
    error_code,
    field,
    number,
    start,
)
from gpuwidget.sources.base import ErrorLog, SourceError
from gpuwidget.sources.gpu import GpuDescription, GpuSource, Opened
from gpuwidget.sources.pids import OwnProcesses, foreign_pid_namespace, namespace_pids

# Tests freeze time by replacing this (tests/fakeamdsmi.py).
_now: Callable[[], float] = time.monotonic

# AMD: "For accurate PCIe Bandwidth measurements it is recommended to use this function once per 1000ms"
# (amdsmi_get_pcie_info); the last value is repeated in between.
PCIE_REFRESH_S = 1.0
# The power limits and the memory clock change only when an administrator sets them.
SELDOM_REFRESH_S = 10.0
# A suspect answer this many ticks in a row (the PCI address still answering) ends the device.
SUSPECT_STRIKES = 3
# Where the kernel driver (amdgpu's KFD) exposes GPUs to compute: its presence without amdsmi says an
# AMD GPU is there but the bindings are not installed.
KFD_PATH = "/dev/kfd"

# PCIe per-lane transfer rate (MT/s) -> generation.
PCIE_GENERATIONS = {2500: 1, 5000: 2, 8000: 3, 16000: 4, 32000: 5, 64000: 6}
# amdsmi_get_violation_status: which active limit means what.
THERMAL_VIOLATIONS = ("active_socket_thrm", "active_vr_thrm", "active_hbm_thrm", "active_prochot_thrm")
POWER_VIOLATION = "active_ppt_pwr"
# Bits of gpu_metrics' indep_throttle_status (the kernel's SMU_THROTTLER_*_BIT, kgd_pp_interface.h), where
# the bindings give the number: PPT0-3, SPL, FPPT, SPPT, SPPT_APU (power); TEMP_* and VR_HOT / PROCHOT.
POWER_THROTTLE_BITS = 0xFF
THERMAL_THROTTLE_BITS = 0xFFFF << 32

METRICS = ("util", "mem_util", "mem_used", "mem_total", "power", "power_limit", "power_limit_default",
           "power_limit_min", "power_limit_max", "energy_j", "temperature", "sm_clock", "sm_clock_max",
           "mem_clock", "slowdown", "power_capped", "pcie_total", "pcie_gen", "pcie_width", "pcie_gen_max",
           "pcie_width_max", "proc_mem")


class _Device:
    """A visible device: its handle, static facts, and the state carried between ticks."""

    def __init__(self, index: int, found: Found) -> None:
        self.index = index
        self.label = f"gpu{index}"
        self.found = found
        self.handle = found.handle
        self.key = {metric: f"{self.label}.{metric}" for metric in METRICS}
        self.off: dict[str, Absent] = {}
        self.lost: str | None = None
        self.strikes = 0
        self.held: dict[str, float] = {}  # readings asked less than every tick, repeated in between
        self.asked: dict[str, float] = {}
        self.procs_off = False

    def describe(self) -> GpuFacts:
        found = self.found
        return {
            "id": self.label,
            "index": self.index,
            "vendor": "amd",
            "driver_index": found.driver_index,
            "uuid": found.uuid,
            "name": found.name,
            "memory_total": found.memory_total,
            "power_limit": self.held.get("power_limit"),
            "power_limit_default": self.held.get("power_limit_default"),
            "sm_clock_max": self.held.get("sm_clock_max"),
            "capability": None,
            "arch": found.arch,
            "pcie_gen_max": _whole(self.held.get("pcie_gen_max")),
            "pcie_width_max": _whole(self.held.get("pcie_width_max")),
            "is_mig": False,
            "parent_uuid": None,
            "mig_mode": False,
            "gpu_instance_id": None,
            "mig_profile": None,
            "compute_partition": found.compute_partition,
            "memory_partition": found.memory_partition,
            "partition_id": found.partition_id,
            "serial": found.serial,
            "pci_bus_id": found.bdf,
            "gpm": False,
            "lost": self.lost,
        }


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


class AmdSource:
    """Per-GPU readings of the AMD devices HIP shows this process, one pass of amdsmi per tick.

    ``gpus`` selects HIP device indexes (torch.cuda's on a ROCm build); ``None`` means every visible
    device. ``pids`` returns the process ids whose GPU memory counts as ours (default: this process and
    its descendants). ``every_device`` is the machine's view (the server): every device amdsmi lists,
    whatever the visibility variables say. Without amdsmi, its driver or a GPU the source is
    ``available = False`` with ``unavailable_reason`` set (``driver_found`` says whether an AMD driver
    is there at all), and ``read()`` returns ``{}``.
    """

    name = "amdsmi"

    def __init__(self, gpus: Sequence[int] | None = None, pids: Callable[[], Iterable[int]] | None = None,
                 every_device: bool = False, *, _enumerated: list[Found] | None = None) -> None:
        self._log = ErrorLog(self.name)
        self.errors: list[SourceError] = self._log.errors
        self.every_device = every_device
        self.available = False
        self.unavailable_reason: str | None = None
        self.driver_found = False
        self.missing: list[int] = []
        self.visible_count = 0
        self.visible: list[Found] = []
        self.busy_with: str | None = None
        self._devices: list[_Device] = []
        self._lock = threading.Lock()
        self._closed = False
        self._initialised = False
        self._driver: _Driver | None = None
        self._own: OwnProcesses | None = None
        self.foreign_pid_namespace = len(namespace_pids()) > 1
        self._start(gpus, pids, _enumerated)

    # -- life cycle ------------------------------------------------------------------------------

    def _start(self, gpus: Sequence[int] | None, pids: Callable[[], Iterable[int]] | None,
               enumerated: list[Found] | None) -> None:
        try:
            amdsmi = _load_amdsmi()
        except Exception as error:  # noqa: BLE001 - not installed, or its library missing
            if _kfd_present():
                self.driver_found = True
                self._unavailable(f"an AMD GPU driver is loaded ({KFD_PATH}) but AMD's amdsmi Python package "
                                  f"could not be imported ({error}): install the one of the ROCm release")
            else:
                self._unavailable("no AMD GPU driver")
            return
        try:
            start(amdsmi)
        except Exception as error:  # noqa: BLE001 - AmdSmiLibraryException and friends
            if error_code(error) in NO_DRIVER and not _kfd_present():
                self._unavailable("no AMD GPU driver")
            else:
                self.driver_found = True
                self._unavailable(f"amdsmi failed to start: {str(error).strip() or type(error).__name__}")
            return
        self._initialised = self.driver_found = True
        driver = self._driver = _Driver(amdsmi, self._log)
        version = driver.query("amdsmi_get_lib_version", quiet=True)
        driver.lib_version = None if isinstance(version, Absent) else str(version)
        self._own = OwnProcesses(pids, driver.report_once)
        if enumerated is None:
            try:
                listed = enumerate_devices(driver)
            except Exception as error:  # noqa: BLE001 - enumeration must not make the constructor raise
                driver.report_once(f"listing GPUs failed: {error!r}")
                listed = []
            if not listed:
                self._unavailable("the AMD driver lists no GPU")
                return
            shown = listed if self.every_device else in_torch_order(visible(listed))
        else:
            shown = enumerated
        self.visible = shown
        if not shown:
            self._unavailable(f"no AMD GPU visible to HIP ({visibility()})")
            return
        self.visible_count = len(shown)
        wanted = range(len(shown)) if gpus is None else gpus
        for index in map(int, wanted):
            if not 0 <= index < len(shown):
                self.missing.append(index)
                driver.report_once(f"GPU {index} requested but only {len(shown)} visible to HIP")
                continue
            if any(device.index == index for device in self._devices):
                continue
            device = _Device(index, shown[index])
            try:
                self._read_seldom(device, {}, _now())
            except _DeviceSuspect as gone:
                self._end_device(device, str(gone))
            self._devices.append(device)
        if not any(device.lost is None for device in self._devices):
            if self.missing and not self._devices:
                self._unavailable(f"GPU {self.missing[0]} is not visible to HIP ({len(shown)} visible)")
            else:
                self._unavailable("every requested GPU was lost")
            return
        self.available = True
        if self._own is not None:
            self._own.refresh(_now())
        for device in self._devices:
            if device.lost is None:
                with contextlib.suppress(Exception):
                    self._proc_mem(device)

    def _unavailable(self, reason: str) -> None:
        self.available = False
        self.unavailable_reason = reason

    def close(self) -> None:
        """Shut amdsmi down (once); later reads return ``{}``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._driver is None or not self._initialised:
                return
            try:
                self._driver.amdsmi.amdsmi_shut_down()
            except Exception as error:  # noqa: BLE001
                self._driver.report_once(f"amdsmi_shut_down failed: {error}")

    @property
    def closed(self) -> bool:
        """True once nothing more will come: closed, never available, or every GPU lost."""
        return self._closed or not self.available or all(device.lost for device in self._devices)

    @property
    def driver_version(self) -> str | None:
        return None if self._driver is None else self._driver.lib_version

    def describe(self) -> list[GpuDescription]:
        """Each selected device's static facts (``index`` its HIP index, ``driver_index`` amd-smi's)."""
        return [{**device.describe(), "foreign_pid_namespace": self.foreign_pid_namespace}
                for device in self._devices]

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
                        self._guarded(device, values, now)
            except Exception as error:  # noqa: BLE001 - never out of read(): the sampler thread must live on
                self._require_driver().report_once(f"reading failed: {type(error).__name__}: {error}")
        return values

    def _guarded(self, device: _Device, values: dict[str, float], now: float) -> None:
        self.busy_with = f"GPU {device.index}"
        try:
            self._read_device(device, values, now)
            device.strikes = 0
        except _DeviceSuspect as suspect:
            for key in device.key.values():
                values.pop(key, None)  # this tick's readings of the device are suspect
            if self._confirm_lost(device):
                self._end_device(device, str(suspect))
            else:
                self._require_driver().report_once(
                    f"the GPU answered as one gone does ({suspect}); its tick was skipped, the GPU still answers",
                    device.label)
        except Exception as error:  # noqa: BLE001 - our own bug: lose this tick for this device, never the sampler
            self._require_driver().report_once(f"reading failed: {type(error).__name__}: {error}", device.label)
        finally:
            self.busy_with = None

    def _confirm_lost(self, device: _Device) -> bool:
        """Lost when the device no longer gives its PCI address (a GPU off the bus answers nothing), or
        after SUSPECT_STRIKES ticks in a row of suspect answers."""
        try:
            answered = not isinstance(
                self._require_driver().query("amdsmi_get_gpu_device_bdf", device.handle, quiet=True), Absent)
        except _DeviceSuspect:
            answered = False
        device.strikes += 1
        return not answered or device.strikes >= SUSPECT_STRIKES

    def _end_device(self, device: _Device, reason: str) -> None:
        device.lost = reason
        self._log.record(f"GPU lost, no more readings from it ({reason})", device.label, time.time())

    def _require_driver(self) -> _Driver:
        assert self._driver is not None
        return self._driver

    def _q(self, device: _Device, name: str, *args: Any, key: str | None = None, quiet: bool = False) -> Any:
        return self._require_driver().query(name, device.handle, *args, off=device.off, device=device.label,
                                            key=key, quiet=quiet)

    def _read_device(self, device: _Device, values: dict[str, float], now: float) -> None:
        driver = self._require_driver()
        key = device.key

        activity = self._q(device, "amdsmi_get_gpu_activity")
        _put(values, key["util"], field(activity, "gfx_activity"))
        _put(values, key["mem_util"], field(activity, "umc_activity"))

        vram = self._q(device, "amdsmi_get_gpu_vram_usage")
        used, total = field(vram, "vram_used"), field(vram, "vram_total")
        _put(values, key["mem_used"], None if used is None else used * MIB)
        _put(values, key["mem_total"], None if total is None else total * MIB)

        power = self._q(device, "amdsmi_get_power_info")
        current = field(power, "current_socket_power")
        _put(values, key["power"], current if current else field(power, "average_socket_power"))

        energy = self._q(device, "amdsmi_get_energy_count")
        counter, resolution = field(energy, "energy_accumulator"), field(energy, "counter_resolution")
        if counter is not None and resolution is not None:
            values[key["energy_j"]] = counter * resolution * 1e-6  # uJ

        values.update(self._temperature(device, driver))
        self._clocks(device, values, driver)
        self._throttle(device, values)
        self._read_seldom(device, values, now)

        proc_mem = self._proc_mem(device)
        if proc_mem is not None:
            values[key["proc_mem"]] = proc_mem

    def _temperature(self, device: _Device, driver: _Driver) -> dict[str, float]:
        metric = driver.enum("AmdSmiTemperatureMetric", "CURRENT")
        for sensor in ("HOTSPOT", "EDGE"):
            kind = driver.enum("AmdSmiTemperatureType", sensor)
            if kind is None or metric is None:
                continue
            value = number(self._q(device, "amdsmi_get_temp_metric", kind, metric, key=f"temp_{sensor}"))
            if value is not None:
                return {device.key["temperature"]: value}
        return {}

    def _clocks(self, device: _Device, values: dict[str, float], driver: _Driver) -> None:
        gfx = driver.enum("AmdSmiClkType", "GFX")
        if gfx is None:
            return
        info = self._q(device, "amdsmi_get_clock_info", gfx, key="clock_gfx")
        now_mhz, max_mhz = field(info, "clk"), field(info, "max_clk")
        if now_mhz is not None:
            values[device.key["sm_clock"]] = now_mhz * MHZ
            if max_mhz:
                device.held["sm_clock_max"] = max_mhz * MHZ
        else:  # the DPM table: the supported frequencies (Hz) and which one runs now
            table = self._q(device, "amdsmi_get_clk_freq", gfx, key="freq_gfx")
            frequencies = [f for f in (table.get("frequency") or []) if number(f)] if isinstance(table, Mapping) \
                else []
            current = table.get("current") if isinstance(table, Mapping) else None
            if frequencies and isinstance(current, int) and 0 <= current < len(frequencies):
                values[device.key["sm_clock"]] = float(frequencies[current])
                device.held["sm_clock_max"] = float(max(frequencies))
        if "sm_clock_max" in device.held:
            values[device.key["sm_clock_max"]] = device.held["sm_clock_max"]

    def _throttle(self, device: _Device, values: dict[str, float]) -> None:
        """``slowdown`` and ``power_capped`` from the violation status (MI300 and newer), else from the
        throttle status in the GPU's metrics table."""
        status = self._q(device, "amdsmi_get_violation_status")
        if isinstance(status, Mapping):
            thermal = [status.get(name) for name in THERMAL_VIOLATIONS if isinstance(status.get(name), bool)]
            power = status.get(POWER_VIOLATION)
            if thermal:
                values[device.key["slowdown"]] = float(any(thermal))
            if isinstance(power, bool):
                values[device.key["power_capped"]] = float(power)
            if thermal or isinstance(power, bool):
                return
        metrics = self._q(device, "amdsmi_get_gpu_metrics_info")
        if not isinstance(metrics, Mapping):
            return
        independent = metrics.get("indep_throttle_status")
        if isinstance(independent, int) and not isinstance(independent, bool):
            values[device.key["slowdown"]] = float(bool(independent & THERMAL_THROTTLE_BITS))
            values[device.key["power_capped"]] = float(bool(independent & POWER_THROTTLE_BITS))
            return
        # The bindings reduce the bitmask to "throttled or not": a power cap cannot be told apart.
        throttled = metrics.get("throttle_status")
        if isinstance(throttled, (bool, int)):
            values[device.key["slowdown"]] = float(bool(throttled))

    def _read_seldom(self, device: _Device, values: dict[str, float], now: float) -> None:
        """Power limits, the memory clock and the PCIe link: asked when due, repeated in between."""
        driver = self._require_driver()
        if _due(device, "limits", now, SELDOM_REFRESH_S):
            caps = self._q(device, "amdsmi_get_power_cap_info")
            for metric, name in (("power_limit", "power_cap"), ("power_limit_default", "default_power_cap"),
                                 ("power_limit_min", "min_power_cap"), ("power_limit_max", "max_power_cap")):
                _hold(device, metric, None if (value := field(caps, name)) is None else value * 1e-6)  # uW
            mem = driver.enum("AmdSmiClkType", "MEM")
            info = self._q(device, "amdsmi_get_clock_info", mem, key="clock_mem") if mem is not None else None
            _hold(device, "mem_clock", None if (value := field(info, "clk")) is None else value * MHZ)
            if "sm_clock_max" not in device.held:
                gfx = driver.enum("AmdSmiClkType", "GFX")
                info = self._q(device, "amdsmi_get_clock_info", gfx, key="clock_gfx") if gfx is not None else None
                _hold(device, "sm_clock_max", None if (value := field(info, "max_clk")) is None else value * MHZ)
        if _due(device, "pcie", now, PCIE_REFRESH_S):
            pcie = self._q(device, "amdsmi_get_pcie_info")
            speed = field(pcie, "pcie_metric", "pcie_speed")
            _hold(device, "pcie_gen", None if speed is None else PCIE_GENERATIONS.get(int(speed)))
            _hold(device, "pcie_width", field(pcie, "pcie_metric", "pcie_width"))
            bandwidth = field(pcie, "pcie_metric", "pcie_bandwidth")
            _hold(device, "pcie_total", None if bandwidth is None else bandwidth * 1e6 / 8)  # Mb/s
            _hold(device, "pcie_gen_max", field(pcie, "pcie_static", "pcie_interface_version"))
            _hold(device, "pcie_width_max", field(pcie, "pcie_static", "max_pcie_width"))
        for metric in ("power_limit", "power_limit_default", "power_limit_min", "power_limit_max", "mem_clock",
                       "pcie_gen", "pcie_width", "pcie_total", "pcie_gen_max", "pcie_width_max"):
            if metric in device.held:
                values[device.key[metric]] = device.held[metric]

    # -- processes -----------------------------------------------------------------------------

    def _listed(self, device: _Device) -> dict[int, int | None] | None:
        """Every process the driver lists on the device, with the VRAM bytes it holds (None where it
        won't say); None when the driver won't list processes at all."""
        if device.procs_off:
            return None
        listed = self._q(device, "amdsmi_get_gpu_process_list")
        if isinstance(listed, Absent):
            if "amdsmi_get_gpu_process_list" in device.off:
                device.procs_off = True
                self._require_driver().report_once(
                    f"the driver won't list GPU processes ({listed.reason}); proc_mem is not reported", device.label)
            return None
        held: dict[int, int | None] = {}
        for entry in listed or []:
            info = entry if isinstance(entry, Mapping) else self._q(device, "amdsmi_get_gpu_process_info", entry,
                                                                     quiet=True)
            if not isinstance(info, Mapping) or not isinstance(info.get("pid"), int):
                continue
            memory = field(info, "memory_usage", "vram_mem")
            if memory is None:
                memory = field(info, "mem")
            held[int(info["pid"])] = None if memory is None else int(memory)
        return held

    def _proc_mem(self, device: _Device) -> float | None:
        """VRAM bytes our processes hold on the device, or None when the driver won't say."""
        held = self._listed(device)
        if held is None:
            return None
        ours = {pid: used for pid, used in held.items() if self._own is not None and pid in self._own}
        if not ours and foreign_pid_namespace(held):
            self.foreign_pid_namespace = True
            self._require_driver().report_once(
                "this process runs in its own PID namespace (a container): the driver reports host pids, "
                "so its own GPU memory is not known from amdsmi (torch's memory_reserved is used instead)")
            return None
        if any(used is None for used in ours.values()):
            return None
        return float(sum(used for used in ours.values() if used is not None))

    def processes(self) -> dict[str, list[tuple[int, int | None]]]:
        """Every process on each watched GPU (``gpu0``: [(pid, bytes or None)]), whoever owns it; never raises."""
        out: dict[str, list[tuple[int, int | None]]] = {}
        with self._lock:
            if self._closed or not self.available:
                return out
            for device in self._devices:
                if device.lost is not None:
                    continue
                try:
                    held = self._listed(device)
                except _DeviceSuspect as gone:
                    if self._confirm_lost(device):
                        self._end_device(device, str(gone))
                    continue
                except Exception as error:  # noqa: BLE001 - a table row is not worth a crash
                    self._require_driver().report_once(f"listing processes failed: {error!r}", device.label)
                    continue
                if held is not None:
                    out[device.label] = sorted(held.items())
        return out


def _put(values: dict[str, float], key: str, value: float | None) -> None:
    if value is not None and math.isfinite(value):
        values[key] = float(value)


def _hold(device: _Device, metric: str, value: float | None) -> None:
    if value is None:
        device.held.pop(metric, None)
    else:
        device.held[metric] = float(value)


def _due(device: _Device, what: str, now: float, every: float) -> bool:
    if now - device.asked.get(what, -math.inf) >= every:
        device.asked[what] = now
        return True
    return False


def _kfd_present() -> bool:
    import os

    return os.path.exists(KFD_PATH)


def open_sources(gpus: Sequence[int] | None, pids: Callable[[], Iterable[int]] | None = None,
                 every_device: bool = False) -> Opened:
    """AMD's GPUs, one :class:`AmdSource` per device (:func:`gpuwidget.sources.gpu.open_gpu_sources`).

    A first source finds the devices; with more than one, each gets a source of its own over the devices
    the first found (none lists the GPUs again, so a GPU that hangs holds up its own source only).
    """
    first = AmdSource(gpus=gpus, pids=pids, every_device=every_device)
    opened = Opened("amd", driver=first.driver_found, missing=list(first.missing),
                    visible_count=first.visible_count, reason=first.unavailable_reason)
    if not first.available or first.missing:
        first.close()
        return opened
    indexes = [device.index for device in first._devices if device.lost is None]
    if len(indexes) == 1:
        opened.sources = [cast(GpuSource, first)]
        return opened
    sources = [AmdSource(gpus=[index], pids=pids, every_device=every_device, _enumerated=first.visible)
               for index in indexes]
    first.close()  # after the others started: amdsmi's handles live while any source holds it open
    for source in sources:
        if not source.available:
            source.close()
    opened.sources = [cast(GpuSource, source) for source in sources if source.available]
    if not opened.sources:
        opened.reason = "every requested GPU was lost"
    return opened
