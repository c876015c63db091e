"""The one door to AMD's driver: the only module in gpuwidget that imports ``amdsmi`` (AMD SMI's Python bindings).

Every amdsmi call goes through :meth:`_Driver.query`, which turns a failure into a value, as the NVML
door does (:mod:`gpuwidget.sources.nvml.driver`):

* ``AMDSMI_STATUS_NOT_SUPPORTED`` / ``NOT_YET_IMPLEMENTED`` / ``NO_PERM`` -> an :class:`Absent` sentinel:
  the reading is left out (never reported as 0) and that function is not asked again on that device.
* ``AMDSMI_STATUS_NO_DATA`` and the bindings' ``"N/A"`` (a counter the firmware does not fill) -> absent
  for this tick only.
* ``RETRY`` / ``BUSY`` / ``TIMEOUT`` (``AmdSmiRetryException``, ``AmdSmiTimeoutException``) -> absent for
  this tick: the device is busy, not gone.
* ``NOT_FOUND`` / ``FILE_ERROR`` / ``IO`` / ``DRM_ERROR`` / ``AMDGPU_RESTART_ERR`` -> :class:`_DeviceSuspect`:
  what a GPU that fell off the bus (or is being reset) answers; the caller confirms by asking the
  device's PCI address and ends the device when that fails too.
* A function the installed bindings lack -> absent everywhere, logged once (bindings older than the
  driver's library).

amdsmi is imported when a source is built (:func:`_load_amdsmi`), not when this module is imported.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpuwidget.sources.base import ErrorLog

MIB = 1024 * 1024
MHZ = 1e6

# amdsmi_status_t (amd_smi/amdsmi.h): stable numbers, the same in every release of the bindings.
STATUS_INVAL = 1
STATUS_NOT_SUPPORTED = 2
STATUS_NOT_YET_IMPLEMENTED = 3
STATUS_DRM_ERROR = 6
STATUS_TIMEOUT = 8
STATUS_RETRY = 9
STATUS_NO_PERM = 10
STATUS_IO = 12
STATUS_FILE_ERROR = 14
STATUS_INIT_ERROR = 18
STATUS_BUSY = 30
STATUS_NOT_FOUND = 31
STATUS_NOT_INIT = 32
STATUS_DRIVER_NOT_LOADED = 34
STATUS_NO_DATA = 40
STATUS_AMDGPU_RESTART_ERR = 54


class Absent:
    """Why an amdsmi query has no value; compare by identity with the module's sentinels."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<absent: {self.reason}>"


NOT_SUPPORTED = Absent("not supported")
NO_PERMISSION = Absent("insufficient permissions")
MISSING = Absent("function not in these amdsmi bindings")
NO_DATA = Absent("no data this time")
FAILED = Absent("failed")

_REMEMBERED = {STATUS_NOT_SUPPORTED: NOT_SUPPORTED, STATUS_NOT_YET_IMPLEMENTED: NOT_SUPPORTED,
               STATUS_NO_PERM: NO_PERMISSION}
_TRANSIENT = {STATUS_NO_DATA, STATUS_RETRY, STATUS_BUSY, STATUS_TIMEOUT}
# What a query on a GPU that is gone (off the bus, being reset) answers.
_SUSPECT = {STATUS_NOT_FOUND, STATUS_FILE_ERROR, STATUS_IO, STATUS_DRM_ERROR, STATUS_AMDGPU_RESTART_ERR}
# amdsmi_init's answers that mean there is no AMD driver to talk to (rather than a broken one).
NO_DRIVER = {STATUS_DRIVER_NOT_LOADED, STATUS_INIT_ERROR, STATUS_NOT_INIT, STATUS_FILE_ERROR, STATUS_NOT_FOUND}


class _DeviceSuspect(Exception):
    """A query answered as a GPU that is gone does; the caller checks whether it still answers."""


class _DeviceLost(_DeviceSuspect):
    """The GPU is gone: the device is finished."""


def _load_amdsmi() -> Any:
    import amdsmi

    return amdsmi


def error_code(error: BaseException) -> int | None:
    """The amdsmi_status_t of an ``AmdSmiLibraryException`` (its ``err_code``), None for other errors."""
    code = getattr(error, "err_code", None)
    return abs(int(code)) if isinstance(code, int) else None


def start(amdsmi: Any) -> None:
    """``amdsmi_init`` for GPUs; raises what the bindings raise."""
    flags = getattr(getattr(amdsmi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
    if flags is None:
        amdsmi.amdsmi_init()
    else:
        amdsmi.amdsmi_init(flags)


def is_not_available(value: Any) -> bool:
    """The bindings' "N/A" (an all-ones counter the firmware did not fill), or None."""
    return value is None or (isinstance(value, str) and value.strip().upper() == "N/A")


def number(value: Any) -> float | None:
    """A reading as a float, or None for the bindings' "N/A" and anything not a number."""
    if is_not_available(value) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def field(mapping: Any, *path: str) -> float | None:
    """``mapping[path[0]][path[1]]...`` as a number, or None where any step is missing or "N/A"."""
    value = mapping
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return number(value)


class _Driver:
    """Calls amdsmi functions by name and turns every failure into a sentinel, a log line or _DeviceSuspect."""

    def __init__(self, amdsmi: Any, log: ErrorLog) -> None:
        self.amdsmi = amdsmi
        self._log = log
        self._missing: set[str] = set()
        self._reported: set[tuple[str | None, str]] = set()
        base = getattr(amdsmi, "AmdSmiException", None)
        self._errors: type[BaseException] | tuple[()] = base if isinstance(base, type) else ()
        self.lib_version: str | None = None

    def enum(self, enum_name: str, member: str) -> Any:
        """``amdsmi.<enum_name>.<member>`` (AmdSmiClkType.GFX...), or None where the bindings lack it."""
        return getattr(getattr(self.amdsmi, enum_name, None), member, None)

    def query(self, name: str, *args: Any, off: dict[str, Absent] | None = None, device: str | None = None,
              quiet: bool = False, key: str | None = None) -> Any:
        """``amdsmi.<name>(*args)``, or an :class:`Absent` saying why not; raises only _DeviceSuspect.

        ``off`` is the device's memory of queries that answered NotSupported or NoPermission (under
        ``key``, default ``name``: one function read with several arguments keeps one entry per use).
        """
        remembered = key or name
        if off is not None:
            known = off.get(remembered)
            if known is not None:
                return known
        if name in self._missing:
            return MISSING
        function = getattr(self.amdsmi, name, None)
        if function is None:
            self._missing.add(name)
            if not quiet:
                self.report_once(f"amdsmi {self.lib_version or ''} has no {name}: the readings it gives are absent "
                                 "(install the amdsmi bindings of the ROCm release on this machine)".replace("  ", " "))
            return MISSING
        try:
            return function(*args)
        except self._errors as error:
            code = error_code(error)
            if code in _SUSPECT:
                raise _DeviceSuspect(f"{name}: {_describe(error)}") from error
            absent = _REMEMBERED.get(code) if code is not None else None
            if absent is not None:
                if off is not None:
                    off[remembered] = absent
                return absent
            if code in _TRANSIENT or type(error).__name__ in ("AmdSmiRetryException", "AmdSmiTimeoutException"):
                return NO_DATA
            if not quiet:
                self.report_once(f"{name} failed: {_describe(error)}", device)
            return FAILED
        except Exception as error:  # a bindings bug (ctypes, a changed dict) must not end the tick
            if not quiet:
                self.report_once(f"{name} raised {type(error).__name__}: {error}", device)
            return FAILED

    def report_once(self, message: str, device: str | None = None) -> None:
        key = (device, message)
        if key not in self._reported:
            self._reported.add(key)
            self._log.record(message, device, time.time())


def _describe(error: BaseException) -> str:
    info = getattr(error, "err_info", None)
    return str(info) if info else str(error).replace("\n", " ").replace("\t", "")
