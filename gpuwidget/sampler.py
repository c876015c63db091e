"""Sampler: one background thread that reads the sources at a fixed cadence into a Trace.

The cadence is kept on the monotonic clock: tick ``k`` is due at ``start + k * interval``.
A tick that comes too late (the process was busy, the GIL was held by a long C call) is
not made up with a burst of reads; the sampler skips to the next due time and counts
the ticks it missed. Nothing a source or a listener does can raise into user code:
failures are recorded on the sampler and the run goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuwidget.clock import now
from gpuwidget.sources.base import Source
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

Listener = Callable[[Trace], None]

THREAD_NAME = "gpuwidget-sampler"


@dataclass
class SamplerStats:
    """How the sampler itself behaved: useful to trust (or distrust) a run's figures."""

    ticks: int = 0
    missed_ticks: int = 0
    cpu_time_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def cpu_per_tick_s(self) -> float:
        return self.cpu_time_s / self.ticks if self.ticks else 0.0


class Sampler:
    """Reads ``sources`` every ``interval`` seconds into ``trace`` on a daemon thread."""

    def __init__(self, sources: Sequence[Source], trace: Trace, interval: float = 0.1,
                 listeners: Sequence[Listener] = ()) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be a positive number of seconds, not {interval!r}")
        self.sources = list(sources)
        self.trace = trace
        self.interval = interval
        self.listeners = list(listeners)
        self.stats = SamplerStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Sampler:
        if self._thread is not None:
            raise RuntimeError("a Sampler can be started once")
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None, final_tick: bool = True) -> None:
        """Stop the thread (within one interval); by default take one last reading here.

        The last reading means even a cell shorter than one interval ends with the
        state at its end, not only at its start.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout if timeout is not None else max(1.0, 2 * self.interval))
            if thread.is_alive():
                self._record("sampler thread did not stop in time")
        if final_tick and thread is not None:
            self.tick()

    def tick(self) -> None:
        """Read every source once and append the row; never raises."""
        cpu_before = time.thread_time()
        values: dict[str, float] = {}
        for source in self.sources:
            try:
                values.update(source.read())
            except Exception as exc:  # noqa: BLE001 - a broken source must not end the run
                self._record(f"{getattr(source, 'name', source)!s}: {exc!r}")
        try:
            self.trace.append(self.trace.now(), values)
        except Exception as exc:  # noqa: BLE001
            self._record(f"trace append failed: {exc!r}")
        for listener in self.listeners:
            try:
                listener(self.trace)
            except Exception as exc:  # noqa: BLE001
                self._record(f"listener {listener!r} failed: {exc!r}")
        self.stats.ticks += 1
        self.stats.cpu_time_s += time.thread_time() - cpu_before

    def _run(self) -> None:
        interval = self.interval
        start = now()
        due = start
        while not self._stop.is_set():
            self.tick()
            due += interval
            late = now() - due
            if late >= interval:
                skipped = int(late // interval)
                self.stats.missed_ticks += skipped
                due += skipped * interval
            if self._stop.wait(max(0.0, due - now())):
                break

    def _record(self, message: str) -> None:
        if message not in self.stats.errors:
            log.warning("gpuwidget sampler: %s", message)
        self.stats.errors.append(message)
        del self.stats.errors[:-100]
