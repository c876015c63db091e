"""A fake ``amdsmi`` for tests: AMD SMI's Python bindings as a module, with their errors, enums and units.

No AMD GPU was at hand: this fake follows the bindings' own code (py-interface/amdsmi_interface.py
and amdsmi_exception.py of ROCm/amdsmi) and amdsmi.h, as strictly as tests/fakenvml.py follows NVML:

* errors are the bindings' types: ``AmdSmiLibraryException(err_code)`` with ``err_code``/``err_info``
  (``AmdSmiRetryException``, ``AmdSmiTimeoutException`` for RETRY and TIMEOUT), ``AmdSmiParameterException``
  for an argument that is not a processor handle or not the enum the function takes;
* every call before ``amdsmi_init`` (or after the last ``amdsmi_shut_down``) answers AMDSMI_STATUS_NOT_INIT;
  init and shut-down are reference-counted;
* a function a GPU does not support answers AMDSMI_STATUS_NOT_SUPPORTED; a field the firmware does not
  fill reads "N/A" (an MI300X has no average socket power, an MI250X no current one); a function the
  bindings lack is simply not in the module (``without()``);
* a lost GPU answers AMDSMI_STATUS_NOT_FOUND to everything, its PCI address included;
* the library can be missing (``import amdsmi`` fails) or its driver not loaded (``amdsmi_init`` fails).

Units as the bindings give them: VRAM in MiB, power in W, power caps in uW, the energy counter in
ticks of ``counter_resolution`` uJ, temperatures in degrees C, amdsmi_get_clock_info in MHz,
amdsmi_get_clk_freq in Hz, PCIe speed in MT/s per lane and bandwidth in Mb/s.

Use it through the ``fake_amdsmi`` fixture (``fake = fake_amdsmi(FakeAmdSmi.mi300x(8))``) or as a
context manager (``with FakeAmdSmi.mi300x().patched(): ...``). Time is frozen: ``fake.step()`` moves
to the next tick (per-tick values are sequences indexed by tick, or functions of it) and advances the
clock AmdSource uses by ``tick_s``; ``real_time=True`` derives the tick from elapsed wall time.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

MIB = 1024 * 1024
GIB = 1024 * MIB

# amdsmi_status_t (amd_smi/amdsmi.h).
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
_STATUS_TEXT = {
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_TIMEOUT: "AMDSMI_STATUS_TIMEOUT - Timeout in API call",
    AMDSMI_STATUS_RETRY: "AMDSMI_STATUS_RETRY - Retry operation",
    AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AMDSMI_STATUS_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
}


# -- the bindings' exceptions (amdsmi_exception.py) -----------------------------------------------


class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _STATUS_TEXT.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_code(self) -> int:
        return self.err_code

    def get_error_info(self) -> str:
        return self.err_info


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, received: Any, expected: Any) -> None:
        super().__init__(f"Invalid parameter:\nActual type: {type(received)}\nExpected type: {expected}")
        self.err_code = None


# -- the bindings' enums (amdsmi_interface.py) ------------------------------------------------------


class AmdSmiInitFlags(enum.IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1 << 0
    INIT_AMD_GPUS = 1 << 1
    INIT_NON_AMD_CPUS = 1 << 2
    INIT_NON_AMD_GPUS = 1 << 3
    INIT_AMD_APUS = INIT_AMD_CPUS | INIT_AMD_GPUS


class AmdSmiClkType(enum.IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5
    VCLK0 = 6
    VCLK1 = 7
    DCLK0 = 8
    DCLK1 = 9


class AmdSmiTemperatureType(enum.IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(enum.IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    MAX_HYST = 3
    MIN_HYST = 4
    CRITICAL = 5
    CRITICAL_HYST = 6
    EMERGENCY = 7
    EMERGENCY_HYST = 8
    CRIT_MIN = 9
    CRIT_MIN_HYST = 10
    OFFSET = 11
    LOWEST = 12
    HIGHEST = 13


class ProcessorHandle:
    """amdsmi_wrapper.amdsmi_processor_handle: an opaque pointer; the fake's points at its GPU."""

    def __init__(self, gpu: FakeAmdGpu) -> None:
        self.gpu = gpu

    def __repr__(self) -> str:
        return f"<amdsmi_processor_handle {self.gpu.bdf}>"


class ProcessHandle:
    """The older bindings' process handle (amdsmi_get_gpu_process_list listed these)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


# Per-tick value: a constant, a sequence indexed by tick (the last value repeats), or f(tick).
Value = Any
NA = "N/A"


def _at(value: Value, tick: int) -> Any:
    if callable(value):
        return value(tick)
    if isinstance(value, (list, tuple)):
        return value[min(tick, len(value) - 1)]
    return value


@dataclass(eq=False)
class FakeAmdGpu:
    """One device as amdsmi lists it (a whole GPU, or one compute partition of it)."""

    uuid: str
    bdf: str
    market_name: str = "AMD Instinct MI300X"
    arch: str = "gfx942"
    serial: str = "692251001124"
    vram_total_mib: int = 196_592  # 192 GiB HBM3
    vram_used_mib: Value = 16_384
    gfx_activity: Value = 90
    umc_activity: Value = 40
    current_socket_power: Value = 600  # W; "N/A" where the firmware gives none (MI200)
    average_socket_power: Value = NA
    power_cap_uw: Value = 750_000_000
    default_power_cap_uw: int = 750_000_000
    min_power_cap_uw: int = 0
    max_power_cap_uw: int = 750_000_000
    energy_start: int = 5_000_000_000_000  # counter ticks since the driver loaded
    counter_resolution: float = 15.259  # uJ per tick
    hotspot_c: Value = 55
    edge_c: Value = NA  # MI300 has no edge sensor: NOT_SUPPORTED (see unsupported)
    gfx_clock_mhz: Value = 2100
    gfx_clock_max_mhz: int = 2100
    mem_clock_mhz: int = 1300
    pcie_speed_mts: Value = 32_000  # Gen5
    pcie_width: Value = 16
    pcie_bandwidth_mbps: Value = 8_000  # Mb/s, both directions
    pcie_gen_max: int = 5
    pcie_width_max: int = 16
    # Violation status (MI300 and newer): which limit holds the clocks now.
    ppt_active: Value = False
    thermal_active: Value = False
    # gpu_metrics' indep_throttle_status (kernel SMU_THROTTLER_* bits) for GPUs without violation status.
    throttle_bits: Value = 0
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    partition_id: int = 0
    kfd_id: int = 51_545
    node_id: int = 2
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, VRAM bytes)
    unsupported: set[str] = field(default_factory=set)
    no_permission: set[str] = field(default_factory=set)
    lost_at_tick: int | None = None

    def lost(self, tick: int) -> bool:
        return self.lost_at_tick is not None and tick >= self.lost_at_tick


def make_gpu(index: int, **fields: Any) -> FakeAmdGpu:
    """A healthy MI300X at amd-smi index ``index``, with a distinct UUID and PCI address."""
    base = {"uuid": f"{0xA8FF7551 + index:08x}-0000-1000-80e9-ddefa2d60f{0x55 + index:02x}",
            "bdf": f"0000:{0x05 + 0x10 * index:02x}:00.0", "serial": f"69225100112{index}"}
    return FakeAmdGpu(**{**base, **fields})


# MI300X boards have no edge sensor and no average power (current_socket_power instead).
MI300X = {"market_name": "AMD Instinct MI300X", "arch": "gfx942", "unsupported": {"temp_edge"}}
MI250X = {"market_name": "AMD Instinct MI250X/MI250", "arch": "gfx90a", "vram_total_mib": 65_520,
          "current_socket_power": NA, "average_socket_power": 480, "power_cap_uw": 560_000_000,
          "default_power_cap_uw": 560_000_000, "max_power_cap_uw": 560_000_000, "gfx_clock_max_mhz": 1700,
          "gfx_clock_mhz": 1700, "pcie_speed_mts": 16_000, "pcie_gen_max": 4, "edge_c": 45}


class FakeAmdSmi:
    """The state of a fake AMD driver, its scenario builders, and the fake ``amdsmi`` module's functions."""

    def __init__(self, gpus: Sequence[FakeAmdGpu] = (), *, init_error: int | None = None,
                 library_missing: bool = False, int_throttle: bool = False, old_process_api: bool = False,
                 real_time: bool = False, tick_s: float = 0.1, kfd: bool = True) -> None:
        self.devices = list(gpus)
        self.init_error = init_error
        self.library_missing = library_missing
        self.int_throttle = int_throttle  # older bindings: indep_throttle_status as the number
        self.old_process_api = old_process_api  # older bindings: process handles + amdsmi_get_gpu_process_info
        self.real_time = real_time
        self.tick_s = tick_s
        self.kfd = kfd  # /dev/kfd exists (an AMD driver is loaded)
        self.missing: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.device_calls: Counter[tuple[str, str]] = Counter()
        self.inits = 0
        self.time = 1000.0
        self._tick = 0
        self._start = time.monotonic()
        self._handles = {id(gpu): ProcessorHandle(gpu) for gpu in self.devices}

    # -- scenarios -------------------------------------------------------------------------------

    @classmethod
    def mi300x(cls, count: int = 1, **fields: Any) -> FakeAmdSmi:
        """``count`` MI300X GPUs (gfx942, 192 GB) on ROCm 6.3-era bindings."""
        return cls([make_gpu(index, **{**MI300X, "unsupported": set(MI300X["unsupported"]), **fields})
                    for index in range(count)])

    @classmethod
    def mi250x(cls, count: int = 1, **fields: Any) -> FakeAmdSmi:
        """``count`` MI250X GCDs (gfx90a): no violation status, the throttle status from the metrics table."""
        return cls([make_gpu(index, **{**MI250X, "unsupported": {"amdsmi_get_violation_status"}, **fields})
                    for index in range(count)])

    @classmethod
    def cpx(cls, partitions: int = 8) -> FakeAmdSmi:
        """One MI300X in CPX mode: amdsmi lists each compute partition (XCP) as a device of its own."""
        gpus = [make_gpu(0, **{**MI300X, "unsupported": {"temp_edge"}, "compute_partition": "CPX",
                               "partition_id": slot, "bdf": f"0000:05:00.{slot}",
                               "uuid": f"a8ff7551-0000-1000-80e9-ddefa2d60f{slot:02x}",
                               "vram_total_mib": 196_592 // partitions})
                for slot in range(partitions)]
        return cls(gpus)

    @classmethod
    def missing_library(cls) -> FakeAmdSmi:
        """amdsmi not installed (or its libamd_smi.so not found): ``import amdsmi`` fails; no /dev/kfd."""
        return cls(library_missing=True, kfd=False)

    @classmethod
    def driver_not_loaded(cls) -> FakeAmdSmi:
        """The bindings are there, the amdgpu driver is not: amdsmi_init fails."""
        return cls(init_error=AMDSMI_STATUS_DRIVER_NOT_LOADED, kfd=False)

    def gpu(self, index: int) -> FakeAmdGpu:
        return self.devices[index]

    def set(self, index: int, **fields: Any) -> FakeAmdSmi:
        gpu = self.gpu(index)
        for name, value in fields.items():
            if not hasattr(gpu, name):
                raise AttributeError(f"FakeAmdGpu has no field {name!r}")
            setattr(gpu, name, value)
        return self

    def not_supported(self, index: int, *functions: str) -> FakeAmdSmi:
        """amdsmi functions (or "temp_edge"/"temp_hotspot") that answer NOT_SUPPORTED on that device."""
        self.gpu(index).unsupported |= set(functions)
        return self

    def lose_gpu(self, index: int, at_tick: int) -> FakeAmdSmi:
        """From tick ``at_tick`` on, every call on that device answers NOT_FOUND."""
        self.gpu(index).lost_at_tick = at_tick
        return self

    def without(self, *functions: str) -> FakeAmdSmi:
        """Bindings that lack these functions (an older amdsmi)."""
        self.missing |= set(functions)
        return self

    # -- time ------------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        if self.real_time:
            return int((time.monotonic() - self._start) / self.tick_s)
        return self._tick

    def step(self, ticks: int = 1) -> None:
        self._tick += ticks
        self.time += ticks * self.tick_s

    def now(self) -> float:
        return self.time

    def elapsed(self) -> float:
        """Seconds of fake time since the fake was made (wall time with ``real_time``)."""
        return time.monotonic() - self._start if self.real_time else self.time - 1000.0

    def count(self, name: str, index: int | None = None) -> int:
        return self.calls[name] if index is None else self.device_calls[(name, self.gpu(index).uuid)]

    # -- installing ------------------------------------------------------------------------------

    def module(self) -> types.ModuleType:
        """The fake ``amdsmi`` module: the functions below, the enums and the exception types."""
        module = types.ModuleType("amdsmi")
        for name in ("AmdSmiException", "AmdSmiLibraryException", "AmdSmiRetryException",
                     "AmdSmiTimeoutException", "AmdSmiParameterException", "AmdSmiInitFlags", "AmdSmiClkType",
                     "AmdSmiTemperatureType", "AmdSmiTemperatureMetric"):
            setattr(module, name, globals()[name])
        for name in dir(self):
            if name.startswith("amdsmi_") and name not in self.missing:
                setattr(module, name, getattr(self, name))
        module.__version__ = "25.0.0+fake"  # type: ignore[attr-defined]
        return module

    @contextlib.contextmanager
    def patched(self) -> Iterator[FakeAmdSmi]:
        """``import amdsmi`` gives the fake (or fails, ``missing_library``) and AmdSource's clock is frozen."""
        import gpuwidget.sources.amd.source as amd_source

        saved_module = sys.modules.get("amdsmi")
        saved = (amd_source._now, amd_source.KFD_PATH)
        if self.library_missing:
            sys.modules["amdsmi"] = None  # type: ignore[assignment]  # import raises ImportError
        else:
            sys.modules["amdsmi"] = self.module()
        if not self.real_time:
            amd_source._now = self.now
        amd_source.KFD_PATH = "/" if self.kfd else os.path.join(os.sep, "nonexistent", "kfd")
        try:
            yield self
        finally:
            amd_source._now, amd_source.KFD_PATH = saved
            if saved_module is None:
                sys.modules.pop("amdsmi", None)
            else:
                sys.modules["amdsmi"] = saved_module

    # -- the fake library ------------------------------------------------------------------------

    def _call(self, name: str, handle: Any = None, device: bool = True) -> tuple[FakeAmdGpu | None, int]:
        self.calls[name] += 1
        if self.inits <= 0:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        tick = self.tick
        if not device:
            return None, tick
        if not isinstance(handle, ProcessorHandle):
            raise AmdSmiParameterException(handle, "amdsmi_processor_handle")
        gpu = handle.gpu
        self.device_calls[(name, gpu.uuid)] += 1
        if gpu.lost(tick):
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)
        if name in gpu.unsupported:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        if name in gpu.no_permission:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM)
        return gpu, tick

    def amdsmi_init(self, flag: Any = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self.calls["amdsmi_init"] += 1
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag, AmdSmiInitFlags)
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        self.inits += 1

    def amdsmi_shut_down(self) -> None:
        self.calls["amdsmi_shut_down"] += 1
        if self.inits <= 0:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        self.inits -= 1

    def amdsmi_get_lib_version(self) -> dict[str, Any]:
        self._call("amdsmi_get_lib_version", device=False)
        return {"major": 25, "minor": 0, "release": 0, "build": "fake"}

    def amdsmi_get_processor_handles(self) -> list[ProcessorHandle]:
        self._call("amdsmi_get_processor_handles", device=False)
        return [self._handles[id(gpu)] for gpu in self.devices]

    def amdsmi_get_gpu_device_uuid(self, handle: Any) -> str:
        gpu, _ = self._call("amdsmi_get_gpu_device_uuid", handle)
        assert gpu is not None
        return gpu.uuid

    def amdsmi_get_gpu_device_bdf(self, handle: Any) -> str:
        gpu, _ = self._call("amdsmi_get_gpu_device_bdf", handle)
        assert gpu is not None
        return gpu.bdf

    def amdsmi_get_gpu_asic_info(self, handle: Any) -> dict[str, Any]:
        gpu, _ = self._call("amdsmi_get_gpu_asic_info", handle)
        assert gpu is not None
        return {"market_name": gpu.market_name, "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc.",
                "subvendor_id": "0x1002", "device_id": "0x74a1", "rev_id": "0x00", "asic_serial": "0x" + gpu.serial,
                "oam_id": 0, "num_compute_units": 304, "target_graphics_version": gpu.arch}

    def amdsmi_get_gpu_board_info(self, handle: Any) -> dict[str, Any]:
        gpu, _ = self._call("amdsmi_get_gpu_board_info", handle)
        assert gpu is not None
        return {"model_number": "102-G30211-0C", "product_serial": gpu.serial, "fru_id": "N/A",
                "product_name": gpu.market_name, "manufacturer_name": "AMD"}

    def amdsmi_get_gpu_kfd_info(self, handle: Any) -> dict[str, Any]:
        gpu, _ = self._call("amdsmi_get_gpu_kfd_info", handle)
        assert gpu is not None
        return {"kfd_id": gpu.kfd_id, "node_id": gpu.node_id, "current_partition_id": gpu.partition_id}

    def amdsmi_get_gpu_compute_partition(self, handle: Any) -> str:
        gpu, _ = self._call("amdsmi_get_gpu_compute_partition", handle)
        assert gpu is not None
        return gpu.compute_partition

    def amdsmi_get_gpu_memory_partition(self, handle: Any) -> str:
        gpu, _ = self._call("amdsmi_get_gpu_memory_partition", handle)
        assert gpu is not None
        return gpu.memory_partition

    def amdsmi_get_gpu_activity(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_gpu_activity", handle)
        assert gpu is not None
        return {"gfx_activity": _at(gpu.gfx_activity, tick), "umc_activity": _at(gpu.umc_activity, tick),
                "mm_activity": NA}

    def amdsmi_get_gpu_vram_usage(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_gpu_vram_usage", handle)
        assert gpu is not None
        return {"vram_total": gpu.vram_total_mib, "vram_used": _at(gpu.vram_used_mib, tick)}

    def amdsmi_get_power_info(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_power_info", handle)
        assert gpu is not None
        return {"current_socket_power": _at(gpu.current_socket_power, tick),
                "average_socket_power": _at(gpu.average_socket_power, tick), "gfx_voltage": NA,
                "soc_voltage": NA, "mem_voltage": NA, "power_limit": _at(gpu.power_cap_uw, tick) // 1_000_000}

    def amdsmi_get_power_cap_info(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_power_cap_info", handle)
        assert gpu is not None
        return {"power_cap": _at(gpu.power_cap_uw, tick), "default_power_cap": gpu.default_power_cap_uw,
                "dpm_cap": gpu.gfx_clock_max_mhz, "min_power_cap": gpu.min_power_cap_uw,
                "max_power_cap": gpu.max_power_cap_uw}

    def amdsmi_get_energy_count(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_energy_count", handle)
        assert gpu is not None
        # The counter rises with the power drawn over the fake's time.
        watts = _at(gpu.current_socket_power, tick)
        watts = watts if isinstance(watts, (int, float)) else _at(gpu.average_socket_power, tick)
        counter = gpu.energy_start + int(watts * self.elapsed() * 1e6 / gpu.counter_resolution)
        return {"power": counter, "energy_accumulator": counter, "counter_resolution": gpu.counter_resolution,
                "timestamp": int(self.time * 1e9)}

    def amdsmi_get_temp_metric(self, handle: Any, sensor_type: Any, metric: Any) -> int:
        if not isinstance(sensor_type, AmdSmiTemperatureType):
            raise AmdSmiParameterException(sensor_type, AmdSmiTemperatureType)
        if not isinstance(metric, AmdSmiTemperatureMetric):
            raise AmdSmiParameterException(metric, AmdSmiTemperatureMetric)
        gpu, tick = self._call("amdsmi_get_temp_metric", handle)
        assert gpu is not None
        sensor = {AmdSmiTemperatureType.EDGE: "temp_edge", AmdSmiTemperatureType.HOTSPOT: "temp_hotspot"}.get(
            sensor_type)
        if sensor is None or sensor in gpu.unsupported or metric != AmdSmiTemperatureMetric.CURRENT:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        value = _at(gpu.hotspot_c if sensor == "temp_hotspot" else gpu.edge_c, tick)
        if not isinstance(value, int):
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return value

    def amdsmi_get_clock_info(self, handle: Any, clock_type: Any) -> dict[str, Any]:
        if not isinstance(clock_type, AmdSmiClkType):
            raise AmdSmiParameterException(clock_type, AmdSmiClkType)
        gpu, tick = self._call("amdsmi_get_clock_info", handle)
        assert gpu is not None
        if clock_type == AmdSmiClkType.GFX:
            return {"clk": _at(gpu.gfx_clock_mhz, tick), "min_clk": 500, "max_clk": gpu.gfx_clock_max_mhz,
                    "clk_locked": False, "clk_deep_sleep": False}
        if clock_type == AmdSmiClkType.MEM:
            return {"clk": gpu.mem_clock_mhz, "min_clk": 900, "max_clk": gpu.mem_clock_mhz, "clk_locked": NA,
                    "clk_deep_sleep": False}
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)

    def amdsmi_get_clk_freq(self, handle: Any, clk_type: Any) -> dict[str, Any]:
        if not isinstance(clk_type, AmdSmiClkType):
            raise AmdSmiParameterException(clk_type, AmdSmiClkType)
        gpu, tick = self._call("amdsmi_get_clk_freq", handle)
        assert gpu is not None
        levels = [500_000_000, 1_500_000_000, gpu.gfx_clock_max_mhz * 1_000_000]
        now = _at(gpu.gfx_clock_mhz, tick) * 1_000_000
        levels = sorted({*levels, now})
        return {"num_supported": len(levels), "current": levels.index(now), "frequency": levels}

    def amdsmi_get_pcie_info(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_pcie_info", handle)
        assert gpu is not None
        return {"pcie_static": {"max_pcie_width": gpu.pcie_width_max, "max_pcie_speed": 32_000,
                                "pcie_interface_version": gpu.pcie_gen_max, "slot_type": "OAM"},
                "pcie_metric": {"pcie_width": _at(gpu.pcie_width, tick), "pcie_speed": _at(gpu.pcie_speed_mts, tick),
                                "pcie_bandwidth": _at(gpu.pcie_bandwidth_mbps, tick), "pcie_replay_count": 0,
                                "pcie_l0_to_recovery_count": 0, "pcie_replay_roll_over_count": 0,
                                "pcie_nak_sent_count": 0, "pcie_nak_received_count": 0,
                                "pcie_lc_perf_other_end_recovery_count": NA}}

    def amdsmi_get_violation_status(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_violation_status", handle)
        assert gpu is not None
        thermal = bool(_at(gpu.thermal_active, tick))
        return {"reference_timestamp": int(self.time * 1e6), "violation_timestamp": 0, "acc_counter": tick,
                "acc_prochot_thrm": 0, "acc_ppt_pwr": 0, "acc_socket_thrm": 0, "acc_vr_thrm": 0, "acc_hbm_thrm": 0,
                "per_prochot_thrm": 0, "per_ppt_pwr": 0, "per_socket_thrm": 0, "per_vr_thrm": 0, "per_hbm_thrm": 0,
                "active_prochot_thrm": False, "active_ppt_pwr": bool(_at(gpu.ppt_active, tick)),
                "active_socket_thrm": thermal, "active_vr_thrm": False, "active_hbm_thrm": False}

    def amdsmi_get_gpu_metrics_info(self, handle: Any) -> dict[str, Any]:
        gpu, tick = self._call("amdsmi_get_gpu_metrics_info", handle)
        assert gpu is not None
        bits = int(_at(gpu.throttle_bits, tick))
        # ROCm 6.3's bindings pass both through bool() (isBool=True); older ones gave the numbers.
        return {"temperature_hotspot": _at(gpu.hotspot_c, tick), "average_gfx_activity": _at(gpu.gfx_activity, tick),
                "throttle_status": bits if self.int_throttle else bool(bits),
                "indep_throttle_status": bits if self.int_throttle else bool(bits),
                "current_gfxclk": _at(gpu.gfx_clock_mhz, tick), "num_partition": 1}

    def amdsmi_get_gpu_process_list(self, handle: Any) -> list[Any]:
        gpu, _ = self._call("amdsmi_get_gpu_process_list", handle)
        assert gpu is not None
        if self.old_process_api:
            return [ProcessHandle(pid) for pid, _ in gpu.processes]
        return [self._process(pid, used) for pid, used in gpu.processes]

    def amdsmi_get_gpu_process_info(self, handle: Any, process: Any) -> dict[str, Any]:
        gpu, _ = self._call("amdsmi_get_gpu_process_info", handle)
        assert gpu is not None
        if not isinstance(process, ProcessHandle):
            raise AmdSmiParameterException(process, "amdsmi_process_handle_t")
        for pid, used in gpu.processes:
            if pid == process.pid:
                return self._process(pid, used)
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)

    @staticmethod
    def _process(pid: int, used: int) -> dict[str, Any]:
        return {"name": "python", "pid": pid, "mem": used, "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": used}}


@pytest.fixture
def fake_amdsmi() -> Iterator[Callable[..., FakeAmdSmi]]:
    """Installs a fake amdsmi for the test: ``fake = fake_amdsmi(FakeAmdSmi.mi300x(8))``; none: one MI300X."""
    with contextlib.ExitStack() as stack:

        def install(fake: FakeAmdSmi | None = None) -> FakeAmdSmi:
            fake = fake if fake is not None else FakeAmdSmi.mi300x()
            stack.enter_context(fake.patched())
            return fake

        yield install
