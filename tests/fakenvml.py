"""A fake NVML for tests: replaces pynvml's functions and keeps its real errors, structs and constants.

The fake works at the pynvml function level, so code under test runs its real error handling:
``pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)`` becomes ``NVMLError_NotSupported`` exactly as
with a driver. Every ``nvml*`` function of pynvml is replaced while installed; one the fake does not
model raises FunctionNotFound and is listed in ``unfaked_calls``.

Use it through the ``fake_nvml`` fixture (an installer) or as a context manager::

    def test_power(fake_nvml):
        fake = fake_nvml(FakeNvml.single(power_mw=250_000))
        assert NvmlSource().read()["gpu0.power"] == 250.0

    with FakeNvml.gpus(8).patched() as fake:   # benchmarks, scripts
        ...

Time and ticks: by default time is frozen. ``fake.step()`` moves to the next tick and advances the
clock NvmlSource uses by ``tick_s`` (0.1 s); per-tick values are sequences indexed by tick (the last
one repeats) or functions of the tick. ``FakeNvml(..., real_time=True)`` leaves the clock alone and
derives the tick from elapsed wall time, for tests that run a real sampler thread.

As strict as a real driver: an idle GPU (utilisation 0) records no utilisation sample, so
``nvmlDeviceGetSamples`` answers NotFound (``samples_while_idle=True`` keeps zeros); nvmlShutdown
after the last nvmlInit is no error (nvml.h); the R470-era ``old_driver`` keeps nvmlDeviceGetSamples
(drivers have it since Kepler); a MIG instance's handle answers NotSupported for utilisation, power,
energy, temperature and PCIe, and its SM activity comes only through its parent's GPM
(``nvmlGpmMigSampleGet``; :data:`MIG_INSTANCE_UNSUPPORTED`). Scenarios of real hosts: ``mig()`` (an A100
in MIG mode, no GPM), ``mig(hopper=True)`` (an H100 in MIG mode with GPM), ``mixed()`` (an A40 first in
NVML's PCI order, an H100 first in CUDA's fastest-first order), ``unknown_at()`` (a transient NVML_ERROR_UNKNOWN),
``in_container()`` (this process listed by a host pid this namespace does not have),
``r535_process_struct()`` (_v3 process lists written with 32-byte entries, misread by the bindings).

Calls are counted per function (``fake.calls["nvmlDeviceGetPcieThroughput"]``) and per device
(``fake.count(name, gpu)``). The fake answers at once unless ``latency_s`` gives a delay per function
(``FakeNvml.REALISTIC_LATENCY_S`` blocks PCIe queries 20 ms as real NVML does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

GIB = 1024**3

# Per-tick value: a constant, a sequence indexed by tick (the last value repeats), or f(tick).
Value = Any

# Field names accepted by not_supported() / no_permission(), and the NVML functions behind them.
# util and mem_util come from the same call, as on a real GPU.
FIELD_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "util": ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetSamples"),
    "mem_util": ("nvmlDeviceGetUtilizationRates",),
    "samples": ("nvmlDeviceGetSamples",),
    "memory": ("nvmlDeviceGetMemoryInfo",),
    "power": ("nvmlDeviceGetPowerUsage",),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "temperature": ("nvmlDeviceGetTemperature",),
    "sm_clock": ("nvmlDeviceGetClockInfo",),
    "sm_clock_max": ("nvmlDeviceGetMaxClockInfo",),
    "clock_events": ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    "pcie": ("nvmlDeviceGetPcieThroughput",),
    "processes": (
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
    ),
}

# Functions an older driver (R470-era: Ampere, no GPM) does not have. nvmlDeviceGetSamples is not
# among them: real drivers have it since Kepler.
OLD_DRIVER_MISSING = frozenset(
    {
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlGpmQueryDeviceSupport",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleFree",
        "nvmlGpmSampleGet",
        "nvmlGpmMigSampleGet",
        "nvmlGpmMetricsGet",
    }
)

# What the driver refuses on a MIG instance's handle, as a real one does (nvml.h: utilisation "is not currently
# supported" on MIG; power, energy, temperature and PCIe are the whole GPU's): NotSupported, whatever the
# scenario says. SM activity of an instance comes from GPM through its parent (nvmlGpmMigSampleGet), never
# from nvmlGpmSampleGet on the instance's own handle.
MIG_INSTANCE_UNSUPPORTED = frozenset(
    {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetSamples",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementDefaultLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPcieThroughput",
        "nvmlGpmSampleGet",
        "nvmlGpmQueryDeviceSupport",
    }
)
# A GPU in MIG mode has no device-wide utilisation either (nvml.h); its instances are the CUDA devices.
MIG_PARENT_UNSUPPORTED = frozenset({"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetSamples"})

# pynvml helpers that do not call the library: left alone.
_NOT_LIBRARY_CALLS = frozenset(
    {"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"}
)

_SAMPLE_BASE_US = 1_700_000_000_000_000
_SAMPLE_TICK_US = 100_000  # driver timestamps advance 100 ms per fake tick, whatever tick_s is


def _at(value: Value, tick: int) -> Any:
    if callable(value):
        return value(tick)
    if isinstance(value, (list, tuple)):
        return value[min(tick, len(value) - 1)]
    return value


@dataclass
class FakeProcess:
    pid: int
    used_memory: int | None  # bytes; None as the driver reports it without privileges (MIG, WDDM)


@dataclass(eq=False)
class FakeGpu:
    """One device and its handle. Numbers are in NVML's own units (mW, MHz, KiB/s)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    index: int = 0
    pci_bus_id: str = "00000000:18:00.0"
    memory_total: int = 80 * GIB
    memory_used: Value = 20 * GIB  # v2 struct "used"; the v1 struct adds memory_reserved
    memory_reserved: int = GIB // 2
    util: Value = 87
    util_samples: Value = None  # per tick, a list of sample values; None: one sample equal to util
    mem_util: Value = 35
    power_mw: Value = 250_000
    power_limit_mw: Value = 700_000
    # nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded, rising with power_mw x time.
    energy_base_mj: int = 86_400_000_000  # a day at 1 kW before the test began
    energy_reset_at_tick: int | None = None  # the driver reloaded: the counter starts again from 0
    power_limit_default_mw: int = 700_000
    power_limit_min_mw: int = 200_000  # nvmlDeviceGetPowerManagementLimitConstraints
    power_limit_max_mw: int = 700_000
    temperature: Value = 61
    sm_clock_mhz: Value = 1755
    sm_clock_max_mhz: int = 1980
    mem_clock_mhz: int = 2619
    clock_events: Value = 0
    pcie_tx_kib: Value = 2048
    pcie_rx_kib: Value = 4096
    pcie_gen: Value = 5  # the link now; an idle GPU drops to a lower generation to save power
    pcie_width: Value = 16
    pcie_gen_max: int = 5
    pcie_width_max: int = 16
    capability: tuple[int, int] = (9, 0)
    compute_processes: list[FakeProcess] = field(default_factory=list)
    graphics_processes: list[FakeProcess] = field(default_factory=list)
    gpm: bool = True
    sm_active: Value = 60.0
    sm_occupancy: Value = 30.0
    tensor_active: Value = 25.0
    dram_active: Value = 40.0
    gpm_pcie_tx_mib: Value = 3.0
    gpm_pcie_rx_mib: Value = 5.0
    nvlink_tx_mib: Value = 100.0
    nvlink_rx_mib: Value = 120.0
    # The driver records no utilisation sample while the GPU is idle: nvmlDeviceGetSamples then has
    # nothing new (NotFound), as reported on real GPUs. True keeps recording zeros.
    samples_while_idle: bool = False
    mig_mode: bool | None = None  # None: not MIG-capable (NotSupported)
    instances: list[FakeGpu] = field(default_factory=list)
    parent: FakeGpu | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    unsupported: set[str] = field(default_factory=set)
    no_permission: set[str] = field(default_factory=set)
    lost_at_tick: int | None = None
    unknown_at: dict[str, set[int]] = field(default_factory=dict)  # function -> ticks answering Unknown

    def lost(self, tick: int) -> bool:
        if self.parent is not None and self.parent.lost(tick):
            return True
        return self.lost_at_tick is not None and tick >= self.lost_at_tick


def _uuid(kind: str, number: int) -> str:
    return f"{kind}-{number:08x}-1111-2222-3333-{number:012x}"


def make_gpu(index: int, **fields: Any) -> FakeGpu:
    """A healthy Hopper-class GPU at NVML ``index`` with a distinct UUID and bus id."""
    base = {
        "uuid": _uuid("GPU", 0xA0 + index),
        "index": index,
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
    }
    return FakeGpu(**{**base, **fields})


class FakeNvml:
    """The state of a fake driver, its scenario builders, and the fake pynvml functions."""

    REALISTIC_LATENCY_S: Mapping[str, float] = {"nvmlDeviceGetPcieThroughput": 0.020}

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        init_error: int | None = None,
        missing: Sequence[str] | frozenset[str] = (),
        driver_version: str = "580.65.06",
        real_time: bool = False,
        tick_s: float = 0.1,
        latency_s: Mapping[str, float] | None = None,
        cuda_visible_devices: str | None = None,
    ) -> None:
        self.devices: list[FakeGpu] = list(gpus)
        self.init_error = init_error
        self.missing: set[str] = set(missing)
        self.driver_version = driver_version
        self.real_time = real_time
        self.tick_s = tick_s
        self.latency_s: dict[str, float] = dict(latency_s or {})
        self.cuda_visible_devices = cuda_visible_devices  # None: unset while installed
        self.calls: Counter[str] = Counter()
        self.device_calls: Counter[tuple[str, str]] = Counter()
        self.unfaked_calls: list[str] = []
        self.inits = 0
        self.shutdowns = 0
        self.time = self._time0 = 1000.0
        self._tick = 0
        self._start = time.monotonic()
        self._gpm_samples: dict[int, tuple[FakeGpu, int, float] | None] = {}
        self.r535 = False
        self.ever_initialised = False
        self._next_sample = 0x1000

    # -- scenario builders -----------------------------------------------------------------------

    @classmethod
    def single(cls, **fields: Any) -> FakeNvml:
        """One GPU, a current driver, every field supported."""
        return cls.gpus(1, **fields)

    @classmethod
    def gpus(cls, count: int, **fields: Any) -> FakeNvml:
        """``count`` identical GPUs on a current driver."""
        return cls([make_gpu(index, **fields) for index in range(count)])

    new_driver = single

    @classmethod
    def old_driver(cls, count: int = 1, **fields: Any) -> FakeNvml:
        """An A100 on an R470-era driver: no GPM, clock event reasons, v2 memory or v3 process structs."""
        fields = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": 40 * GIB, "gpm": False, "capability": (8, 0),
                  **fields}
        fake = cls.gpus(count, **fields)
        fake.missing |= OLD_DRIVER_MISSING
        fake.driver_version = "470.256.02"
        return fake

    @classmethod
    def mig(cls, extra_gpus: int = 0, hopper: bool = False) -> FakeNvml:
        """GPU 0 in MIG mode with two instances, then ``extra_gpus`` plain GPUs: an A100 (3g.20gb, 2g.10gb;
        no GPM, so nothing says how busy an instance is), or with ``hopper`` an H100 (3g.40gb, 2g.20gb)
        whose GPM gives each instance's SM activity through ``nvmlGpmMigSampleGet``.

        Utilisation, power, energy, temperature and PCIe answer NotSupported on an instance's handle
        (:data:`MIG_INSTANCE_UNSUPPORTED`), and utilisation on the parent too, as on a real driver.
        """
        if hopper:
            parent = make_gpu(0, name="NVIDIA H100 80GB HBM3", memory_total=80 * GIB, mig_mode=True, gpm=True)
            profiles = (("3g.40gb", 40, 1), ("2g.20gb", 20, 5))
        else:
            parent = make_gpu(0, name="NVIDIA A100-SXM4-40GB", memory_total=40 * GIB, mig_mode=True, gpm=False,
                              capability=(8, 0))
            profiles = (("3g.20gb", 20, 1), ("2g.10gb", 10, 5))
        for slot, (profile, memory, gi) in enumerate(profiles):
            parent.instances.append(
                FakeGpu(
                    uuid=_uuid("MIG", 0xC0 + slot),
                    name=f"{parent.name} MIG {profile}",
                    index=0,
                    pci_bus_id=parent.pci_bus_id,
                    memory_total=memory * GIB,
                    memory_used=(slot + 1) * GIB,
                    capability=parent.capability,
                    parent=parent,
                    gpu_instance_id=gi,
                    compute_instance_id=0,
                    gpm=False,  # GPM is the parent's: an instance is sampled through it
                )
            )
        return cls([parent, *(make_gpu(index) for index in range(1, 1 + extra_gpus))])

    @classmethod
    def mixed(cls) -> FakeNvml:
        """Two models: NVML (PCI) order puts an A40 first, CUDA's default fastest-first order the H100."""
        a40 = make_gpu(0, name="NVIDIA A40", memory_total=48 * GIB, capability=(8, 6), gpm=False,
                       power_limit_mw=300_000, power_limit_default_mw=300_000, pcie_gen=4, pcie_gen_max=4)
        h100 = make_gpu(1, name="NVIDIA H100 80GB HBM3", pci_bus_id="00000000:3B:00.0")
        return cls([a40, h100])

    @classmethod
    def library_missing(cls) -> FakeNvml:
        """No NVIDIA driver installed: nvmlInit raises NVMLError_LibraryNotFound."""
        return cls(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    @classmethod
    def driver_not_loaded(cls) -> FakeNvml:
        """Driver installed but its kernel module not loaded: NVMLError_DriverNotLoaded."""
        return cls(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    @classmethod
    def no_devices(cls) -> FakeNvml:
        """NVML starts but counts zero GPUs."""
        return cls()

    # -- scenario changes (chainable) ------------------------------------------------------------

    def gpu(self, which: int | str) -> FakeGpu:
        """A device by NVML index (physical GPU) or UUID (any device, MIG instances included)."""
        for device in self.devices:
            for candidate in (device, *device.instances):
                if which == candidate.uuid or (candidate.parent is None and which == candidate.index):
                    return candidate
        raise KeyError(which)

    def set(self, which: int | str, **fields: Any) -> FakeNvml:
        gpu = self.gpu(which)
        for name, value in fields.items():
            if not hasattr(gpu, name):
                raise AttributeError(f"FakeGpu has no field {name!r}")
            setattr(gpu, name, value)
        return self

    def not_supported(self, which: int | str, *fields: str) -> FakeNvml:
        """Make fields (see FIELD_FUNCTIONS) or NVML function names answer NotSupported."""
        self.gpu(which).unsupported |= _functions(fields)
        return self

    def no_permission(self, which: int | str, *fields: str) -> FakeNvml:
        """Make fields or NVML function names answer NoPermission (``"processes"`` typically)."""
        self.gpu(which).no_permission |= _functions(fields)
        return self

    def lose_gpu(self, which: int | str, at_tick: int) -> FakeNvml:
        """From tick ``at_tick`` on, every call on that device (and its MIG instances) is GpuIsLost."""
        self.gpu(which).lost_at_tick = at_tick
        return self

    def processes(
        self,
        which: int | str,
        compute: Sequence[tuple[int, int | None]] = (),
        graphics: Sequence[tuple[int, int | None]] = (),
    ) -> FakeNvml:
        """Processes on a device as ``(pid, bytes)`` pairs."""
        gpu = self.gpu(which)
        gpu.compute_processes = [FakeProcess(pid, used) for pid, used in compute]
        gpu.graphics_processes = [FakeProcess(pid, used) for pid, used in graphics]
        return self

    def unknown_at(self, which: int | str, function: str, *ticks: int) -> FakeNvml:
        """``function`` answers NVML_ERROR_UNKNOWN on the device at these ticks (once each), as a
        transient driver error does; the rest of the time it answers normally."""
        self.gpu(which).unknown_at.setdefault(function, set()).update(ticks)
        return self

    def host_pid(self) -> int:
        """A pid that does not exist in this test's PID namespace, as the driver reports a process
        in a container by its host pid."""
        for pid in range(4_000_000, 4_100_000):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return pid
            except PermissionError:
                continue
        raise RuntimeError("no free pid found")

    def in_container(self, which: int | str = 0, used: int = 3 * GIB, others: int = 0) -> FakeNvml:
        """This process in its own PID namespace: the driver lists it (and ``others`` more processes)
        on the device by host pids that do not exist here."""
        pid = self.host_pid()
        return self.processes(which, compute=[(pid + n, used) for n in range(1 + others)])

    def r535_process_struct(self) -> FakeNvml:
        """An early R535 driver: the _v3 process lists are written with 32-byte entries (a field more)
        while the bindings read 24-byte ones, so every entry after the first is misread; _v2 is right."""
        self.r535 = True
        return self

    def without(self, *functions: str) -> FakeNvml:
        """Make the driver lack these functions (FunctionNotFound), as an older driver does."""
        self.missing |= set(functions)
        return self

    # -- time --------------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        if self.real_time:
            return int((time.monotonic() - self._start) / self.tick_s)
        return self._tick

    def step(self, ticks: int = 1) -> None:
        """Move to a later tick; the frozen clock advances ``tick_s`` per tick."""
        self._tick += ticks
        self.time += ticks * self.tick_s

    def advance(self, seconds: float) -> None:
        """Move the frozen clock without changing the tick."""
        self.time += seconds

    def now(self) -> float:
        return self.time

    def elapsed(self) -> float:
        """Seconds of fake time since the fake was made (wall time with ``real_time``)."""
        if self.real_time:
            return time.monotonic() - self._start
        return self.time - self._time0

    # -- counting ----------------------------------------------------------------------------------

    def count(self, name: str, which: int | str | None = None) -> int:
        """How many times ``name`` was called, on one device if ``which`` is given."""
        if which is None:
            return self.calls[name]
        return self.device_calls[(name, self.gpu(which).uuid)]

    def reset_counts(self) -> None:
        self.calls.clear()
        self.device_calls.clear()

    @property
    def gpm_samples_alive(self) -> int:
        return len(self._gpm_samples)

    # -- installing --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def patched(self) -> Iterator[FakeNvml]:
        """Replace pynvml's functions (and freeze NvmlSource's clock) until the block ends."""
        import gpuwidget.sources.nvml.source as nvml_source

        saved: dict[tuple[Any, str], Any] = {}

        def swap(owner: Any, name: str, value: Any) -> None:
            saved.setdefault((owner, name), getattr(owner, name))
            setattr(owner, name, value)

        for name in dir(pynvml):
            original = getattr(pynvml, name)
            library_call = isinstance(original, types.FunctionType) and name not in _NOT_LIBRARY_CALLS
            if name.startswith("nvml") and library_call:
                swap(pynvml, name, getattr(self, name, None) or self._unfaked(name))
        if not self.real_time:
            swap(nvml_source, "_now", self.now)
        had_env = "CUDA_VISIBLE_DEVICES" in os.environ
        old_env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.cuda_visible_devices is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        try:
            yield self
        finally:
            for (owner, name), value in saved.items():
                setattr(owner, name, value)
            if had_env:
                os.environ["CUDA_VISIBLE_DEVICES"] = old_env or ""
            else:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)

    def _unfaked(self, name: str) -> Callable[..., Any]:
        def unfaked(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.unfaked_calls.append(name)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        unfaked.__name__ = name
        return unfaked

    # -- the fake library --------------------------------------------------------------------------

    def _call(self, name: str, gpu: FakeGpu | None = None) -> int:
        """Bookkeeping every fake function does first; returns the current tick."""
        self.calls[name] += 1
        if self.inits <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        tick = self.tick
        if gpu is not None:
            self.device_calls[(name, gpu.uuid)] += 1
            if gpu.lost(tick):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if tick in gpu.unknown_at.get(name, ()):
                gpu.unknown_at[name].discard(tick)
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            if name in gpu.unsupported or (gpu.parent is not None and name in MIG_INSTANCE_UNSUPPORTED) or (
                    gpu.mig_mode and gpu.parent is None and name in MIG_PARENT_UNSUPPORTED):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if name in gpu.no_permission:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if self.latency_s:
            delay = self.latency_s.get(name)
            if delay:
                time.sleep(delay)
        return tick

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inits += 1
        self.ever_initialised = True

    def nvmlShutdown(self) -> None:
        # nvml.h: "No error will be reported if this is called more times than nvmlInit"; only a
        # library never initialised answers Uninitialized.
        self.calls["nvmlShutdown"] += 1
        if not self.ever_initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if self.inits > 0:
            self.inits -= 1
            self.shutdowns += 1

    def nvmlErrorString(self, result: int) -> str:
        return f"NVML error {result}"

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        self._call("nvmlDeviceGetUUID", gpu)
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._call("nvmlDeviceGetName", gpu)
        return gpu.name

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        self._call("nvmlDeviceGetPciInfo", gpu)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id.encode()
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        self._call("nvmlDeviceGetMigMode", gpu)
        if gpu.mig_mode is None or gpu.parent is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_mode else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount", gpu)
        if gpu.mig_mode is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: FakeGpu, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex", gpu)
        if not gpu.mig_mode or gpu.parent is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(gpu.instances):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu.instances[index]

    def nvmlDeviceIsMigDeviceHandle(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceIsMigDeviceHandle", gpu)
        return int(gpu.parent is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, gpu: FakeGpu) -> FakeGpu:
        self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", gpu)
        if gpu.parent is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.parent

    def nvmlDeviceGetGpuInstanceId(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetGpuInstanceId", gpu)
        if gpu.gpu_instance_id is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetComputeInstanceId", gpu)
        if gpu.compute_instance_id is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.compute_instance_id

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu, version: int | None = None) -> Any:
        tick = self._call("nvmlDeviceGetMemoryInfo", gpu)
        used = int(_at(gpu.memory_used, tick))
        if version:
            if "nvmlDeviceGetMemoryInfo_v2" in self.missing:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            free = gpu.memory_total - used - gpu.memory_reserved
            return pynvml.c_nvmlMemory_v2_t(version, gpu.memory_total, gpu.memory_reserved, free, used)
        used += gpu.memory_reserved  # the v1 struct counts driver-reserved memory as used
        return pynvml.c_nvmlMemory_t(gpu.memory_total, gpu.memory_total - used, used)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        tick = self._call("nvmlDeviceGetUtilizationRates", gpu)
        return pynvml.c_nvmlUtilization_t(int(_at(gpu.util, tick)), int(_at(gpu.mem_util, tick)))

    def nvmlDeviceGetSamples(self, gpu: FakeGpu, sampling_type: int, last_seen: int) -> Any:
        tick = self._call("nvmlDeviceGetSamples", gpu)
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        first = max(0, (last_seen - _SAMPLE_BASE_US) // _SAMPLE_TICK_US) if last_seen else 0
        samples = []
        for sample_tick in range(first, tick + 1):
            values = _at(gpu.util_samples, sample_tick)
            if values is None:
                values = [_at(gpu.util, sample_tick)]
            if not gpu.samples_while_idle and not any(values):
                continue  # an idle GPU: the driver records nothing
            for position, value in enumerate(values):
                stamp = _SAMPLE_BASE_US + sample_tick * _SAMPLE_TICK_US + position * 1000
                if stamp > last_seen:
                    samples.append(pynvml.c_nvmlSample_t(stamp, pynvml.c_nvmlValue_t(uiVal=int(value))))
        if not samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetPowerUsage", gpu)
        return int(_at(gpu.power_mw, tick))

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: FakeGpu) -> int:
        """mJ since the driver loaded: power integrated over the fake's time (its ticks, and the
        time ``advance`` adds), from ``energy_base_mj``, or from 0 after ``energy_reset_at_tick``."""
        tick = self._call("nvmlDeviceGetTotalEnergyConsumption", gpu)
        elapsed = self.elapsed()
        reset = gpu.energy_reset_at_tick
        first = 0 if reset is None or tick < reset else reset
        energy = 0.0 if reset is not None and tick >= reset else float(gpu.energy_base_mj)
        for each in range(first, tick):
            energy += float(_at(gpu.power_mw, each)) * self.tick_s
        energy += float(_at(gpu.power_mw, tick)) * max(0.0, elapsed - tick * self.tick_s)
        return int(energy)

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetEnforcedPowerLimit", gpu)
        return int(_at(gpu.power_limit_mw, tick))

    def nvmlDeviceGetPowerManagementDefaultLimit(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetPowerManagementDefaultLimit", gpu)
        return gpu.power_limit_default_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, gpu: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetPowerManagementLimitConstraints", gpu)
        return gpu.power_limit_min_mw, gpu.power_limit_max_mw

    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetCurrPcieLinkGeneration", gpu)
        return int(_at(gpu.pcie_gen, tick))

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetCurrPcieLinkWidth", gpu)
        return int(_at(gpu.pcie_width, tick))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxPcieLinkGeneration", gpu)
        return gpu.pcie_gen_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxPcieLinkWidth", gpu)
        return gpu.pcie_width_max

    def nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability", gpu)
        return gpu.capability

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        tick = self._call("nvmlDeviceGetTemperature", gpu)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(_at(gpu.temperature, tick))

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock_type: int) -> int:
        tick = self._call("nvmlDeviceGetClockInfo", gpu)
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return gpu.mem_clock_mhz
        return int(_at(gpu.sm_clock_mhz, tick))

    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, clock_type: int) -> int:
        self._call("nvmlDeviceGetMaxClockInfo", gpu)
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return gpu.mem_clock_mhz
        return gpu.sm_clock_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetCurrentClocksEventReasons", gpu)
        return int(_at(gpu.clock_events, tick))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        tick = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", gpu)
        return int(_at(gpu.clock_events, tick))

    def nvmlDeviceGetPcieThroughput(self, gpu: FakeGpu, counter: int) -> int:
        tick = self._call("nvmlDeviceGetPcieThroughput", gpu)
        value = gpu.pcie_tx_kib if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else gpu.pcie_rx_kib
        return int(_at(value, tick))

    def _processes(self, name: str, gpu: FakeGpu, listed: list[FakeProcess]) -> list[Any]:
        self._call(name, gpu)
        if self.r535 and name.endswith("_v3"):
            return _misread_r535(gpu, listed)
        return [
            pynvml.nvmlFriendlyObject(
                {
                    "pid": process.pid,
                    "usedGpuMemory": process.used_memory,
                    "gpuInstanceId": gpu.gpu_instance_id if gpu.gpu_instance_id is not None else 0xFFFFFFFF,
                    "computeInstanceId": gpu.compute_instance_id
                    if gpu.compute_instance_id is not None
                    else 0xFFFFFFFF,
                }
            )
            for process in listed
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, gpu: FakeGpu) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", gpu, gpu.compute_processes)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, gpu: FakeGpu) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", gpu, gpu.compute_processes)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, gpu: FakeGpu) -> list[Any]:
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses_v3", gpu, gpu.graphics_processes)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, gpu: FakeGpu) -> list[Any]:
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses_v2", gpu, gpu.graphics_processes)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        # pynvml's unversioned wrapper turns FunctionNotFound into NVMLLibraryMismatchError.
        if "nvmlDeviceGetComputeRunningProcesses_v3" in self.missing:
            raise pynvml.NVMLLibraryMismatchError("use nvmlDeviceGetComputeRunningProcesses_v2")
        return self._processes("nvmlDeviceGetComputeRunningProcesses", gpu, gpu.compute_processes)

    def nvmlDeviceGetGraphicsRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        if "nvmlDeviceGetGraphicsRunningProcesses_v3" in self.missing:
            raise pynvml.NVMLLibraryMismatchError("use nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses", gpu, gpu.graphics_processes)

    # GPM: samples are opaque pointers; the fake gives each a distinct address and remembers it.

    def nvmlGpmQueryDeviceSupport(self, gpu: FakeGpu) -> Any:
        self._call("nvmlGpmQueryDeviceSupport", gpu)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(gpu.gpm)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._call("nvmlGpmSampleAlloc")
        self._next_sample += 0x10
        self._gpm_samples[self._next_sample] = None
        return ctypes.cast(ctypes.c_void_p(self._next_sample), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._call("nvmlGpmSampleFree")
        if self._gpm_samples.pop(_address(sample), "absent") == "absent":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlGpmSampleGet(self, gpu: FakeGpu, sample: Any) -> Any:
        tick = self._call("nvmlGpmSampleGet", gpu)
        return self._take_sample(gpu, sample, tick)

    def nvmlGpmMigSampleGet(self, gpu: FakeGpu, gpu_instance_id: int, sample: Any) -> Any:
        tick = self._call("nvmlGpmMigSampleGet", gpu)
        if gpu.parent is not None or not gpu.mig_mode:  # asked on the parent GPU in MIG mode only
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for instance in gpu.instances:
            if instance.gpu_instance_id == gpu_instance_id:
                return self._take_sample(instance, sample, tick)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _take_sample(self, gpu: FakeGpu, sample: Any, tick: int) -> Any:
        address = _address(sample)
        if address not in self._gpm_samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not (gpu.gpm or (gpu.parent is not None and gpu.parent.gpm)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._gpm_samples[address] = (gpu, tick, self.now() if not self.real_time else time.monotonic())
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self._call("nvmlGpmMetricsGet")
        first = self._gpm_samples.get(_address(request.sample1))
        second = self._gpm_samples.get(_address(request.sample2))
        if first is None or second is None or first[0] is not second[0]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu, tick, taken = second
        if taken - first[2] < 0.1 - 1e-9:  # NVML refuses pairs closer than 100 ms
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        by_id = {
            pynvml.NVML_GPM_METRIC_SM_UTIL: gpu.sm_active,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: gpu.sm_occupancy,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: gpu.tensor_active,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: gpu.dram_active,
            pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: gpu.gpm_pcie_tx_mib,
            pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: gpu.gpm_pcie_rx_mib,
            pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: gpu.nvlink_tx_mib,
            pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: gpu.nvlink_rx_mib,
        }
        for slot in range(request.numMetrics):
            metric = request.metrics[slot]
            value = by_id.get(metric.metricId)
            if value is None:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = float(_at(value, tick))
        return request


class _ProcessInfoR535(ctypes.Structure):
    """The 32-byte entry early R535 drivers wrote into _v3 process lists."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint), ("usedGpuCcProtectedMemory", ctypes.c_ulonglong)]


def _misread_r535(gpu: FakeGpu, listed: list[FakeProcess]) -> list[Any]:
    """What pynvml reads from such a list: 24-byte entries over a buffer of 32-byte ones."""
    written = (_ProcessInfoR535 * len(listed))(
        *(_ProcessInfoR535(p.pid, p.used_memory or 0, 0xFFFFFFFF, 0xFFFFFFFF, 0) for p in listed)
    )
    buffer = bytes(written) + bytes(ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) * len(listed))
    read = (pynvml.c_nvmlProcessInfo_v3_t * len(listed)).from_buffer_copy(buffer)
    return [pynvml.nvmlStructToFriendlyObject(entry) for entry in read]


def _address(sample: Any) -> int:
    return ctypes.cast(sample, ctypes.c_void_p).value or 0


def _functions(fields: Sequence[str]) -> set[str]:
    names: set[str] = set()
    for entry in fields:
        if entry.startswith("nvml"):
            names.add(entry)
        elif entry in FIELD_FUNCTIONS:
            names.update(FIELD_FUNCTIONS[entry])
        else:
            raise KeyError(f"unknown field {entry!r}; known: {sorted(FIELD_FUNCTIONS)} or an nvml* name")
    return names


@pytest.fixture
def fake_nvml() -> Iterator[Callable[..., FakeNvml]]:
    """Installs a fake NVML for the test: ``fake = fake_nvml(FakeNvml.gpus(8))``; no argument: one GPU."""
    with contextlib.ExitStack() as stack:

        def install(fake: FakeNvml | None = None) -> FakeNvml:
            fake = fake if fake is not None else FakeNvml.single()
            stack.enter_context(fake.patched())
            return fake

        yield install
