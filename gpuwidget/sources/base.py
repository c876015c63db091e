"""The protocol every metric source follows, and the helpers they share.

A source is read once per sampler tick. ``read()`` returns one flat mapping of
metric name to value in SI units (bytes, watts, seconds, hertz, percent 0-100,
degrees Celsius for temperatures), named ``<device>.<metric>`` such as
``gpu0.util`` or ``cpu.util``. A metric the hardware cannot report is absent
from the mapping, never 0. ``read()`` must not raise: failures are recorded in
``errors`` and the source either degrades (drops the failing metric or device)
or reports itself finished through ``closed``.

A source may also keep ``busy_with``: what it is reading right now, named for the user
(``"GPU 1"``). When a read hangs, the sampler's message names that instead of the
source ("GPU 1 stopped answering at 12.4 s"). GPU sources declare it, with ``closed`` and
``processes()``, in their own protocol (:class:`gpuwidget.sources.gpu.GpuSource`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, runtime_checkable

log = logging.getLogger("gpuwidget")


class SavedSourceError(TypedDict):
    """A :class:`SourceError` as a saved run keeps it (``Run.sampler["source_errors"]``)."""

    source: str
    message: str
    device: str | None
    time: float | None


@dataclass(frozen=True)
class SourceError:
    """A failure a source recorded instead of raising."""

    source: str
    message: str
    device: str | None = None
    time: float | None = None

    def to_dict(self) -> SavedSourceError:
        return {"source": self.source, "message": self.message, "device": self.device, "time": self.time}


@runtime_checkable
class Source(Protocol):
    """What the sampler needs from a metric source."""

    name: str
    errors: list[SourceError]

    def read(self) -> dict[str, float]:
        """One tick of readings; never raises."""
        ...

    def describe(self) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
        """Static facts (device names, totals, availability), JSON-serialisable: one mapping, or one
        per device a source reads (a GPU source's devices)."""
        ...

    def close(self) -> None:
        """Release handles; idempotent."""
        ...


@dataclass
class ErrorLog:
    """Collects a source's errors, logging each distinct message once."""

    source: str
    errors: list[SourceError] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def record(self, message: str, device: str | None = None, time: float | None = None) -> None:
        self.errors.append(SourceError(self.source, message, device, time))
        key = f"{device}:{message}"
        if key not in self._seen:
            self._seen.add(key)
            log.warning("%s%s: %s", self.source, f" ({device})" if device else "", message)
