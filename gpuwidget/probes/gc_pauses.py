"""Python's garbage collections during a watch: when each one that paused the program ran.

A collection stops every Python thread while it runs. A full one walks the whole heap: 0.2-0.3 s on
this 2-core machine in a process holding torch, Lightning, transformers, IPython and Bokeh (the test
suite's, measured), and the thread that allocates when one falls due pays it wherever it is. Inside
a DataLoader's ``next()``, where collation allocates, the pause read as the loop waiting for its
data: 32 in-memory batches waited 22% of their 1.3 s and were called starved. So the DataLoader
probe takes the collections' time out of the waits they fell in (``torch_data.DataLoaderProbe.flush``)
and counts it as the loop's own time: a loader is judged on what it made the loop wait.

Recorded through ``gc.callbacks``: two calls of a small function per collection, none per step (the
0.3 ms loop of issue 23 made 0-0.2 collections per 1,000 steps, watched or not). The callback runs on
whichever thread's allocation started the collection, holding the GIL, and collections never nest.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuwidget.clock import now
from gpuwidget.facts import GcFacts

# Collections shorter than this (the young generations' usual ones) are counted, not kept one by one.
MIN_PAUSE_S = 0.001
# Pauses that ended this long before the earliest wait a flush takes in are let go: no later wait reaches back.
KEEP_S = 60.0


class GcPauses:
    """The collections of one watch: their count and seconds, and the longer ones' times on ``clock``."""

    def __init__(self, clock: Callable[[], float] = now) -> None:
        self.collections = 0
        self.seconds = 0.0
        self.longest = 0.0
        self.pauses: list[tuple[float, float]] = []  # (start, end), in the order they ran
        # The kept pauses' seconds in all, and their CPU seconds by the thread that ran them: what a caller
        # reads before and after an interval is what the pauses took of it (a collection holds the GIL
        # from its start to its end).
        self.kept = 0.0
        self.kept_cpu: dict[int, float] = {}
        self._cpu_started = 0.0
        self._clock = clock
        self._started: float | None = None
        self._pid = os.getpid()

    def install(self) -> None:
        self._pid = os.getpid()
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        """Stop recording; safe to call twice (takes no lock: also what a forked child calls)."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_collection)
        self._started = None

    def _on_collection(self, phase: str, _info: dict[str, Any]) -> None:
        if os.getpid() != self._pid:
            return  # a process forked from the watched one (a DataLoader's worker) keeps the callback: not its figures
        if phase == "start":
            self._started = self._clock()
            self._cpu_started = time.thread_time()  # the thread that runs the collection, start to stop
            return
        started, self._started = self._started, None
        if started is None:  # installed while one ran
            return
        ended = self._clock()
        self.collections += 1
        self.seconds += ended - started
        self.longest = max(self.longest, ended - started)
        if ended - started >= MIN_PAUSE_S:
            self.pauses.append((started, ended))
            self.kept += ended - started
            thread = threading.get_ident()
            self.kept_cpu[thread] = self.kept_cpu.get(thread, 0.0) + time.thread_time() - self._cpu_started

    def facts(self) -> GcFacts:
        """``WorkloadFacts["gc"]``: the collections while the probes were installed."""
        return {"collections": self.collections, "seconds": self.seconds, "longest_s": self.longest}

    def overlap(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
        """Seconds of each interval ``[starts[i], ends[i]]`` that the kept pauses cover; None where no
        pause falls in any (the usual case, and nothing is made). Lets go of the pauses no later
        interval can reach (:data:`KEEP_S`)."""
        pauses = self.pauses
        if not pauses or not len(starts):
            return None
        taken = pauses[:]  # one C copy: a collection meanwhile appends to the original only
        low, high = float(starts.min()), float(ends.max())
        stale = sum(1 for _, end in taken if end < low - KEEP_S)
        if stale:
            del pauses[:stale]
        inside = [(start, end) for start, end in taken[stale:] if end > low and start < high]
        if not inside:
            return None
        covered = np.zeros(len(starts))
        for start, end in inside:
            covered += np.clip(np.minimum(ends, end) - np.maximum(starts, start), 0.0, None)
        return covered
