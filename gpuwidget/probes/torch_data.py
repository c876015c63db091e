"""DataLoader probe: how long the loop is blocked in ``next()``, per step, and how each loader is set up.

While a watch is active, two class attributes of torch are wrapped:

* ``DataLoader.__init__``, to know where a loader built during the watch was built (the
  user's file and function, and the framework that built it: see gpuwidget.probes.origin);
* ``DataLoader.__iter__``, to know which loader an iterator belongs to;
* ``_BaseDataLoaderIter.__next__``, the single ``next()`` of every DataLoader iterator
  (single- and multi-process, and those inside Lightning or Hugging Face trainers), to
  time the call.

An epoch is an iterator that yielded a batch: ``enumerate(tqdm(loader))`` asks for an
iterator it never uses. accelerate's loaders fetch one batch ahead of the loop, so a loop
left early took one batch fewer than the loader fetched.

Only the time actually spent blocked in ``next()`` counts as waiting for data. The time
between one ``next()`` returning and the next one being called is the loop's own work
(forward, backward, optimizer, and also checkpoints or logging), so a loop that pauses to
save a checkpoint is never mistaken for a starved loader. A *step* runs from the start of
one ``next()`` to the start of the following one.

The wrapper is on the loop's critical path, so per step it only reads the clock twice and
extends a flat list by one record of four numbers (the loader, start, end, samples): one C call,
so a flush sees whole records, and about a tenth of what appending them to an ``array('d')``
cost (each item there goes through an argument parser). A batch's samples are read from its first
tensor's shape only until they are seen to follow from the loader's own batching (torch's
``BatchSampler`` and default collation: ``batch_size`` a batch, the rest in an epoch's last); the flush
then counts them from the batch's place in its epoch (:meth:`LoaderStats._planned`), and the sampled
calls below keep checking. Reading a tensor's ``shape`` was about half of what a minimal timing wrapper
adds to a step in instructions and cache misses (a first cachegrind run, BENCHMARKS.md section 20l).
The few attributes it touches are the loader's call count and the last loader to return. The sampler
thread makes everything else of those records at each tick, with numpy, a tick's steps at once
(:meth:`DataLoaderProbe.flush`): the step and wait
spans, step and wait times, epochs, totals. The looping thread's CPU time and run delay behind
``wait_cpu_ratio`` and ``wait_delay_ratio`` are read around the wait on one step in
:data:`CPU_SAMPLE_EVERY` (its CPU clock, and a small file read for the delay:
gpuwidget.sources.schedstat), never on the first step (it starts workers and warms lazy imports and
caches, so it is not the loader's steady state). Those reads are system calls, several us each inside
a fast loop on a VM: a fast loop reads them on fewer steps, so that they take at most
:data:`SAMPLE_COST_SHARE` of its time, once its waits are either a small share of its steps (its loader
is not what holds it up) or sampled enough (:data:`SAMPLED_WAITS_ENOUGH`; :func:`sample_stride`). On those same
steps, a loader without workers (the loop's thread builds its batches) also has its collate function
timed, through the iterator's own fetcher (the user's loader is untouched): ``collate_share``, which
names the collate function as the batches' builder where stack samples, read at the GIL's switch
interval, miss a few milliseconds of Python (``advice.rules.dataloader_cpu_bound.batch_builder``).
Costs are in BENCHMARKS.md. Everything is restored by :meth:`uninstall`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from gpuwidget.clock import now
from gpuwidget.facts import CodeSite, LoaderChange, LoaderFacts, LoaderSettings
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
from gpuwidget.probes import origin as origins
from gpuwidget.probes.constructor import constructor_facts
from gpuwidget.probes.gc_pauses import GcPauses
from gpuwidget.sources.schedstat import thread_run_delay
from gpuwidget.trace import Trace

# The collate function's timer (a test's fake trace clock leaves it alone).
perf_counter = time.perf_counter
# The looping thread's CPU clock, read around a sampled wait: exact at the call, where schedstat's
# on-CPU figure lags (gpuwidget.sources.schedstat.thread_run_delay says how).
cpu_clock = time.thread_time
# Per-step figures kept per loader for percentiles and stall detection (a bounded window).
STEP_HISTORY = 20_000
# The looping thread's CPU time and run delay are read around one next() in this many: enough to tell
# CPU work from sleeping, without a system call on every step.
CPU_SAMPLE_EVERY = 8
# A sampled next() costs the loop about this much more than another (four system calls, two CPU clock reads
# and two of schedstat, and the collate function's timer: 41 us in the 0.3 ms loop, 34 us of it the two
# schedstat reads, BENCHMARKS.md section 20k). A loop samples one next() in as many as keep that cost
# under SAMPLE_COST_SHARE of its time (at most one in
# MAX_SAMPLE_STRIDE), except while it waits SAMPLE_EVERY_WAIT_SHARE of its step or more and its sampled
# waits are fewer than SAMPLED_WAITS_ENOUGH and shorter than SAMPLED_WAIT_ENOUGH_S in all: then one in
# CPU_SAMPLE_EVERY, as the advice needs its loader's CPU soon (advice.loader.MIN_SAMPLED_WAITS and
# MIN_SAMPLED_WAIT_S: three times either).
SAMPLED_CALL_COST_S = 45e-6
SAMPLE_COST_SHARE = 0.001
SAMPLE_EVERY_WAIT_SHARE = 0.1
SAMPLED_WAITS_ENOUGH = 192
SAMPLED_WAIT_ENOUGH_S = 0.3
MAX_SAMPLE_STRIDE = 512
# A record the loop's thread appends per next(): (loader's slot, start, end, samples). The end
# field of a record that is no step says what happened instead.
RECORD = 4
_STOPPED = -1.0  # next() raised StopIteration at `start`: the epoch's last step ends there
_RESTARTED = -2.0  # a new iterator of this loader (or one reused): no step spans across it


class LoaderStats:
    """What one DataLoader did during the watch."""

    def __init__(self, loader: Any) -> None:
        self.loader_ref = weakref.ref(loader) if loader is not None else None
        self.settings = loader_settings(loader) if loader is not None else {}
        self.dataset_ref = _weak(getattr(loader, "dataset", None))
        self.slot = 0  # its index in DataLoaderProbe.stats: the first field of its records
        self.calls = 0  # next() calls that returned a batch, counted on the loop's thread
        self.steps_fed = 0  # optimizer steps taken right after one of its batches (probes.torch_steps)
        self.epochs = 0
        self.steps = 0
        self.samples = 0
        self.wait_total = 0.0
        self.gc_wait = 0.0  # seconds of Python's garbage collections inside its waits, taken out of them
        self.wait_cpu_total = 0.0  # CPU seconds of the looping thread during the sampled waits (its CPU clock)
        self.wait_delay_total: float | None = 0.0  # its run delay then (None: no schedstat here)
        self.wait_sampled = 0.0  # wall seconds of the sampled waits
        self.sampled_calls = 0
        self.next_sampled = 1  # the next() (0-based, of those that returned a batch) sampled next
        self.first_sampled: tuple[int, float] | None = None  # (call, its start) of the first sampled one
        self.collate_total = 0.0  # seconds in the collate function during the sampled waits without workers
        self.collate_timed = 0.0  # wall seconds of those waits
        self.compute_total = 0.0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.pending_start: float | None = None  # start of the step whose next() returned last
        self.step_times: deque[float] = deque(maxlen=STEP_HISTORY)
        self.wait_times: deque[float] = deque(maxlen=STEP_HISTORY)
        self.built: origins.Origin | None = None  # origin.stack_origin where the loader was built
        self.iterated: origins.Origin | None = None  # ... and where it was first iterated
        self.last_batch_samples = 0
        # (batch_size, samples an epoch, drop_last) where the loader's own batching says each batch's samples
        # (batch_samples' reading of torch's default collation), else None; `planned` once a batch read
        # agreed with it: the loop's thread then reads no batch's size, except on its sampled calls.
        self.plan = batch_plan(loader) if loader is not None else None
        self.planned = False
        self.plan_trusted: bool | None = None  # False: a read disagreed; never planned again
        self.next_plan: tuple[tuple[int, int, bool] | None] | None = None  # from the next epoch's records on
        self.epoch_batches = 0  # batches of the current epoch made into figures
        self.batch_device: str | None = None  # where the batches' tensors live, read on a sampled next()
        self.stopped_at = -1  # `calls` when an iterator last raised StopIteration

    @property
    def exhausted(self) -> bool:
        """The current iterator has raised StopIteration (no batch came since)."""
        return self.stopped_at == self.calls

    @property
    def owner(self) -> str | None:
        return origins.owner(self.built, self.iterated)

    @property
    def fetches_ahead(self) -> bool:
        """accelerate drives this loader (its own, or the HF Trainer's): one batch ahead of the loop."""
        return any("accelerate" in ((origin or origins.NO_ORIGIN).get("inner") or [])
                   for origin in (self.built, self.iterated))

    @property
    def loader(self) -> Any:
        return self.loader_ref() if self.loader_ref is not None else None

    def facts(self, names: Mapping[int, str]) -> LoaderFacts:
        loader = self.loader
        loop_time = self.wait_total + self.compute_total
        dataset = getattr(loader, "dataset", None)
        return {
            "name": names.get(id(loader)) if loader is not None else None,
            "dataset_name": names.get(id(dataset)) if dataset is not None else None,
            "settings": self.settings,
            "epochs": self.epochs,
            "steps": self.steps,
            "samples": self.samples,
            "wait_total_s": self.wait_total,
            "gc_wait_s": self.gc_wait,
            "compute_total_s": self.compute_total,
            "loop_time_s": loop_time,
            # CPU time of the thread blocked in next(): ~1 when it builds batches itself
            # (num_workers=0), near 0 when it sleeps on storage or on workers. Its run delay:
            # the share it was ready to run but other tasks held the cores.
            "wait_cpu_ratio": self.wait_cpu_total / self.wait_sampled if self.wait_sampled > 0 else None,
            "wait_delay_ratio": (self.wait_delay_total / self.wait_sampled
                                 if self.wait_sampled > 0 and self.wait_delay_total is not None else None),
            "wait_sampled_s": self.wait_sampled,
            "wait_samples": self.sampled_calls,
            "wait_cpu_clock": "thread",  # read from the thread's CPU clock (older runs: schedstat's lagging figure)
            # The share of the loop's wait in next() spent in the collate function, where the loop's
            # thread built the batches itself (num_workers=0; None: never timed).
            "collate_share": self.collate_total / self.collate_timed if self.collate_timed > 0 else None,
            "batch_device": self.batch_device,
            "step_times": list(self.step_times),
            "wait_times": list(self.wait_times),
            "owner": self.owner,
            "built_at": (self.built or origins.NO_ORIGIN).get("site"),
            "steps_fed": self.steps_fed,
            "user_names": origins.user_names(loader, names, self.built) if loader is not None else {},
        }

    def take(self, rows: np.ndarray, at: np.ndarray, origin: float, steps: _Spans, waits: _Spans) -> None:
        """Bring the figures up to date with this loader's ``rows`` (records in the order the loop made
        them; ``at``: their places in the tick's batch) and add their spans to ``steps`` and ``waits``."""
        ends = rows[:, 2]
        begin = 0
        for marker in np.flatnonzero(ends < 0).tolist():
            self._batches(rows[begin:marker], at[begin:marker], origin, steps, waits)
            started = float(rows[marker, 1])
            if ends[marker] == _STOPPED and self.pending_start is not None:
                # The call that ends an epoch closes the last step.
                self.step_times.append(started - self.pending_start)
                self.compute_total += started - self.last_end  # type: ignore[operator]
                steps.add(at[marker:marker + 1], np.array([self.pending_start - origin]),
                          np.array([started - origin]))
            self.pending_start = None
            if ends[marker] == _RESTARTED and self.next_plan is not None:
                (self.plan,), self.next_plan = self.next_plan, None
            begin = marker + 1
        self._batches(rows[begin:], at[begin:], origin, steps, waits)

    def _batches(self, rows: np.ndarray, at: np.ndarray, origin: float, steps: _Spans, waits: _Spans) -> None:
        """Records of batches returned, one after the other from one iterator: a step runs from the
        start of one next() to the start of the following one, the time between them is compute."""
        count = len(rows)
        if not count:
            return
        starts, ends, samples = rows[:, 1], rows[:, 2], rows[:, 3]
        if self.pending_start is None:
            self.epochs += 1  # the first batch of an iterator: an epoch that ran
            self.epoch_batches = 0
            if self.first_start is None:
                self.first_start = float(starts[0])
            step_starts, step_ends, step_at = starts[:-1], starts[1:], at[1:]
            compute = starts[1:] - ends[:-1]
        else:
            step_starts = np.concatenate(([self.pending_start], starts[:-1]))
            step_ends, step_at = starts, at
            compute = starts - np.concatenate(([float(self.last_end or 0.0)], ends[:-1]))
        if self.plan is not None:
            samples = self._planned(samples, self.plan)
        self.epoch_batches += count
        self.step_times.extend((step_ends - step_starts).tolist())
        self.compute_total = sum(compute.tolist(), self.compute_total)  # one by one, as the steps came
        wait = ends - starts
        wait_list = wait.tolist()
        self.wait_total = sum(wait_list, self.wait_total)
        self.wait_times.extend(wait_list)
        self.steps += count
        self.samples += int(samples.sum())
        self.last_batch_samples = int(samples[-1])
        self.pending_start, self.last_end = float(starts[-1]), float(ends[-1])
        steps.add(step_at, step_starts - origin, step_ends - origin)
        waits.add(at, starts - origin, ends - origin)

    def replan(self, loader: Any) -> None:
        """At an epoch's start (an iterator made or reused, before its first ``next()``): the plan again, as
        the dataset may have grown. A new one counts from the epoch's records on (:meth:`take`) once a read
        batch agrees with it."""
        if self.plan_trusted is not False:
            plan = batch_plan(loader)
            if plan != self.plan:
                self.planned = False
                self.next_plan = (plan,)

    def _planned(self, samples: np.ndarray, plan: tuple[int, int, bool]) -> np.ndarray:
        """The batches' samples, from the loader's batching where the loop's thread did not read them (-1): the
        k-th batch of an epoch holds ``batch_size`` samples, the last what is left (none such with
        ``drop_last``). If one read disagrees, the plan is no longer trusted and every batch is read again."""
        size, total, drop_last = plan
        index = self.epoch_batches + np.arange(len(samples))
        expected = np.full(len(samples), float(size)) if drop_last else np.clip(total - index * size, 0, size)
        read = samples >= 0
        if read.any() and self.plan_trusted is not False:
            if (samples[read] == expected[read]).all():
                self.plan_trusted = True
                self.planned = self.next_plan is None  # else from the next epoch's first agreeing read
            else:
                self.plan_trusted = self.planned = False
        return np.where(read, samples, expected)

    def rebuilt_as(self, loader: Any) -> bool:
        """``loader`` is this one built again (a loop that makes its DataLoader anew each epoch): the same
        dataset object and settings, and this one is gone or ran to its end."""
        dataset = None if self.dataset_ref is None else self.dataset_ref()
        if dataset is None or dataset is not getattr(loader, "dataset", None):
            return False
        if self.loader is not None and not self.exhausted:
            return False
        return self.settings == loader_settings(loader)


class _Spans:
    """The spans of one kind a tick's records make, put into the Trace in the order the loop made them."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, at: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        if len(at):
            self._parts.append((at, starts, ends))

    def into(self, trace: Any, kind: str) -> None:
        if not self._parts:
            return
        if len(self._parts) == 1:
            _, starts, ends = self._parts[0]
        else:
            order = np.argsort(np.concatenate([part[0] for part in self._parts]), kind="stable")
            starts = np.concatenate([part[1] for part in self._parts])[order]
            ends = np.concatenate([part[2] for part in self._parts])[order]
        add_span_arrays(trace, kind, starts, ends)


def add_span_arrays(trace: Any, kind: str, starts: np.ndarray, ends: np.ndarray) -> None:
    """``Trace.add_span_arrays``, or ``add_spans`` on a Trace-like sink without it (a child's span buffer)."""
    adder = getattr(trace, "add_span_arrays", None)
    if adder is not None:
        adder(kind, starts, ends)
    else:
        trace.add_spans(kind, list(zip(starts.tolist(), ends.tolist())))


class DataLoaderProbe:
    """Times every DataLoader ``next()`` during a watch and records spans into the Trace."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.installed = False
        self._by_iterator: weakref.WeakKeyDictionary[Any, LoaderStats] = weakref.WeakKeyDictionary()
        self._by_loader: dict[int, LoaderStats] = {}
        self.stats: list[LoaderStats] = []
        self._originals: dict[str, Callable[..., Any]] = {}  # DataLoader's own methods, to put back
        # loader -> where it was built (loaders built while the watch runs).
        self._built: weakref.WeakKeyDictionary[Any, origins.Origin] = weakref.WeakKeyDictionary()
        # RECORD numbers per next(), put in by the loop's thread, made into figures and spans by flush().
        self._records: list[float] = []
        self._flush_lock = threading.Lock()  # the sampler thread's ticks, and uninstall on the cell's
        # The loader whose next() returned last: an optimizer step that follows is fed by it.
        self.last: LoaderStats | None = None
        # Python's garbage collections: their time inside a next() is the program's, not the loader's.
        self.gc = GcPauses()

    # ---------------------------------------------------------------- patching

    def install(self) -> None:
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        if self.installed:
            return
        original_init = DataLoader.__init__
        original_iter = DataLoader.__iter__
        original_next = _BaseDataLoaderIter.__next__
        self._originals = {"init": original_init, "iter": original_iter, "next": original_next}
        probe = self
        push = self._records.extend  # one C call per record (a tuple): the sampler thread sees whole records
        clock = now
        run_delay = thread_run_delay
        thread_cpu = cpu_clock
        collate_clock = perf_counter  # a clock of its own: the trace's reads stay two per next()
        cached_ref: Any = _DEAD  # the iterator of the last next(), and its loader's stats
        cached_stats: Any = None

        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(loader, *args, **kwargs)
            with contextlib.suppress(Exception):  # never break the user's code
                probe._built[loader] = origins.stack_origin(sys._getframe(1), loader)

        def __iter__(loader: Any) -> Any:
            iterator = original_iter(loader)
            with contextlib.suppress(Exception):  # never break the user's loop
                probe._register(iterator, loader, sys._getframe(1))
            return iterator

        def sampled(iterator: Any, stats: LoaderStats) -> Any:
            """A next() whose wait is also timed in the thread's CPU time and run delay, and, where the
            loop's thread builds the batch (no workers), in the collate function."""
            workers = getattr(iterator, "_num_workers", 1)
            fetcher: Any = None if workers else getattr(iterator, "_dataset_fetcher", None)
            collate = getattr(fetcher, "collate_fn", None)
            collated = [0.0]
            if collate is not None:
                def timed(*args: Any, **kwargs: Any) -> Any:
                    begun = collate_clock()
                    try:
                        return collate(*args, **kwargs)
                    finally:
                        collated[0] += collate_clock() - begun
                fetcher.collate_fn = timed
            delay_started = run_delay()
            pauses = probe.gc
            thread = threading.get_ident()
            own_before = pauses.kept_cpu.get(thread, 0.0)
            cpu_started = thread_cpu()  # read last before the wait and first after it: only the wait between
            kept_before = pauses.kept
            started = clock()
            fetch_started = collate_clock()
            try:
                batch = original_next(iterator)
            except StopIteration:
                stats.stopped_at = stats.calls
                push((stats.slot, started, _STOPPED, 0))
                raise
            finally:
                if collate is not None:
                    fetcher.collate_fn = collate
            ended = clock()
            # The garbage collections in this wait are the loop's own time, as the flush takes them out of
            # its wait (_without_collections), and the CPU this thread spent in them is not the loader's.
            collected = pauses.kept - kept_before
            if collate is not None:
                stats.collate_timed += collate_clock() - fetch_started
                stats.collate_total += collated[0]
            cpu_ended = thread_cpu()
            delay_ended = run_delay()
            own = pauses.kept_cpu.get(thread, 0.0) - own_before
            stats.wait_cpu_total += max(0.0, cpu_ended - cpu_started - own)
            stats.wait_sampled += ended - started - collected
            if stats.wait_delay_total is not None:
                stats.wait_delay_total = (None if delay_ended is None or delay_started is None
                                          else stats.wait_delay_total + delay_ended - delay_started)
            stats.sampled_calls += 1
            stats.next_sampled = stats.calls + sample_stride(stats, stats.calls, started)
            stats.calls += 1
            probe.last = stats
            if stats.batch_device is None:
                stats.batch_device = batch_device(batch)
            push((stats.slot, started, ended, batch_samples(batch)))
            return batch

        def __next__(iterator: Any) -> Any:
            # The steady state, line by line as measured (benchmarks/probe_cost.py): the cached loader,
            # one modulo, two clock reads, the batch's first dimension read inline, one list extend.
            nonlocal cached_ref, cached_stats
            if cached_ref() is iterator:
                stats = cached_stats
            else:
                stats = probe._by_iterator.get(iterator)
                if stats is None:
                    stats = probe._register(iterator, None)
                cached_ref, cached_stats = _weak(iterator) or _DEAD, stats
            calls = stats.calls
            if calls >= stats.next_sampled:  # never call 0: warm-up, worker start
                return sampled(iterator, stats)
            started = clock()
            try:
                batch = original_next(iterator)
            except StopIteration:
                stats.stopped_at = calls
                push((stats.slot, started, _STOPPED, 0))
                raise
            ended = clock()
            stats.calls = calls + 1
            probe.last = stats
            if stats.planned:  # the loader's batching says (LoaderStats._planned): no read of the batch
                push((stats.slot, started, ended, -1))
                return batch
            kind = type(batch)
            if kind is tuple or kind is list:  # batch_samples' usual case, without its call or getattr's
                try:
                    shape = batch[0].shape
                except (AttributeError, IndexError):
                    samples = batch_samples(batch)
                else:
                    samples = shape[0] if shape else 1
            else:
                samples = batch_samples(batch)
            push((stats.slot, started, ended, samples))
            return batch

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        __iter__.__wrapped__ = original_iter  # type: ignore[attr-defined]
        __next__.__wrapped__ = original_next  # type: ignore[attr-defined]
        self._wrappers = {"init": __init__, "iter": __iter__, "next": __next__}
        DataLoader.__init__ = __init__  # type: ignore[method-assign,assignment]
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign,assignment]
        self.gc.install()
        self.installed = True

    def uninstall(self) -> None:
        """Put torch back exactly as it was (only our own wrappers are removed)."""
        if not self.installed:
            return
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self.gc.uninstall()

        if DataLoader.__dict__.get("__init__") is self._wrappers["init"]:
            DataLoader.__init__ = self._originals["init"]  # type: ignore[method-assign]
        if DataLoader.__dict__.get("__iter__") is self._wrappers["iter"]:
            DataLoader.__iter__ = self._originals["iter"]  # type: ignore[method-assign]
        if _BaseDataLoaderIter.__dict__.get("__next__") is self._wrappers["next"]:
            _BaseDataLoaderIter.__next__ = self._originals["next"]  # type: ignore[method-assign]
        self.installed = False
        self.flush()

    @property
    def queued(self) -> int:
        """Numbers the loop put in since the last flush (RECORD per ``next()``)."""
        return len(self._records)

    def flush(self) -> None:
        """Make figures and spans of the records the loop appended (the sampler thread calls this every tick)."""
        with self._flush_lock:
            records = self._records
            count = len(records)
            if not count:
                return
            chunk = records[:count]
            del records[:count]  # records put in meanwhile stay, whole, for the next flush
            rows = np.array(chunk, dtype=np.float64).reshape(-1, RECORD)
            self._without_collections(rows)
            origin = self.trace.start_clock
            steps, waits = _Spans(), _Spans()
            slots = rows[:, 0]
            first = slots[0]
            if (slots == first).all():  # one loader: the usual case
                self.stats[int(first)].take(rows, np.arange(len(rows)), origin, steps, waits)
            else:
                for slot in np.unique(slots).tolist():
                    at = np.flatnonzero(slots == slot)
                    self.stats[int(slot)].take(rows[at], at, origin, steps, waits)
            steps.into(self.trace, STEP_SPAN)
            waits.into(self.trace, DATA_WAIT_SPAN)

    def _without_collections(self, rows: np.ndarray) -> None:
        """End each wait earlier by the garbage collections inside it (gc_pauses): the loop then waited
        for its data for the rest, and the collection's time counts as the step's own, as it would have
        had the collection fallen due outside ``next()``."""
        if not self.gc.pauses:  # the usual flush: no collection of a millisecond or more is kept
            return
        ends = rows[:, 2]
        timed = ends >= 0  # not the records of an epoch's end or an iterator's start
        covered = self.gc.overlap(rows[timed, 1], ends[timed])
        if covered is None:
            return
        rows[timed, 2] -= covered
        slots = rows[timed, 0].astype(np.int64)
        for slot, seconds in enumerate(np.bincount(slots, weights=covered).tolist()):
            if seconds and slot < len(self.stats):
                self.stats[slot].gc_wait += seconds

    def finish(self, end: float) -> None:
        """Close each loader's step that was still open when the watch ended (a loop left by
        ``break`` or an exception): its work up to ``end`` counts as compute."""
        self.flush()
        for stats in self.stats:
            if stats.fetches_ahead and not stats.exhausted and stats.steps:
                # Left early: accelerate had fetched one batch ahead that the loop never took.
                stats.steps -= 1
                stats.samples -= stats.last_batch_samples
            if stats.pending_start is not None and stats.last_end is not None:
                stats.compute_total += max(0.0, end - stats.last_end)
                stats.step_times.append(end - stats.pending_start)
                self.trace.add_span(STEP_SPAN, stats.pending_start - self.trace.start_clock,
                                    end - self.trace.start_clock, {"open": True})
                stats.pending_start = None

    def _register(self, iterator: Any, loader: Any, caller: Any = None) -> LoaderStats:
        key = id(loader) if loader is not None else id(iterator)
        stats = self._by_loader.get(key)
        if stats is None or (loader is not None and stats.loader is not loader):
            rebuilt = next((s for s in self.stats if loader is not None and s.rebuilt_as(loader)), None)
            if rebuilt is not None:  # one loop whose loader is built anew each epoch: one LoaderStats
                rebuilt.loader_ref = weakref.ref(loader)
                rebuilt.replan(loader)
                self._by_loader[key] = rebuilt
                self._by_iterator[iterator] = rebuilt
                self._records.extend((rebuilt.slot, 0.0, _RESTARTED, 0.0))
                return rebuilt
            stats = self._by_loader[key] = LoaderStats(loader)
            stats.slot = len(self.stats)
            self.stats.append(stats)
            if loader is not None:
                stats.built = self._built.get(loader)
                stats.iterated = origins.stack_origin(caller) if caller is not None else None
        if loader is not None:
            stats.replan(loader)
        # A reused (persistent-workers) iterator starts a new epoch: no step spans across it.
        self._records.extend((stats.slot, 0.0, _RESTARTED, 0.0))
        self._by_iterator[iterator] = stats
        return stats

    def facts(self, names: Mapping[int, str]) -> list[LoaderFacts]:
        return [s.facts(names) for s in self.stats if s.steps]


def sample_stride(stats: LoaderStats, call: int, started: float) -> int:
    """How many next() calls after ``call`` (just sampled, begun at ``started``) the next sampled one comes:
    :data:`CPU_SAMPLE_EVERY` while the loop waits on its loader and too little of that was sampled, else as
    many as keep the sampled calls' cost under :data:`SAMPLE_COST_SHARE` of the loop's time."""
    first = stats.first_sampled
    if first is None:
        stats.first_sampled = (call, started)
        return CPU_SAMPLE_EVERY
    calls = call - first[0]
    step_s = (started - first[1]) / calls if calls > 0 else 0.0
    if step_s <= 0.0 or not stats.sampled_calls:
        return CPU_SAMPLE_EVERY
    waits = stats.wait_sampled / stats.sampled_calls >= SAMPLE_EVERY_WAIT_SHARE * step_s
    if waits and stats.sampled_calls < SAMPLED_WAITS_ENOUGH and stats.wait_sampled < SAMPLED_WAIT_ENOUGH_S:
        return CPU_SAMPLE_EVERY
    wanted = SAMPLED_CALL_COST_S / (SAMPLE_COST_SHARE * step_s)
    return int(min(MAX_SAMPLE_STRIDE, max(CPU_SAMPLE_EVERY, math.ceil(wanted))))


def _weak(value: Any) -> Any:
    """A weak reference to ``value``, or None (nothing, or a type that takes none)."""
    try:
        return None if value is None else weakref.ref(value)
    except TypeError:
        return None


class _Gone:
    pass


_DEAD = weakref.ref(_Gone())  # a reference that is already dead: no iterator is it


def batch_samples(batch: Any) -> int:
    """:func:`first_dim`, quick for the usual batch (a tuple or list whose first item is a tensor)."""
    kind = type(batch)
    if (kind is tuple or kind is list) and batch:
        shape = getattr(batch[0], "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 1
    return first_dim(batch)


def batch_plan(loader: Any) -> tuple[int, int, bool] | None:
    """(batch_size, samples an epoch, drop_last) where each batch's samples follow from the loader's own
    batching: torch's ``BatchSampler`` over a sampler whose length is the samples it yields, torch's default
    collation (a batch's first dimension is its samples), batches in order; else None."""
    from torch.utils.data import IterableDataset
    from torch.utils.data._utils.collate import default_collate
    from torch.utils.data.distributed import DistributedSampler
    from torch.utils.data.sampler import BatchSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    size = getattr(loader, "batch_size", None)
    if (type(batch_sampler) is not BatchSampler or size is None or batch_sampler.batch_size != size
            or getattr(loader, "collate_fn", None) is not default_collate
            or isinstance(getattr(loader, "dataset", None), IterableDataset)
            or not (_plain_sampler(sampler) or type(sampler) is DistributedSampler)
            or not getattr(loader, "in_order", True)):
        return None
    try:
        total = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    return int(size), int(total), bool(batch_sampler.drop_last)


def batch_device(batch: Any, depth: int = 0) -> str | None:
    """The device type ("cpu", "cuda") of a batch's first tensor (tuples, lists, dicts); None: no tensor."""
    device = getattr(batch, "device", None)
    if device is not None:
        return str(getattr(device, "type", device))
    if depth < 4:
        if isinstance(batch, (tuple, list)) and batch:
            return batch_device(batch[0], depth + 1)
        if isinstance(batch, Mapping) and batch:
            return batch_device(next(iter(batch.values())), depth + 1)
    return None


def first_dim(batch: Any, depth: int = 0) -> int:
    """Samples in a batch: the first dimension of its first tensor (tuples, lists, dicts)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if depth < 3:
        if isinstance(batch, (list, tuple)) and batch:
            return first_dim(batch[0], depth + 1)
        if isinstance(batch, Mapping) and batch:
            return first_dim(next(iter(batch.values())), depth + 1)
    return 0


def loader_settings(loader: Any) -> LoaderSettings:
    """The DataLoader's configuration as plain data (what a suggestion must keep or change)."""
    from torch.utils.data import IterableDataset, RandomSampler
    from torch.utils.data.sampler import BatchSampler

    dataset = loader.dataset
    try:
        dataset_len: int | None = len(dataset)
    except TypeError:
        dataset_len = None
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    custom_batch_sampler = batch_sampler is not None and type(batch_sampler) is not BatchSampler
    context = loader.multiprocessing_context
    iterable = isinstance(dataset, IterableDataset)
    settings = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "pin_memory": bool(loader.pin_memory),
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": bool(loader.persistent_workers),
        "multiprocessing_context": None if context is None else context.get_start_method(),
        "drop_last": bool(loader.drop_last),
        "timeout": loader.timeout,
        "shuffle": isinstance(sampler, RandomSampler),
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "custom_sampler": sampler is not None and not _plain_sampler(sampler),
        "custom_batch_sampler": custom_batch_sampler,
        # Built with batch_sampler= (accelerate and the HF Trainer do): batch_size is None.
        "batch_sampler_given": loader.batch_size is None and batch_sampler is not None,
        "generator": loader.generator is not None,
        "collate_fn": getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__),
        "default_collate": getattr(loader.collate_fn, "__name__", "") == "default_collate",
        "collate_code": (None if getattr(loader.collate_fn, "__name__", "") == "default_collate"
                         else collate_site(loader.collate_fn)),
        "dataset_type": type(dataset).__name__,
        "dataset_len": dataset_len,
        "iterable_dataset": iterable,
        "shards_by_worker": origins.shards_by_worker(dataset, loader.worker_init_fn) if iterable else None,
        "worker_init_fn": getattr(loader.worker_init_fn, "__name__", None),
        **origins.dataset_facts(dataset),
        "constructor": constructor_facts(loader),  # None for torch's DataLoader itself
    }
    # The batching a framework wrapped (accelerate's BatchSamplerShard keeps the original).
    inner = getattr(batch_sampler, "batch_sampler", batch_sampler)
    if settings["batch_sampler_given"] and type(inner) is BatchSampler:
        settings["inner_batching"] = {"batch_size": inner.batch_size, "drop_last": bool(inner.drop_last),
                                      "shuffle": isinstance(inner.sampler, RandomSampler),
                                      "plain_sampler": _plain_sampler(inner.sampler)}
    return cast(LoaderSettings, settings)  # dataset_facts' keys are spread in


def collate_site(collate: Any) -> CodeSite | None:
    """Where a collate function is defined (a collator object's ``__call__``), named as the stack samples
    name it (``probes.stack.code_site``); None for C code."""
    from gpuwidget.probes.stack import code_site

    if not (inspect.isfunction(collate) or inspect.ismethod(collate)):
        collate = next((kind.__dict__["__call__"] for kind in type(collate).__mro__ if "__call__" in kind.__dict__),
                       None)
    code = getattr(inspect.unwrap(collate), "__code__", None) if collate is not None else None
    return code_site(code, code.co_firstlineno) if code is not None else None


def _plain_sampler(sampler: Any) -> bool:
    """A sampler that ``shuffle=True`` or ``shuffle=False`` rebuilds exactly."""
    from torch.utils.data import RandomSampler, SequentialSampler

    if type(sampler) is SequentialSampler:
        return True
    return (isinstance(sampler, RandomSampler) and type(sampler).__module__.startswith(("torch.", "accelerate."))
            and not sampler.replacement and getattr(sampler, "_num_samples", None) is None
            and getattr(sampler, "generator", None) is None)


def loader_kwargs(loader: Any, change: LoaderChange | None = None) -> dict[str, Any]:
    """Keyword arguments that rebuild ``loader`` (same dataset, sampling and collation),
    with ``change`` applied and made valid (no ``prefetch_factor`` or ``persistent_workers``
    without workers, as torch requires)."""
    from torch.utils.data import IterableDataset
    from torch.utils.data.sampler import BatchSampler

    kwargs: dict[str, Any] = {"dataset": loader.dataset}
    batch_sampler = loader.batch_sampler
    if isinstance(loader.dataset, IterableDataset):
        # An iterable dataset takes no sampler: torch fills in its own infinite one.
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif batch_sampler is not None and type(batch_sampler) is BatchSampler and loader.batch_size is not None:
        kwargs.update(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
    elif batch_sampler is not None:
        kwargs["batch_sampler"] = batch_sampler
    else:
        kwargs.update(batch_size=None, sampler=loader.sampler)
    kwargs.update(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if change:
        kwargs.update(change)
    return valid_loader_kwargs(kwargs)


def valid_loader_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop settings torch rejects without worker processes."""
    if int(kwargs.get("num_workers") or 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
        kwargs.pop("multiprocessing_context", None)
    return kwargs
