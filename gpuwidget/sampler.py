"""Sampler: one background thread that reads the sources on a cadence into a Trace.

The cadence is kept on the monotonic clock: tick ``k`` is due at ``start + k * interval``, or,
for a sampler that samples the watched thread's stack (a ``first`` listener), one interval on
average after the one before, dithered (:func:`dithered`). A tick that comes too late (the
process was busy, the GIL was held by a long C call) is not made up with a burst of reads; the
sampler skips to the next due time and counts the ticks it missed. Nothing a source or a
listener does can raise into user code: failures are recorded on the sampler and the run goes on.

Nothing a source does can hold up the caller either. Sources are only read on the
sampler's own thread (the last reading too), and :meth:`Sampler.stop` waits a bounded
time for it. A watchdog notices a read that does not return (an NVML call on a GPU
falling off the bus, ``/proc`` on an overloaded node): that source is dropped with a
message naming when it stopped answering, and a fresh sampler thread carries on with
the others. The stuck thread is abandoned (it is a daemon) and discards whatever the
read returns if it ever does. The sampler is a thread: the stack sample, the probes'
flushes and the Trace's row need this process. The sources' reads can be done by a process
of their own (gpuwidget.sources.reader, ``GPUWIDGET_READER=process``), the thread then waiting
for their answer without the GIL (BENCHMARKS.md, section 20h).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwidget.clock import now
from gpuwidget.sources.base import Source
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

Listener = Callable[[Trace], None]

THREAD_NAME = "gpuwidget-sampler"
# When the tick running on a sampler thread was due (clock time): see tick_due().
_due = threading.local()

# A read that has not returned after this long is a hung source. NVML queries answer in
# milliseconds (PCIe throughput, the slowest, blocks 20 ms: JUPYTER-FACTS.md) and the host
# source reads /proc in a few ms; 2 s is 8 ticks at the default interval, far beyond a
# slow but living read on a loaded node.
SOURCE_DEADLINE_S = 2.0
# The watchdog looks this often. A look that comes much later than planned means the whole
# interpreter was held (a long C call with the GIL): it restarts the count rather than
# blame a source that could not run either.
WATCHDOG_PERIOD_S = SOURCE_DEADLINE_S / 4
WATCHDOG_LATE_S = WATCHDOG_PERIOD_S
# stop() waits this long for the sampler thread's last reading: a watched cell must end
# within 1 s of its own code (issue 10), and summarising and showing the run need the rest.
STOP_DEADLINE_S = 0.5
# A thread waiting for the GIL asks its holder to let go only after the switch interval (5 ms by
# default): a tick's ``first`` listener (the stack sample) read the watched thread up to 5 ms after
# the tick was due, and a wait of pure Python not much longer than that (a tokenizer in a collate_fn,
# ~6 ms a batch) had mostly ended by then. The reads that came in time were those where the loop
# let go of the GIL itself (a DataLoader's C calls): in 6 runs of tests/real_scripts/
# run_clm_no_trainer.py at 20 Hz, 29 to 36 samples a run were read after their wait had ended and
# 0 to 5 found the tokenizer; with a prompt read, 1 to 12 and 12 to 20 (5 runs). So a tick with such
# a listener is woken a switch interval (and PROMPT_LEAD_S) early, lowers the interval to
# PROMPT_SWITCH_S until its sample is taken, and puts the user's back: a few ms a tick.
PROMPT_SWITCH_S = 0.0005
PROMPT_LEAD_S = 0.001
# A stack sample's interval is drawn uniformly within this share of the interval either side of it.
# At a fixed cadence a loop whose step takes about one interval (or a whole number of them) is
# sampled at the same point of its step, tick after tick, and the tick itself moves that point: a
# tick landing in the loop's Python holds the GIL for its read and delays the step, one landing in a
# sleep does not, so the ticks drifted through the step's work faster than through its waits and
# found too few of them. A nanoGPT-style loop waiting 0.77 of its 10.2-10.8 ms step read as waiting
# 0.84-0.88 (5 runs), at 12 ms 0.80 (2), and fresh-check and CI read 0.79 and 0.67 for 0.52 where a
# slow host made the step about 10 ms. Dithered, the ticks' place in the step is random (as a
# profiler's samples must be: a periodic program and a periodic sampler alias).
DITHER = 0.5


@dataclass
class SamplerStats:
    """How the sampler itself behaved: useful to trust (or distrust) a run's figures."""

    ticks: int = 0
    missed_ticks: int = 0
    cpu_time_s: float = 0.0
    # cpu_time_s by part of the tick: "stack sample" (the first listeners), each source by its name,
    # "trace row", "listeners". On an H200 machine the whole tick took ~12 ms of CPU against ~0.9 ms
    # here (BENCHMARKS.md, section 8a): a run says where its own watch's time went.
    part_cpu_s: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Sources dropped because a read never returned: {"source", "at_s", "message"}.
    stalled: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Read:
    """The read in progress on a sampler thread (what the watchdog inspects)."""

    thread: threading.Thread | None
    source: Any
    started: float


def _charge(parts: dict[str, float], part: str, since: float) -> float:
    """Add the thread CPU time since ``since`` to ``parts[part]``; returns the time now."""
    current = time.thread_time()
    parts[part] = parts.get(part, 0.0) + current - since
    return current


def dithered(interval: float, draw: random.Random) -> float:
    """The time to the next stack sample: ``interval`` on average, uniform within :data:`DITHER` of it."""
    return interval * (1.0 + DITHER * (2.0 * draw.random() - 1.0))


class PromptGil:
    """Wakes a tick that reads the watched thread early and lowers the switch interval until its read
    (:data:`PROMPT_SWITCH_S`): it then gets the GIL within about that much of its due time."""

    def __init__(self) -> None:
        self.usual: float | None = None  # the interval put back; None while not lowered
        self.lowered = 0.0  # the interval as set (as sys reports it: whole microseconds)
        _PROMPTS.add(self)

    def wait(self, stop: threading.Event, due: float) -> bool:
        """Wait until ``due`` (True: ``stop`` was set, and the interval is put back), with the interval
        lowered for the last of it: :meth:`restore` puts it back after the read."""
        early = due - sys.getswitchinterval() - PROMPT_LEAD_S
        if stop.wait(max(0.0, early - now())):
            return True
        current = sys.getswitchinterval()
        if self.usual is None and current > PROMPT_SWITCH_S:
            self.usual = current
            sys.setswitchinterval(PROMPT_SWITCH_S)
            self.lowered = sys.getswitchinterval()
        if stop.wait(max(0.0, due - now())):
            self.restore()
            return True
        return False

    def restore(self) -> None:
        """Put the user's interval back (unless they have set one of their own meanwhile); safe to repeat."""
        usual, self.usual = self.usual, None
        if usual is not None and sys.getswitchinterval() == self.lowered:
            sys.setswitchinterval(usual)


_PROMPTS: weakref.WeakSet[PromptGil] = weakref.WeakSet()


def _usual_interval_in_child() -> None:
    """A process forked while a tick had the interval lowered (a DataLoader worker, a rank) starts with
    the user's: the thread that would have put it back is not in the child."""
    for prompt in list(_PROMPTS):
        prompt.restore()


os.register_at_fork(after_in_child=_usual_interval_in_child)


class Sampler:
    """Reads ``sources`` every ``interval`` seconds into ``trace`` on a daemon thread."""

    def __init__(self, sources: Sequence[Source], trace: Trace, interval: float = 0.1,
                 listeners: Sequence[Listener] = (), first: Sequence[Listener] = ()) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be a positive number of seconds, not {interval!r}")
        self.sources = list(sources)
        self.trace = trace
        self.interval = interval
        self.listeners = list(listeners)
        # Called at the start of each tick, before any source is read (reading them takes a while):
        # what must see the moment the tick was due, the stack sampler's sample.
        self.first = list(first)
        self.stats = SamplerStats()
        self._stop = threading.Event()
        self._started = False
        self._final_tick = True
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # the thread whose readings count
        self._watchdog: threading.Thread | None = None
        self._reading: _Read | None = None
        self._dropped: list[Any] = []
        self._prompt = PromptGil()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def hung_sources(self) -> list[Source]:
        """Sources dropped because a read never returned: close them off the caller's thread."""
        return list(self._dropped)

    @property
    def busy_sources(self) -> list[Source]:
        """The hung sources, and the one a reader thread is still inside (a stop that was cut short):
        closing any of them could wait on that read, so close them off the caller's thread."""
        reading = self._reading
        inside = [reading.source] if reading is not None and reading.thread is not None \
            and reading.thread.is_alive() else []
        return [*self._dropped, *(source for source in inside if source not in self._dropped)]

    def start(self) -> Sampler:
        if self._started:
            raise RuntimeError("a Sampler can be started once")
        self._started = True
        with self._lock:
            self._thread = self._spawn(self._run)
        self._watchdog = self._spawn(self._watch)
        return self

    def stop(self, timeout: float | None = None, final_tick: bool = True) -> None:
        """Stop within ``timeout`` (default :data:`STOP_DEADLINE_S`); never reads a source here.

        With ``final_tick`` the sampler thread takes one last reading on its way out, so
        even a cell shorter than one interval ends with the state at its end. A thread
        still inside a read when the time is up is left behind and that source dropped.
        """
        if self._stop.is_set():
            return
        self._final_tick = final_tick
        self._stop.set()
        deadline = now() + (STOP_DEADLINE_S if timeout is None else timeout)
        for thread in (self._thread, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - now()))
        thread = self._thread
        if thread is not None and thread.is_alive():
            reading = self._reading
            if reading is not None and reading.thread is thread:
                self._drop(reading)
                with self._lock:
                    self._thread = None  # if the read ever returns, the abandoned thread discards it
            else:
                self._record("sampler thread did not stop in time")

    def tick(self) -> None:
        """Read every source once and append the row; never raises.

        Reads on the calling thread: the sampler calls it on its own, and a caller that
        wants a synchronous reading (the server's snapshot) calls it on a worker thread.
        """
        self._tick(None)

    # ------------------------------------------------------------- threads

    def _spawn(self, target: Callable[[], None]) -> threading.Thread:
        """Start a thread; called under ``_lock`` for a reader, which waits on it to learn it is current."""
        thread = threading.Thread(target=target, name=THREAD_NAME, daemon=True)
        thread.start()
        return thread

    def _tick(self, owner: threading.Thread | None) -> bool:
        """One row; False when ``owner`` was replaced meanwhile (its reading is discarded)."""
        parts = self.stats.part_cpu_s
        cpu_before = mark = time.thread_time()
        try:
            self._call(self.first)
        finally:
            self._prompt.restore()
        if self.first:
            mark = _charge(parts, "stack sample", mark)
        values: dict[str, float] = {}
        for source in self.sources:
            if source in self._dropped:
                continue
            self._reading = _Read(owner, source, now())
            try:
                values.update(source.read())
            except Exception as exc:  # noqa: BLE001 - a broken source must not end the run
                self._record(f"{getattr(source, 'name', source)!s}: {exc!r}")
            mark = _charge(parts, str(getattr(source, "name", None) or type(source).__name__), mark)
            if owner is not None and self._thread is not owner:
                return False
        self._reading = None
        try:
            self.trace.append(self.trace.now(), values)
        except Exception as exc:  # noqa: BLE001
            self._record(f"trace append failed: {exc!r}")
        mark = _charge(parts, "trace row", mark)
        if self.listeners:
            self._call(self.listeners)
            mark = _charge(parts, "listeners", mark)
        self.stats.ticks += 1
        self.stats.cpu_time_s += mark - cpu_before
        return True

    def _call(self, listeners: list[Listener]) -> None:
        for listener in listeners:
            try:
                listener(self.trace)
            except Exception as exc:  # noqa: BLE001
                self._record(f"listener {listener!r} failed: {exc!r}")

    def _run(self) -> None:
        with self._lock:  # start() or the watchdog records this thread as the reader first
            me = threading.current_thread()
        interval = self.interval
        draw = random.Random() if self.first else None  # its own: the user's seeds are theirs

        def gap() -> float:
            return interval if draw is None else dithered(interval, draw)

        due = now()
        following = due + gap()
        while not self._stop.is_set():
            _due.value, _due.following = due, following  # the next drawn first: the step probe plans for it
            if not self._tick(me):
                return
            due = following
            late = now() - due
            if late >= interval:
                skipped = int(late // interval)
                self.stats.missed_ticks += skipped
                due += skipped * interval
            following = due + gap()
            if self._wait_until(due):
                break
        self._prompt.restore()
        _due.value = _due.following = None  # the last reading is not one of the cadence's
        if self._final_tick and self._thread is me:
            self._tick(me)

    def _wait_until(self, due: float) -> bool:
        """Wait for ``due``; True when stopped. A tick with a ``first`` listener gets the GIL promptly."""
        if self.first:
            return self._prompt.wait(self._stop, due)
        return self._stop.wait(max(0.0, due - now()))

    def _watch(self) -> None:
        """Drop a source whose read has been in progress for :data:`SOURCE_DEADLINE_S`."""
        suspect: _Read | None = None
        waited = 0.0
        looked = now()
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            current = now()
            on_time = current - looked <= WATCHDOG_PERIOD_S + WATCHDOG_LATE_S
            looked = current
            reading = self._reading
            if reading is None or reading is not suspect or not on_time:
                suspect, waited = reading, 0.0
                continue
            waited += WATCHDOG_PERIOD_S
            if waited >= SOURCE_DEADLINE_S and reading.thread is self._thread:
                self._drop(reading)
                with self._lock:
                    if not self._stop.is_set():
                        self._thread = self._spawn(self._run)
                suspect, waited = None, 0.0

    def _drop(self, reading: _Read) -> None:
        """Stop reading a source that does not answer, and say so where the run shows it."""
        with self._lock:
            if reading.source in self._dropped:
                return
            self._dropped.append(reading.source)
            name = source_label(reading.source)
            at_s = max(0.0, reading.started - self.trace.start_clock)
            message = f"{name} stopped answering at {at_s:.1f} s; its readings end there"
            self.stats.stalled.append({"source": name, "at_s": at_s, "message": message})
        self._record(message)

    def _record(self, message: str) -> None:
        if message not in self.stats.errors:
            log.warning("gpuwidget sampler: %s", message)
        self.stats.errors.append(message)
        del self.stats.errors[:-100]


def set_tick_due(value: float | None, following: float | None) -> None:
    """Mark when the tick this thread runs now was due (None: no tick) and when the next one is, for a
    thread that ticks listeners on a cadence of its own (a child process's agent samples its stack so)."""
    _due.value, _due.following = value, following


def tick_due() -> float | None:
    """When the sampler tick running on this thread was due, on the clock of ``gpuwidget.clock.now``;
    None outside a sampler thread's ticks. A listener that needs the GIL (the stack sampler) gets it
    late when the watched code holds it, and times what it reads by when it was meant to read."""
    return getattr(_due, "value", None)


def next_tick_due() -> float | None:
    """When the tick after the one running on this thread is due (drawn already: :func:`dithered`); None
    outside a sampler thread's ticks. A tick that comes late still skips whole intervals from it."""
    return getattr(_due, "following", None)


def source_label(source: Any) -> str:
    """How a hung source is named to the user: what it was reading (``busy_with``, e.g. "GPU 1"), else its name."""
    return str(getattr(source, "busy_with", None) or getattr(source, "name", None) or type(source).__name__)
