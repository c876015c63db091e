"""A kernel's watch status for its Jupyter server: one small private JSON file per kernel process.

The server's ``/metrics`` reports, per kernel, the running or last watched cell's figures
(data-wait fraction, samples/s, steps, main cause). Only the kernel knows them, and the server
already knows each kernel's pid and its runtime directory (where the connection files are),
so the kernel writes them there as ``gpuwidget-status-<pid>.json``:

* written by the watch when it starts, every :data:`WRITE_EVERY_S` while it runs (from the
  sampler thread, from the loader probe's running totals: no summary is computed) and once
  more when it ends, with the main cause; each write replaces the file atomically;
* bounded: one file per kernel process, under :data:`MAX_BYTES`, removed when the kernel exits;
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
import json
import logging
import math
import os
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
        status = {"version": FORMAT_VERSION, "pid": os.getpid(), "state": state, "label": self.label,
                  "updated": time.time(), "cause": None, **figures}
        try:
            write_private(self.path, json.dumps(status, allow_nan=False, default=str))
        except (OSError, ValueError) as exc:
            log.debug("gpuwidget: could not write the kernel status: %s", exc)


def write_private(path: str, text: str) -> None:
    """Replace ``path`` atomically with ``text``, readable by its owner only (0600)."""
    write_atomic(Path(path), text, private=True)


def read_status(path: str, not_before: float | None = None) -> KernelStatus | None:
    """A status file's figures, or None: absent, older than ``not_before`` (unix s), oversized or malformed."""
    try:
        with open(path, "rb") as fh:
            if not_before is not None and os.fstat(fh.fileno()).st_mtime < not_before:
                return None
            raw = fh.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_BYTES:
        return None
    try:
        status = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(status, dict) or status.get("version") != FORMAT_VERSION or status.get("state") not in STATES:
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
