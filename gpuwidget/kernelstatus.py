"""A kernel's watch status for its Jupyter server: one small private JSON file per kernel process.

The server's ``/metrics`` reports, per kernel, the running or last watched cell's figures
(data-wait fraction, samples/s, steps, main cause). Only the kernel knows them, and the server
already knows each kernel's pid and its runtime directory (where the connection files are),
so the kernel writes them there as ``gpuwidget-status-<pid>.json``:

* written by the watch when it starts, every :data:`WRITE_EVERY_S` while it runs (from the
  sampler thread, from the loader probe's running totals: no summary is computed) and once
  more when it ends, with the main cause; each write replaces the file atomically;
* bounded: one file per kernel process, under :data:`MAX_BYTES`, removed when the kernel exits;
  a kernel that was killed (no exit handler ran) leaves its file, which the next kernel to write
  one in the same directory removes (:func:`remove_stale`): only files written where its pids mean
  the same processes (the same boot of the same host, the same PID namespace), by a process that is
  gone, so kernels of other hosts or containers sharing a home directory keep theirs;
* private: created with mode 0600 in the runtime directory (itself 0700), next to the
  connection files that hold the kernel's key;
* written only inside a Jupyter kernel (the directory is that of its connection file), so
  plain IPython and scripts write nothing.

The server reads a file only for the pid of one of its own kernels, ignores a file older than
that process (a stale file whose pid was reused) and anything malformed or oversized.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

from gpuwidget.runfile import write_atomic

log = logging.getLogger("gpuwidget")

FORMAT_VERSION = 1
# Seconds between writes while a watch runs (~0.1 ms each; Prometheus scrapes every 15 s by default).
WRITE_EVERY_S = 2.0
# A status file is a few hundred bytes; anything larger is not ours.
MAX_BYTES = 4096
# A label longer than this is cut (it becomes a Prometheus label value).
MAX_LABEL_CHARS = 200
STATES = ("running", "finished")



class WatchFigures(TypedDict, total=False):
    """The figures a status file carries while a watch runs, and when it ends with its main cause."""

    steps: int | None
    samples_per_s: float | None
    data_wait_fraction: float | None
    cause: str  # the first finding's rule id, "none" without one


class KernelStatus(TypedDict):
    """A status file as the server reads it (:func:`read_status`): numbers checked, texts cut to length."""

    state: str  # one of STATES
    label: str
    cause: str  # "" while running
    steps: float | None
    samples_per_s: float | None
    data_wait_fraction: float | None
    updated: float | None  # unix s of the write


_removal_registered = False
_removal_lock = threading.Lock()
_swept: set[str] = set()  # directories this process has removed stale files from (once each)
_FILE_NAME = re.compile(r"gpuwidget-status-(\d+)\.json")
# A file this much newer than its pid's process start was still written by it (clocks' rounding).
_START_SLACK_S = 1.0


def status_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"gpuwidget-status-{int(pid)}.json")


def kernel_runtime_dir() -> str | None:
    """The directory of this kernel's connection file (the server's runtime dir), or None outside a kernel."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            return None
        from ipykernel.connect import get_connection_file

        return os.path.dirname(os.path.abspath(get_connection_file()))
    except Exception:  # noqa: BLE001 - no kernel, no status: nothing else depends on it
        return None


class StatusWriter:
    """Publishes one watch's progress; every method is cheap and never raises."""

    def __init__(self, directory: str, label: str = "", progress: Any = None) -> None:
        self.path = status_path(directory, os.getpid())
        self.label = label[:MAX_LABEL_CHARS]
        # progress() -> (steps, samples, wait_s, loop_s) of the busiest loader, or None.
        self._progress = progress
        self._last_write = -math.inf
        _remove_at_exit(self.path)
        with _removal_lock:
            first = directory not in _swept
            _swept.add(directory)
        if first:
            remove_stale(directory)

    @classmethod
    def for_kernel(cls, label: str = "", progress: Any = None) -> StatusWriter | None:
        directory = kernel_runtime_dir()
        return None if directory is None else cls(directory, label, progress)

    def started(self) -> None:
        self._write("running", {"steps": None, "samples_per_s": None, "data_wait_fraction": None})

    def on_tick(self, _trace: Any = None) -> None:
        """Sampler-thread listener: the running figures, every :data:`WRITE_EVERY_S`."""
        now = time.monotonic()
        if now - self._last_write < WRITE_EVERY_S:
            return
        self._last_write = now
        self._write("running", self._running_figures())

    def finished(self, summary: Mapping[str, object] | None, cause: str | None) -> None:
        """The run's end: its summary's figures (``Run.summary``) and its main cause."""
        summary = summary or {}
        self._write("finished", cast(WatchFigures, {
            "steps": summary.get("steps"),
            "samples_per_s": summary.get("samples_per_s"),
            "data_wait_fraction": summary.get("data_wait_fraction"),
            "cause": cause or "none",
        }))

    def _running_figures(self) -> WatchFigures:
        try:
            progress = self._progress() if self._progress is not None else None
        except Exception:  # noqa: BLE001 - a probe mid-change: try again next time
            progress = None
        if not progress:
            return {"steps": None, "samples_per_s": None, "data_wait_fraction": None}
        steps, samples, wait_s, loop_s = progress
        return {
            "steps": steps,
            "samples_per_s": samples / loop_s if samples and loop_s > 0 else None,
            "data_wait_fraction": wait_s / loop_s if loop_s > 0 else None,
        }

    def _write(self, state: str, figures: WatchFigures) -> None:
        status = {"version": FORMAT_VERSION, "pid": os.getpid(), "pid_space": pid_space(), "state": state,
                  "label": self.label, "updated": time.time(), "cause": None, **figures}
        try:
            write_private(self.path, json.dumps(status, allow_nan=False, default=str))
        except (OSError, ValueError) as exc:
            log.debug("gpuwidget: could not write the kernel status: %s", exc)


def write_private(path: str, text: str) -> None:
    """Replace ``path`` atomically with ``text``, readable by its owner only (0600)."""
    write_atomic(Path(path), text, private=True)


def _load(path: str) -> tuple[dict[str, Any], float] | None:
    """A status file's JSON object and when it was last written (unix s), or None: absent, oversized or
    not a JSON object."""
    try:
        with open(path, "rb") as fh:
            written = os.fstat(fh.fileno()).st_mtime
            raw = fh.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_BYTES:
        return None
    try:
        status = json.loads(raw)
    except ValueError:
        return None
    return (status, written) if isinstance(status, dict) else None


def read_status(path: str, not_before: float | None = None) -> KernelStatus | None:
    """A status file's figures, or None: absent, older than ``not_before`` (unix s), oversized or malformed."""
    loaded = _load(path)
    if loaded is None or (not_before is not None and loaded[1] < not_before):
        return None
    status = loaded[0]
    if status.get("version") != FORMAT_VERSION or status.get("state") not in STATES:
        return None
    return {
        "state": status["state"],
        "label": str(status.get("label") or "")[:MAX_LABEL_CHARS],
        "cause": str(status["cause"])[:MAX_LABEL_CHARS] if status.get("cause") else "",
        "steps": _number(status.get("steps")),
        "samples_per_s": _number(status.get("samples_per_s")),
        "data_wait_fraction": _number(status.get("data_wait_fraction")),
        "updated": _number(status.get("updated")),
    }


@functools.cache
def pid_space() -> str:
    """Where this process's pid names the same process for every reader: on Linux the host kernel's
    boot and the PID namespace (containers share the first, not the second), elsewhere the host. Read
    once: a process keeps its PID namespace (a forked child shares it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def remove_stale(directory: str) -> int:
    """Remove the status files in ``directory`` whose kernel is gone; return how many.

    A file is removed only when it says it was written in this process's pid space (:func:`pid_space`)
    and its pid is no longer running, or runs a process started after the file's last write (a reused
    pid). Files of other hosts or namespaces, of older formats, or unreadable ones stay.
    """
    import psutil

    space, removed = pid_space(), 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = _FILE_NAME.fullmatch(name)
        if match is None or int(match[1]) == os.getpid():
            continue
        path = os.path.join(directory, name)
        loaded = _load(path)
        if loaded is None or loaded[0].get("pid_space") != space:
            continue
        written = loaded[1]
        try:
            started = psutil.Process(int(match[1])).create_time()
        except psutil.NoSuchProcess:
            started = math.inf
        except psutil.Error:  # not ours to judge (access denied)
            continue
        if started > written + _START_SLACK_S:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    if removed:
        log.debug("gpuwidget: removed %d status files of kernels that are gone from %s", removed, directory)
    return removed


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _remove_at_exit(path: str) -> None:
    global _removal_registered
    with _removal_lock:
        if _removal_registered:
            return
        _removal_registered = True

    owner = os.getpid()

    def remove() -> None:
        if os.getpid() != owner:
            return  # a forked child exiting normally: the file is its parent's
        with contextlib.suppress(OSError):
            os.unlink(path)

    atexit.register(remove)
