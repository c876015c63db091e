"""Replay: plays a recorded Trace back as a source, for tests, fixtures and demos."""

from __future__ import annotations

import math
from typing import Any, TypedDict

import numpy as np

from gpuwidget.clock import now
from gpuwidget.sources.base import SourceError
from gpuwidget.trace import Trace


class ReplayDescription(TypedDict):
    name: str
    available: bool
    rows: int  # the recorded trace's rows
    recorded: dict[str, Any]  # the recorded trace's meta, as it was saved


class ReplaySource:
    """Reads a recorded Trace row by row.

    ``pace="tick"`` returns the next recorded row on every read (deterministic, for
    tests); ``pace="time"`` returns the row recorded at the elapsed wall time since
    the first read, scaled by ``speed`` (for demos). ``columns`` limits and
    ``prefix_map`` renames what is played (e.g. ``{"gpu0.": "gpu3."}``). When the
    recording ends the source returns ``{}`` unless ``loop`` is set.
    """

    name = "replay"

    def __init__(self, trace: Trace, *, pace: str = "tick", speed: float = 1.0, loop: bool = False,
                 columns: list[str] | None = None, prefix_map: dict[str, str] | None = None) -> None:
        if pace not in ("tick", "time"):
            raise ValueError(f"pace must be 'tick' or 'time', not {pace!r}")
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.errors: list[SourceError] = []
        frame = trace.window(columns=columns)
        self._t = frame.t - (frame.t[0] if len(frame.t) else 0.0)
        names = list(frame.mean)
        renamed = [_rename(name, prefix_map or {}) for name in names]
        self._names = renamed
        self._values = np.column_stack([frame.mean[n] for n in names]) if names else np.empty((len(self._t), 0))
        self._pace = pace
        self._speed = speed
        self._loop = loop
        self._position = 0
        self._started: float | None = None
        self._meta = dict(trace.meta)

    @property
    def finished(self) -> bool:
        return not self._loop and self._position >= len(self._t)

    def describe(self) -> ReplayDescription:
        return {"name": self.name, "available": True, "rows": len(self._t), "recorded": self._meta}

    def read(self) -> dict[str, float]:
        n = len(self._t)
        if n == 0:
            return {}
        if self._pace == "tick":
            index = self._position
            self._position += 1
        else:
            if self._started is None:
                self._started = now()
            elapsed = (now() - self._started) * self._speed
            if self._loop and self._t[-1] > 0:
                elapsed %= self._t[-1]
            index = int(np.searchsorted(self._t, elapsed, side="right")) - 1
            self._position = index + 1
        if index >= n:
            if not self._loop:
                return {}
            index %= n
        row = self._values[index]
        return {name: float(v) for name, v in zip(self._names, row) if not math.isnan(v)}

    def close(self) -> None:
        self._position = len(self._t)
        self._loop = False


def _rename(name: str, prefix_map: dict[str, str]) -> str:
    for old, new in prefix_map.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name
