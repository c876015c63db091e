"""The one door to the NVIDIA driver: the only module in gpuwidget that imports pynvml.

Every NVML call goes through :meth:`_Driver.query`, which turns a failure into a value:

* ``NotSupported`` / ``NoPermission`` -> an :class:`Absent` sentinel; the metric is left out of the
  tick (never reported as 0) and that function is not asked again on that device.
* ``FunctionNotFound`` (the driver is older than the nvidia-ml-py bindings) -> absent everywhere,
  logged once with a hint that driver and bindings disagree.
* ``GpuIsLost`` / ``ResetRequired`` -> :class:`_DeviceLost`: the caller ends the device.
* ``Unknown`` -> :class:`_DeviceUnknown`: the caller decides whether the device is gone.

pynvml is imported when a source is built (:func:`_load_pynvml`), not when this module is imported,
so ``import gpuwidget`` stays fast on machines with or without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpuwidget.sources.base import ErrorLog

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


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


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


def _memory_info(driver: _Driver, handle: Any, off: dict[str, Absent] | None, device: str | None) -> Any:
    """nvmlDeviceGetMemoryInfo, preferring the v2 struct (``used`` excludes driver-reserved memory)."""
    if off is None or _MEMORY_V2 not in off:
        value = driver.query(_MEMORY_V2, handle, device=device, quiet=True, via=driver.memory_v2)
        if not isinstance(value, Absent):
            return value
        if off is not None:
            off[_MEMORY_V2] = value  # an older driver or GPU: the v1 struct from now on
    return driver.query("nvmlDeviceGetMemoryInfo", handle, off=off, device=device)
