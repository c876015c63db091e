"""NVIDIA GPU metrics through NVML: the only module in gpuwidget that talks to the driver (via pynvml).

Every NVML call goes through one door, :meth:`_Driver.query`, which turns a failure into a value:

* ``NotSupported`` / ``NoPermission`` -> an :class:`Absent` sentinel; the metric is left out of the
  tick (never reported as 0) and that function is not asked again on that device.
* ``FunctionNotFound`` (the driver is older than the nvidia-ml-py bindings) -> absent everywhere,
  logged once with a hint that driver and bindings disagree.
* ``GpuIsLost`` / ``ResetRequired`` -> the device is finished: its error is recorded, it stops
  appearing in ``read()``, the other devices go on.
* ``Unknown`` -> the device is asked for its UUID: if it answers, only that tick is lost; it is
  declared lost after UNKNOWN_STRIKES ticks in a row fail that way (one transient error must not
  drop a GPU for the whole session).

Metrics per visible device, named ``gpu{cuda_index}.<metric>`` in SI units:

=================  ==========================================================================
``util``           % of time a kernel ran (mean of the driver's samples since the last tick; when the
                   driver has no new sample, as on an idle GPU, nvmlDeviceGetUtilizationRates)
``mem_util``       % of time device memory was read or written
``mem_used``       bytes in use; ``mem_total`` bytes
``power``          W; ``power_limit`` W (enforced limit); ``power_limit_default`` W (the board's default)
``temperature``    degrees Celsius (GPU sensor)
``sm_clock``       Hz; ``sm_clock_max`` Hz
``clock_events``   bitmask of NVML clock event (throttle) reasons, as a float
``pcie_tx``        bytes/s sent by the GPU; ``pcie_rx`` bytes/s received
``proc_mem``       bytes held on the device by "our" processes (see ``pids``)
``pcie_gen``       PCIe link generation now; ``pcie_width`` lanes now; ``pcie_gen_max``/``pcie_width_max``
                   what the GPU and its slot allow (an idle GPU drops its link speed to save power)
``sm_active``      % of SMs busy (GPM, Hopper and newer); ``sm_occupancy`` % of warp slots used
``tensor_active``  % of time any tensor core pipe was busy (GPM); ``dram_active`` % of DRAM bandwidth
``nvlink_tx``      bytes/s sent over NVLink (GPM); ``nvlink_rx`` bytes/s received
=================  ==========================================================================

pynvml is imported when a source is built, not when this module is imported, so ``import gpuwidget``
stays fast on machines with or without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwidget.sources.base import ErrorLog, SourceError

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
# A caller's ``pids`` function may walk the process table; ask it at most this often.
PIDS_REFRESH_S = 1.0
# NVML_ERROR_UNKNOWN on this many ticks in a row (each time with the UUID query failing too)
# declares the GPU lost; one transient error only loses that tick.
UNKNOWN_STRIKES = 3
# The link's generation and width change with the GPU's power state; a cheap query, re-read now and then.
PCIE_LINK_REFRESH_S = 1.0
# nvmlClocksEventReasonGpuIdle: nothing is running, clocks are low on purpose.
CLOCK_EVENT_IDLE = 0x1
# Pids walked up from a GPU process (itself included) looking for this one: workers of workers.
ANCESTRY_DEPTH = 65

KIB = 1024
MIB = 1024 * 1024
MHZ = 1e6


class Absent:
    """Why an NVML query has no value; compare by identity with the module's sentinels."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<absent: {self.reason}>"


NOT_SUPPORTED = Absent("not supported")
NO_PERMISSION = Absent("insufficient permissions")
MISSING = Absent("function not found (driver older than the bindings)")
NOT_FOUND = Absent("not found")
FAILED = Absent("failed")


class _DeviceLost(Exception):
    """A query found the GPU gone (GpuIsLost, ResetRequired); the device is finished."""


class _DeviceUnknown(_DeviceLost):
    """A query answered NVML_ERROR_UNKNOWN: the GPU may be gone, or the error may be transient."""


# Fallback chains: the first function the driver has wins, and the choice is remembered.
_CLOCK_EVENTS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
_COMPUTE_PROCESSES = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
_GRAPHICS_PROCESSES = ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")

_MEMORY_V2 = "nvmlDeviceGetMemoryInfo_v2"

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

METRICS = (
    "util",
    "mem_util",
    "mem_used",
    "mem_total",
    "power",
    "power_limit",
    "power_limit_default",
    "temperature",
    "sm_clock",
    "sm_clock_max",
    "clock_events",
    "pcie_tx",
    "pcie_rx",
    "pcie_gen",
    "pcie_width",
    "pcie_gen_max",
    "pcie_width_max",
    "proc_mem",
    *(name for name in _GPM_METRICS if not name.startswith("pcie")),
)


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


# ---------------------------------------------------------------------------------------------------
# The one door to the driver


class _Driver:
    """Calls NVML functions by name and turns every failure into a sentinel, a log line or _DeviceLost."""

    def __init__(self, nvml: Any, log: ErrorLog) -> None:
        self.nvml = nvml
        self._log = log
        self._missing: set[str] = set()
        self._reported: set[tuple[str | None, str]] = set()
        self._chains: dict[tuple[str, ...], str] = {}
        self._lost = {nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED}
        self._quiet = {
            nvml.NVML_ERROR_NOT_SUPPORTED: NOT_SUPPORTED,
            nvml.NVML_ERROR_NO_PERMISSION: NO_PERMISSION,
            nvml.NVML_ERROR_NOT_FOUND: NOT_FOUND,
        }
        # Raised instead of FunctionNotFound by pynvml's unversioned wrappers; older bindings lack it.
        self._mismatch: type[Exception] | tuple[()] = getattr(nvml, "NVMLLibraryMismatchError", ())
        self.driver_version: str | None = None
        self.memory_v2 = lambda handle: nvml.nvmlDeviceGetMemoryInfo(handle, nvml.nvmlMemory_v2)

    def query(
        self,
        name: str,
        *args: Any,
        off: dict[str, Absent] | None = None,
        device: str | None = None,
        quiet: bool = False,
        via: Callable[..., Any] | None = None,
    ) -> Any:
        """``pynvml.<name>(*args)``, or an :class:`Absent` saying why not; raises only _DeviceLost.

        ``off`` is the device's memory of functions that answered NotSupported or NoPermission: they
        are not asked again. ``quiet`` leaves failures unlogged for a caller that has a fallback.
        ``via`` calls something else under this name (a pynvml function with a version argument).
        """
        if off is not None:
            known = off.get(name)
            if known is not None:
                return known
        if name in self._missing:
            return MISSING
        function = via or getattr(self.nvml, name, None)
        if function is None:
            self._missing_function(name, quiet, lacking="bindings")
            return MISSING
        try:
            return function(*args)
        except self.nvml.NVMLError as error:
            code = error.value
            if code in self._lost:
                raise _DeviceLost(f"{name}: {error}") from error
            if code == self.nvml.NVML_ERROR_UNKNOWN:
                raise _DeviceUnknown(f"{name}: {error}") from error
            absent = self._quiet.get(code)
            if absent is not None:
                if off is not None and absent is not NOT_FOUND:
                    off[name] = absent
                return absent
            if code == self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self._missing_function(name, quiet, lacking="driver")
                return MISSING
            if not quiet:
                self.report_once(f"{name} failed: {error}", device)
            return FAILED
        except self._mismatch:
            self._missing_function(name, quiet, lacking="driver")
            return MISSING
        except Exception as error:  # a bindings bug (ctypes, struct layout) must not end the tick
            if not quiet:
                self.report_once(f"{name} raised {type(error).__name__}: {error}", device)
            return FAILED

    def query_chain(
        self,
        chain: tuple[str, ...],
        *args: Any,
        off: dict[str, Absent] | None = None,
        device: str | None = None,
    ) -> Any:
        """The first function of ``chain`` the driver has; the winner is remembered for later calls."""
        chosen = self._chains.get(chain)
        if chosen is not None:
            return self.query(chosen, *args, off=off, device=device)
        for name in chain:
            last = name == chain[-1]
            value = self.query(name, *args, off=off, device=device, quiet=not last)
            if value is not MISSING:
                self._chains[chain] = name
                return value
        return MISSING

    def chosen(self, chain: tuple[str, ...]) -> str:
        """The function of ``chain`` in use (its first until one was picked)."""
        return self._chains.get(chain, chain[0])

    def pin(self, chain: tuple[str, ...], name: str) -> None:
        """Use ``name`` for ``chain`` from now on (a newer function proved unreliable)."""
        self._chains[chain] = name

    def report_once(self, message: str, device: str | None = None) -> None:
        key = (device, message)
        if key not in self._reported:
            self._reported.add(key)
            self._log.record(message, device, time.time())

    def _missing_function(self, name: str, quiet: bool, lacking: str) -> None:
        """Stop asking for ``name``; unless quiet, say once which side ("driver" or "bindings") lacks it."""
        if name in self._missing:
            return
        self._missing.add(name)
        if quiet:
            return
        if lacking == "driver":
            hint = (
                f"{name} is not in the NVIDIA driver ({self.driver_version or 'version unknown'}): "
                f"the driver is older than nvidia-ml-py {_bindings_version()} expects; the metrics it gives "
                "are absent (upgrade the driver, or install an nvidia-ml-py release matching it)"
            )
        else:
            hint = (
                f"nvidia-ml-py {_bindings_version()} has no {name}: the bindings and the driver disagree; "
                "the metrics it gives are absent (install an nvidia-ml-py release matching the driver)"
            )
        self.report_once(hint)


def _plausible(processes: Iterable[Any], memory_total: int | None) -> bool:
    """False for a process list read with the wrong struct size: pid 0, or more memory than the GPU has."""
    for process in processes:
        used = process.usedGpuMemory
        if process.pid <= 0 or (used is not None and memory_total is not None and used > memory_total):
            return False
    return True


def _bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:
        return "(version unknown)"


def _text(value: Any) -> str | None:
    if isinstance(value, Absent):
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


# ---------------------------------------------------------------------------------------------------
# Finding devices and matching them to CUDA's numbering


@dataclass(frozen=True)
class DeviceInfo:
    """Static facts about one NVML device (a physical GPU or a MIG instance)."""

    index: int  # NVML index of the physical GPU (for a MIG instance: its parent's)
    uuid: str
    name: str
    memory_total: int | None  # bytes
    is_mig: bool = False
    parent_uuid: str | None = None
    pci_bus_id: str | None = None
    mig_index: int | None = None  # position under the parent (nvmlDeviceGetMigDeviceHandleByIndex)
    cuda_index: int | None = None  # position among CUDA-visible devices; None when CUDA cannot see it
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Found:
    """A device as enumerated, with its handle and what CUDA_VISIBLE_DEVICES matching needs."""

    info: DeviceInfo
    handle: Any
    parent_handle: Any = None
    mig_enabled: bool = False
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    instances: list[_Found] = field(default_factory=list)


def _memory_info(driver: _Driver, handle: Any, off: dict[str, Absent] | None, device: str | None) -> Any:
    """nvmlDeviceGetMemoryInfo, preferring the v2 struct (``used`` excludes driver-reserved memory)."""
    if off is None or _MEMORY_V2 not in off:
        value = driver.query(_MEMORY_V2, handle, device=device, quiet=True, via=driver.memory_v2)
        if not isinstance(value, Absent):
            return value
        if off is not None:
            off[_MEMORY_V2] = value  # an older driver or GPU: the v1 struct from now on
    return driver.query("nvmlDeviceGetMemoryInfo", handle, off=off, device=device)


def _enumerate(driver: _Driver) -> list[_Found]:
    """Every physical GPU in NVML order, with its MIG instances when MIG mode is on."""
    nvml = driver.nvml
    count = driver.query("nvmlDeviceGetCount")
    if isinstance(count, Absent):
        return []
    found: list[_Found] = []
    for index in range(count):
        for attempt in range(2):
            try:
                gpu = _enumerate_one(driver, nvml, index)
            except _DeviceUnknown as unknown:
                if attempt == 0:
                    continue  # NVML_ERROR_UNKNOWN can be transient: ask once more before leaving it out
                driver.report_once(f"GPU {index} answered Unknown Error twice and is left out ({unknown})",
                                   f"nvml{index}")
            except _DeviceLost as lost:
                driver.report_once(f"GPU {index} is lost and left out ({lost})", f"nvml{index}")
            else:
                if gpu is not None:
                    found.append(gpu)
            break
    return found


def _enumerate_one(driver: _Driver, nvml: Any, index: int) -> _Found | None:
    handle = driver.query("nvmlDeviceGetHandleByIndex", index)
    if isinstance(handle, Absent):  # e.g. a GPU this container's cgroup may not open
        return None
    uuid = _text(driver.query("nvmlDeviceGetUUID", handle))
    if uuid is None:
        return None
    pci = driver.query("nvmlDeviceGetPciInfo", handle)
    bus_id = None if isinstance(pci, Absent) else _text(pci.busId)
    memory = _memory_info(driver, handle, None, None)
    mode = driver.query("nvmlDeviceGetMigMode", handle)
    mig_enabled = not isinstance(mode, Absent) and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
    capability = driver.query("nvmlDeviceGetCudaComputeCapability", handle, quiet=True)
    gpu = _Found(
        DeviceInfo(
            index=index,
            uuid=uuid,
            name=_text(driver.query("nvmlDeviceGetName", handle)) or "NVIDIA GPU",
            memory_total=None if isinstance(memory, Absent) else int(memory.total),
            pci_bus_id=bus_id,
            capability=None if isinstance(capability, Absent) else (int(capability[0]), int(capability[1])),
        ),
        handle,
        mig_enabled=mig_enabled,
    )
    if mig_enabled:
        gpu.instances = _mig_instances(driver, gpu)
    return gpu


def _mig_instances(driver: _Driver, parent: _Found) -> list[_Found]:
    slots = driver.query("nvmlDeviceGetMaxMigDeviceCount", parent.handle)
    instances: list[_Found] = []
    for slot in range(0 if isinstance(slots, Absent) else slots):
        handle = driver.query("nvmlDeviceGetMigDeviceHandleByIndex", parent.handle, slot)
        if isinstance(handle, Absent):  # an empty slot answers NotFound
            continue
        uuid = _text(driver.query("nvmlDeviceGetUUID", handle))
        if uuid is None:
            continue
        memory = _memory_info(driver, handle, None, None)
        gi = driver.query("nvmlDeviceGetGpuInstanceId", handle)
        ci = driver.query("nvmlDeviceGetComputeInstanceId", handle)
        info = DeviceInfo(
            index=parent.info.index,
            uuid=uuid,
            name=_text(driver.query("nvmlDeviceGetName", handle)) or f"{parent.info.name} MIG",
            memory_total=None if isinstance(memory, Absent) else int(memory.total),
            is_mig=True,
            parent_uuid=parent.info.uuid,
            pci_bus_id=parent.info.pci_bus_id,
            mig_index=slot,
        )
        instances.append(
            _Found(
                info,
                handle,
                parent_handle=parent.handle,
                gpu_instance_id=None if isinstance(gi, Absent) else int(gi),
                compute_instance_id=None if isinstance(ci, Absent) else int(ci),
            )
        )
    return instances


def _leading_integer(entry: str) -> int | None:
    """CUDA reads an ordinal like atoi: leading digits count, the rest of the entry is ignored."""
    digits = ""
    for char in entry:
        if not char.isdigit():
            break
        digits += char
    return int(digits) if digits else None


def _match_prefix(prefix: str, candidates: Iterable[_Found]) -> _Found | None:
    matches = [c for c in candidates if c.info.uuid.lower().startswith(prefix.lower())]
    return matches[0] if len(matches) == 1 else None  # an ambiguous prefix is invalid


def _match_legacy_mig(entry: str, gpus: list[_Found]) -> _Found | None:
    """``MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>`` (drivers before R470)."""
    parts = entry[len("MIG-") :].split("/")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    parent = _match_prefix(parts[0], gpus)
    if parent is None:
        return None
    for instance in parent.instances:
        if (instance.gpu_instance_id, instance.compute_instance_id) == (int(parts[1]), int(parts[2])):
            return instance
    return None


def _cuda_order(gpus: list[_Found], device_order: str | None) -> tuple[list[_Found], str]:
    """The physical GPUs in CUDA's enumeration order, and how that order is known.

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is PCI order, which is NVML's own ("pci"). Unset or
    ``FASTEST_FIRST`` (CUDA's default) puts the device CUDA's heuristic deems fastest first and leaves
    the rest unspecified (CUDA's documentation); identical GPUs stay in PCI order ("pci"). With mixed
    models it is a guess, newest compute capability then most memory first ("guessed"), which
    :func:`_torch_order` replaces by torch's own UUIDs once torch has started CUDA.
    """
    if (device_order or "").strip().upper() == "PCI_BUS_ID" or len({g.info.name for g in gpus}) <= 1:
        return list(gpus), "pci"

    def speed(gpu: _Found) -> tuple[int, int, int, int]:
        major, minor = gpu.info.capability or (0, 0)
        return (-major, -minor, -(gpu.info.memory_total or 0), gpu.info.index)

    return sorted(gpus, key=speed), "guessed"


def uuid_key(uuid: str) -> str:
    """A UUID as NVML ("GPU-58c6...") and torch ("58c6...") spell it, made comparable."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _torch_order(visible: list[_Found], torch_uuids: Sequence[str] | None) -> list[_Found] | None:
    """``visible`` in torch's device order when torch's UUIDs name exactly these devices, else None."""
    if not torch_uuids or len(torch_uuids) != len(visible):
        return None
    by_uuid = {uuid_key(device.info.uuid): device for device in visible}
    ordered = [by_uuid.get(uuid_key(uuid)) for uuid in torch_uuids]
    if any(device is None for device in ordered) or len({id(d) for d in ordered}) != len(visible):
        return None
    return [device for device in ordered if device is not None]


def _torch_uuids() -> list[str] | None:
    """UUIDs of torch's CUDA devices, in its order, only where torch has already started CUDA.

    gpuwidget never imports torch nor starts CUDA itself (that would change the user's process:
    a CUDA context before fork breaks DataLoader workers); a cell before has usually done both.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - an old torch without .uuid: keep the order CUDA's rules give
        return None


def _cuda_visible(gpus: list[_Found], cuda_visible_devices: str | None) -> list[_Found]:
    """The devices CUDA shows, in CUDA's order, for a CUDA_VISIBLE_DEVICES value (None: unset).

    ``gpus`` are the physical GPUs in CUDA's enumeration order (:func:`_cuda_order`): an ordinal in
    CUDA_VISIBLE_DEVICES counts in that order, not NVML's.

    Follows CUDA's rules: entries are ordinals, ``GPU-<uuid prefix>`` or ``MIG-<uuid prefix>``
    (or the legacy ``MIG-GPU-<uuid>/<gi>/<ci>``); an invalid, unknown or ambiguous entry, or a switch
    between ordinals and UUIDs, ends the list there; a repeated device hides every device; a process
    sees at most one MIG instance, and when one is visible the non-MIG GPUs are hidden.
    """
    if cuda_visible_devices is None:
        chosen = list(gpus)
    else:
        chosen = []
        by_index = dict(enumerate(gpus))
        instances = [instance for gpu in gpus for instance in gpu.instances]
        ordinals: bool | None = None
        for raw in cuda_visible_devices.split(","):
            entry = raw.strip()
            ordinal = _leading_integer(entry)
            device: _Found | None
            if ordinal is not None:
                device = by_index.get(ordinal)
            elif entry.startswith("MIG-GPU-"):
                device = _match_legacy_mig(entry, gpus)
            elif entry.startswith("MIG-"):
                device = _match_prefix(entry, instances)
            elif entry.startswith("GPU-"):
                device = _match_prefix(entry, gpus)
            else:
                device = None
            if device is None or ordinals not in (None, ordinal is not None):
                break
            ordinals = ordinal is not None
            if any(device is seen for seen in chosen):
                return []
            chosen.append(device)
    migs = [device for device in chosen if device.info.is_mig]
    if migs:
        return migs[:1]
    visible: list[_Found] = []
    for device in chosen:
        if device.mig_enabled:
            if device.instances:
                return [device.instances[0]]
            continue  # MIG on but no instance: nothing CUDA can use
        visible.append(device)
    return visible


def _visible(gpus: list[_Found], cuda_visible_devices: str | None,
             device_order: str | None) -> tuple[list[_Found], str]:
    """CUDA's devices in CUDA's order, and how the order is known: "torch" (its UUIDs), "pci", "guessed"."""
    ordered, how = _cuda_order(gpus, device_order)
    visible = _cuda_visible(ordered, cuda_visible_devices)
    exact = _torch_order(visible, _torch_uuids())
    return (visible, how) if exact is None else (exact, "torch")


def list_devices() -> list[DeviceInfo]:
    """Every NVIDIA device on the machine (physical GPUs, then each one's MIG instances), with
    ``cuda_index`` set for those this process's CUDA can see. Empty when NVML is unavailable."""
    try:
        nvml = _load_pynvml()
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        driver = _Driver(nvml, ErrorLog("nvml"))
        gpus = _enumerate(driver)
        visible, _ = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
        cuda_index = {id(device): position for position, device in enumerate(visible)}
        devices: list[DeviceInfo] = []
        for gpu in gpus:
            for device in (gpu, *gpu.instances):
                position = cuda_index.get(id(device))
                info = device.info if position is None else _with_cuda_index(device.info, position)
                devices.append(info)
        return devices
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _with_cuda_index(info: DeviceInfo, position: int) -> DeviceInfo:
    return DeviceInfo(**{**asdict(info), "cuda_index": position})


# ---------------------------------------------------------------------------------------------------
# Whose GPU memory counts as ours


# This process's pid in each PID namespace it is nested in, outermost first ("NSpid:" line).
PROC_SELF_STATUS = "/proc/self/status"


def namespace_pids(status_path: str | None = None) -> list[int]:
    """This process's pids from the NSpid line, outermost namespace first; [] where Linux doesn't say.

    More than one entry: this process runs in a nested PID namespace and the first entry is its pid
    where /proc was mounted from, the numbering NVML uses when that is the host's.
    """
    try:
        with open(status_path or PROC_SELF_STATUS) as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def pid_visible(pid: int) -> bool:
    """Whether ``pid`` exists in this process's PID namespace (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's process: there, but not ours to signal
    return True


def foreign_pid_namespace(listed_pids: Iterable[int]) -> bool:
    """True when the driver's pids are not this namespace's: none of the processes NVML lists on a GPU
    exists here. NVML has no PID-namespace support: in a container it reports host pids, so the
    container's own processes (this one included) are not recognisable by pid."""
    pids = [pid for pid in listed_pids if pid > 0]
    return bool(pids) and not any(pid_visible(pid) for pid in pids)


class _OwnProcesses:
    """Answers "is this pid ours?" cheaply enough to ask every tick."""

    def __init__(self, pids: Callable[[], Iterable[int]] | None, driver: _Driver) -> None:
        self._pids = pids
        self._driver = driver
        self._given: frozenset[int] = frozenset()
        self._given_time = -math.inf
        self._own = os.getpid()
        # In a nested PID namespace whose outer /proc we see, NVML's number for us is the outermost.
        self._own_pids = {self._own, *namespace_pids()[:1]}
        self._verdicts: dict[int, bool] = {}

    def refresh(self, now: float) -> None:
        if self._pids is None:
            if len(self._verdicts) > 1024:  # pids get reused; forget old verdicts now and then
                self._verdicts.clear()
            return
        if now - self._given_time < PIDS_REFRESH_S:
            return
        self._given_time = now
        try:
            self._given = frozenset(int(pid) for pid in self._pids())
        except Exception as error:
            self._driver.report_once(f"pids() raised {type(error).__name__}: {error}; keeping the last set")

    def __contains__(self, pid: int) -> bool:
        if self._pids is not None:
            return pid in self._given
        verdict = self._verdicts.get(pid)
        if verdict is None:
            verdict = self._verdicts[pid] = self._descends_from_us(pid)
        return verdict

    def _descends_from_us(self, pid: int) -> bool:
        """True for this process and its descendants (DataLoader workers and their children).

        Walking up from the few pids NVML lists is far cheaper than listing our descendants, which
        scans the whole process table.
        """
        from gpuwidget.sources.lineage import ancestors

        return pid in self._own_pids or self._own in ancestors(pid, ANCESTRY_DEPTH)


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
        self.power_limit: float | None = None
        self.power_limit_time = -math.inf
        self.sm_clock_max: float | None = None
        self.power_limit_default: float | None = None
        self.pcie_link_max: tuple[float, float] | None = None  # (generation, width) the GPU and slot allow
        self.pcie_link: tuple[float, float] | None = None  # (generation, width) now
        self.pcie_link_time = -math.inf
        self.unknown_strikes = 0  # ticks in a row lost to NVML_ERROR_UNKNOWN
        self.sample_time = 0  # driver timestamp (us) of the newest utilization sample seen
        self.pcie: tuple[float, float] | None = None
        self.pcie_time = -math.inf
        self.procs_off = False
        self.gpm: _Gpm | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.label,
            "index": self.cuda_index,
            "nvml_index": self.info.index,
            "uuid": self.info.uuid,
            "name": self.info.name,
            "memory_total": self.info.memory_total,
            "power_limit": self.power_limit,
            "sm_clock_max": self.sm_clock_max,
            "power_limit_default": self.power_limit_default,
            "capability": None if self.info.capability is None else list(self.info.capability),
            "pcie_gen_max": None if self.pcie_link_max is None else int(self.pcie_link_max[0]),
            "pcie_width_max": None if self.pcie_link_max is None else int(self.pcie_link_max[1]),
            "is_mig": self.info.is_mig,
            "parent_uuid": self.info.parent_uuid,
            "pci_bus_id": self.info.pci_bus_id,
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
    Without a driver or a GPU the source is ``available = False`` with ``unavailable_reason`` set,
    and ``read()`` returns ``{}``.
    """

    name = "nvml"

    def __init__(
        self,
        gpus: Sequence[int] | None = None,
        pids: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self._log = ErrorLog(self.name)
        self.errors: list[SourceError] = self._log.errors
        self.available = False
        self.unavailable_reason: str | None = None
        self.missing: list[int] = []  # requested CUDA indexes that CUDA does not have
        self.visible_count = 0  # devices CUDA can see (before the ``gpus`` selection)
        # How CUDA's numbering was matched to NVML's: "torch" (UUIDs), "pci" (exact), "guessed".
        self.cuda_order: str | None = None
        self._devices: list[_Device] = []
        self._lock = threading.Lock()
        self._closed = False
        self._initialised = False
        self._cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._driver: _Driver | None = None
        self._own: _OwnProcesses | None = None
        # NVML lists processes with pids this PID namespace doesn't have (a container): see _proc_mem.
        self.foreign_pid_namespace = len(namespace_pids()) > 1
        self._start(gpus, pids)

    # -- life cycle ------------------------------------------------------------------------------

    def _start(self, gpus: Sequence[int] | None, pids: Callable[[], Iterable[int]] | None) -> None:
        try:
            nvml = _load_pynvml()
        except Exception as error:
            self._unavailable(f"no NVIDIA GPU found (nvidia-ml-py is not installed: {error})")
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound:
            self._unavailable("no NVIDIA GPU found (NVML library not found: no NVIDIA driver installed)")
            return
        except nvml.NVMLError_DriverNotLoaded:
            self._unavailable("no NVIDIA GPU found (the NVIDIA driver is not loaded)")
            return
        except Exception as error:
            self._unavailable(f"no NVIDIA GPU found (NVML failed to start: {error})")
            return
        self._initialised = True
        driver = self._driver = _Driver(nvml, self._log)
        driver.driver_version = _text(driver.query("nvmlSystemGetDriverVersion"))
        self._own = _OwnProcesses(pids, driver)
        try:
            gpus_found = _enumerate(driver)
        except Exception as error:  # enumeration must not make the constructor raise
            driver.report_once(f"listing GPUs failed: {error!r}")
            gpus_found = []
        if not gpus_found:
            self._unavailable("no NVIDIA GPU found")
            return
        visible, self.cuda_order = _visible(
            gpus_found, self._cuda_visible_devices, os.environ.get("CUDA_DEVICE_ORDER")
        )
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
        """Read the facts that do not change, and set up GPM where the GPU has it."""
        driver = self._require_driver()
        nvml = driver.nvml
        handle, off, label = device.handle, device.off, device.label
        clock_max = driver.query(
            "nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM, off=off, device=label
        )
        if not isinstance(clock_max, Absent):
            device.sm_clock_max = clock_max * MHZ
        default = driver.query("nvmlDeviceGetPowerManagementDefaultLimit", handle, off=off, device=label)
        if not isinstance(default, Absent):
            device.power_limit_default = default / 1000.0
        device.pcie_link_max = self._pcie_link(
            device, "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"
        )
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

    def describe(self) -> dict[str, Any]:
        """Availability (``reason`` when unavailable), driver, and each selected device's static facts;
        a device's ``index`` is its CUDA index, ``nvml_index`` the driver's (nvidia-smi's) number."""
        driver = self._driver
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.unavailable_reason,
            "driver_version": None if driver is None else driver.driver_version,
            "cuda_visible_devices": self._cuda_visible_devices,
            "visible_count": self.visible_count,
            "cuda_order": self.cuda_order,
            "foreign_pid_namespace": self.foreign_pid_namespace,
            "missing": list(self.missing),
            "devices": [
                {**device.describe(), "foreign_pid_namespace": self.foreign_pid_namespace}
                for device in self._devices
            ],
        }

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
        driver = self._require_driver()
        nvml = driver.nvml
        query = driver.query
        handle, off, label, key = device.handle, device.off, device.label, device.key

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

        power = query("nvmlDeviceGetPowerUsage", handle, off=off, device=label)
        if not isinstance(power, Absent):
            values[key["power"]] = power / 1000.0
        if now - device.power_limit_time >= POWER_LIMIT_REFRESH_S:
            device.power_limit_time = now
            limit = query("nvmlDeviceGetEnforcedPowerLimit", handle, off=off, device=label)
            if not isinstance(limit, Absent):
                device.power_limit = limit / 1000.0
        if device.power_limit is not None:
            values[key["power_limit"]] = device.power_limit
        if device.power_limit_default is not None:
            values[key["power_limit_default"]] = device.power_limit_default

        if now - device.pcie_link_time >= PCIE_LINK_REFRESH_S:
            device.pcie_link_time = now
            device.pcie_link = self._pcie_link(
                device, "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"
            )
        for link, names in ((device.pcie_link, ("pcie_gen", "pcie_width")),
                            (device.pcie_link_max, ("pcie_gen_max", "pcie_width_max"))):
            if link is not None:
                values[key[names[0]]], values[key[names[1]]] = link

        temperature = query(
            "nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU, off=off, device=label
        )
        if not isinstance(temperature, Absent):
            values[key["temperature"]] = float(temperature)

        clock = query("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM, off=off, device=label)
        if not isinstance(clock, Absent):
            values[key["sm_clock"]] = clock * MHZ
        if device.sm_clock_max is not None:
            values[key["sm_clock_max"]] = device.sm_clock_max

        events = driver.query_chain(_CLOCK_EVENTS, handle, off=off, device=label)
        if not isinstance(events, Absent):
            values[key["clock_events"]] = float(events)

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

    def _pcie_link(self, device: _Device, generation: str, width: str) -> tuple[float, float] | None:
        """(generation, lanes) of the GPU's PCIe link from a pair of NVML queries; None where either fails."""
        query = self._require_driver().query
        gen = query(generation, device.handle, off=device.off, device=device.label)
        lanes = query(width, device.handle, off=device.off, device=device.label)
        if isinstance(gen, Absent) or isinstance(lanes, Absent):
            return None
        return float(gen), float(lanes)

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
