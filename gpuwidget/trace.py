"""Trace: the one data model, timestamped metric columns plus spans, bounded in memory.

Every consumer (live plot, advisor, export, server stream) reads a Trace; nothing else
talks to NVML or psutil. Times are seconds since the trace started, on the monotonic
clock of :func:`gpuwidget.clock.now`; ``start_wall`` anchors them to the epoch.

Memory stays bounded however long a run lasts:

* the newest samples are kept as they were read, in a *recent* block of
  ``recent_capacity`` rows;
* when the block is full its older half is folded into an *archive* of fixed-width
  time buckets that keep each column's min, max, mean and sample count, so spikes
  survive and means stay exact;
* when the archive is full, its bucket width doubles and neighbouring buckets merge.

With the defaults (4096 + 4096 rows) a 24-hour run at 10 Hz with 8 GPUs and a
16-core host (about 160 columns) stays near 20 MB, and the archive resolves
about 40 s per bucket at the end of it. Whole-run statistics (count, mean, min,
max, last) are kept exactly in running accumulators, independent of
downsampling.

Spans are kept per kind in columns (:class:`_SpanRing`): the newest ``span_capacity`` start and
end times in two float arrays used as a ring, and their attrs in an object column that only a
kind with attrs has. The probes hand in a tick's spans as arrays, so taking them in is a few
array copies (:meth:`Trace.add_span_arrays`); tuples and :class:`Span` objects are made only
for the readers that ask for them.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from gpuwidget.clock import now as clock_now
from gpuwidget.clock import wall_time

DEFAULT_RECENT_CAPACITY = 4096
DEFAULT_ARCHIVE_CAPACITY = 4096
DEFAULT_BUCKET_WIDTH_S = 1.0
DEFAULT_SPAN_CAPACITY = 20_000
# A kind's span columns start this long and double up to the capacity (most kinds hold few spans).
_FIRST_SPAN_SLOTS = 256
_INITIAL_COLUMN_SLOTS = 32
# Rows the recent block and the archive hold at first; they double as rows come, up to their capacities.
# Allocated whole, a Trace's blocks with a few hundred columns (eight GPUs) took ~50 MB, and filling them
# held the GIL for ~0.1 s at a watch's first tick (BENCHMARKS.md, section 20h).
_INITIAL_ROWS = 16


@dataclass(frozen=True)
class Span:
    """An interval of interest: a step, a wait for data, a checkpoint."""

    kind: str
    start: float
    end: float
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "start": self.start, "end": self.end}
        if self.attrs:
            out["attrs"] = dict(self.attrs)
        return out


@dataclass(frozen=True)
class ColumnStats:
    """Whole-run statistics of one column (exact, not affected by downsampling)."""

    count: int
    mean: float
    min: float
    max: float
    last: float


@dataclass(frozen=True)
class SpanStats:
    """Whole-run statistics of one span kind, including spans no longer kept."""

    count: int
    total: float
    min: float
    max: float


@dataclass
class Frame:
    """A time slice of some columns: times plus, per column, mean, min and max.

    Rows from the recent block have ``min == max == mean``; archive rows carry the
    envelope of the samples they merged. Missing readings are NaN.
    """

    t: np.ndarray
    mean: dict[str, np.ndarray]
    min: dict[str, np.ndarray]
    max: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, column: str) -> np.ndarray:
        return self.mean[column]


class _Accumulator:
    """Running count/sum/min/max/last per column, NaN-aware, vectorised over a row."""

    def __init__(self, slots: int) -> None:
        self.count = np.zeros(slots, dtype=np.int64)
        self.total = np.zeros(slots)
        self.min = np.full(slots, np.inf)
        self.max = np.full(slots, -np.inf)
        self.last = np.full(slots, np.nan)

    def grow(self, slots: int) -> None:
        pad = slots - len(self.count)
        self.count = np.concatenate([self.count, np.zeros(pad, dtype=np.int64)])
        self.total = np.concatenate([self.total, np.zeros(pad)])
        self.min = np.concatenate([self.min, np.full(pad, np.inf)])
        self.max = np.concatenate([self.max, np.full(pad, -np.inf)])
        self.last = np.concatenate([self.last, np.full(pad, np.nan)])

    def add(self, row: np.ndarray) -> None:
        present = ~np.isnan(row)
        self.count += present
        np.add(self.total, row, out=self.total, where=present)
        np.fmin(self.min, row, out=self.min)
        np.fmax(self.max, row, out=self.max)
        np.copyto(self.last, row, where=present)


_NO_TIMES = np.empty(0)
_NO_TIMES.flags.writeable = False


class _SpanRing:
    """The newest ``capacity`` spans of one kind, oldest first: start and end columns written as a
    ring, and an attrs column (objects) made at the first span of the kind that has attrs."""

    __slots__ = ("attrs", "capacity", "end", "start", "written")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        size = min(capacity, _FIRST_SPAN_SLOTS)
        self.start = np.empty(size)
        self.end = np.empty(size)
        self.attrs: np.ndarray | None = None
        self.written = 0  # spans ever put in: the next one goes to written % capacity

    def __len__(self) -> int:
        return min(self.written, self.capacity)

    def nbytes(self) -> int:
        return self.start.nbytes + self.end.nbytes + (0 if self.attrs is None else self.attrs.nbytes)

    def last_end(self) -> float | None:
        return float(self.end[(self.written - 1) % self.capacity]) if self.written else None

    def extend(self, starts: np.ndarray, ends: np.ndarray, attrs: Any) -> None:
        """Put in spans, in order; ``attrs``: None, one mapping shared by all, or an object array of one each."""
        n = len(starts)
        capacity = self.capacity
        if n > capacity:  # only the newest fit
            self.written += n - capacity
            starts, ends, n = starts[-capacity:], ends[-capacity:], capacity
            if isinstance(attrs, np.ndarray):
                attrs = attrs[-capacity:]
        self._room(n, attrs is not None)
        position = self.written % capacity
        first = min(n, capacity - position)
        self.start[position:position + first] = starts[:first]
        self.end[position:position + first] = ends[:first]
        if first < n:  # wraps round to the oldest
            self.start[:n - first] = starts[first:]
            self.end[:n - first] = ends[first:]
        if self.attrs is not None:
            shared = not isinstance(attrs, np.ndarray)  # None or one mapping: the same object in each slot
            self.attrs[position:position + first] = attrs if shared else attrs[:first]
            if first < n:
                self.attrs[:n - first] = attrs if shared else attrs[first:]
        self.written += n

    def append(self, start: float, end: float, attrs: Mapping[str, Any] | None) -> None:
        """One span, without making arrays of it (``Trace.add_span``)."""
        self._room(1, attrs is not None)
        position = self.written % self.capacity
        self.start[position] = start
        self.end[position] = end
        if self.attrs is not None:
            self.attrs[position] = attrs
        self.written += 1

    def newest(self, count: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Copies of the newest ``count`` spans (every kept one by default), oldest first."""
        kept = len(self)
        count = kept if count is None else max(0, min(count, kept))
        window: Any
        if self.written <= self.capacity:  # not wrapped yet: one slice
            window = slice(kept - count, kept)
        else:
            window = np.arange(self.written - count, self.written) % self.capacity
        attrs = None if self.attrs is None else self.attrs[window].copy()
        return self.start[window].copy(), self.end[window].copy(), attrs

    def _room(self, n: int, with_attrs: bool) -> None:
        """Grow the columns (before the ring is full) to take ``n`` more; make the attrs column if needed."""
        size = len(self.start)
        if self.written + n > size and size < self.capacity:
            size = min(self.capacity, max(self.written + n, 2 * size))
            kept = self.written  # not wrapped while growing: the spans are the first `written` slots
            for name in ("start", "end"):
                grown = np.empty(size)
                grown[:kept] = getattr(self, name)[:kept]
                setattr(self, name, grown)
            if self.attrs is not None:
                attrs = np.full(size, None, dtype=object)
                attrs[:kept] = self.attrs[:kept]
                self.attrs = attrs
        if with_attrs and self.attrs is None:
            self.attrs = np.full(size, None, dtype=object)


def _with_rows(block: np.ndarray, size: int, kept: int, fill: float) -> np.ndarray:
    """``block`` with ``size`` rows: its first ``kept`` rows, the rest ``fill``."""
    bigger = np.full((size, *block.shape[1:]), fill, dtype=block.dtype)
    bigger[:kept] = block[:kept]
    return bigger


class Trace:
    """Timestamped metric columns and spans for one watched run (or a server's window)."""

    def __init__(
        self,
        *,
        recent_capacity: int = DEFAULT_RECENT_CAPACITY,
        archive_capacity: int = DEFAULT_ARCHIVE_CAPACITY,
        bucket_width_s: float = DEFAULT_BUCKET_WIDTH_S,
        span_capacity: int = DEFAULT_SPAN_CAPACITY,
        start_wall: float | None = None,
        start_clock: float | None = None,
    ) -> None:
        if recent_capacity < 4 or archive_capacity < 4:
            raise ValueError("recent_capacity and archive_capacity must be at least 4")
        if bucket_width_s <= 0:
            raise ValueError("bucket_width_s must be positive")
        self.start_clock = clock_now() if start_clock is None else start_clock
        self.start_wall = wall_time() if start_wall is None else start_wall
        self.meta: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._columns: dict[str, int] = {}
        self._slots = _INITIAL_COLUMN_SLOTS
        # Recent block: raw rows.
        self._recent_capacity = recent_capacity
        rows = min(recent_capacity, _INITIAL_ROWS)
        self._recent_t = np.empty(rows)
        self._recent_v = np.full((rows, self._slots), np.nan)
        self._recent_n = 0
        # Archive: fixed-width buckets with a min/max/mean/count envelope per column.
        self._archive_capacity = archive_capacity
        self._bucket_width = bucket_width_s
        rows = min(archive_capacity, _INITIAL_ROWS)
        self._arch_t = np.empty(rows)  # bucket start time
        self._arch_t_end = np.empty(rows)  # time of the last sample merged
        self._arch_mean = np.full((rows, self._slots), np.nan, dtype=np.float32)
        self._arch_min = np.full((rows, self._slots), np.nan, dtype=np.float32)
        self._arch_max = np.full((rows, self._slots), np.nan, dtype=np.float32)
        self._arch_count = np.zeros((rows, self._slots), dtype=np.uint32)
        self._arch_n = 0
        self._stats = _Accumulator(self._slots)
        self._rows_total = 0
        self._version = 0
        # Spans: the newest `span_capacity` per kind, plus whole-run stats per kind.
        self._span_capacity = span_capacity
        self._spans: dict[str, _SpanRing] = {}
        self._span_stats: dict[str, list[float]] = {}  # kind -> [count, total, min, max]

    # ------------------------------------------------------------------ writing

    def now(self) -> float:
        """Seconds since the trace started, on the trace's clock."""
        return clock_now() - self.start_clock

    def append(self, t: float, values: Mapping[str, float]) -> None:
        """Record one sample row at time ``t`` (seconds since start); absent keys stay NaN."""
        with self._lock:
            row_index = self._recent_n
            if row_index == self._recent_capacity:
                self._fold_recent()
                row_index = self._recent_n
            columns = self._columns
            if len(columns) + len(values) > self._slots and any(name not in columns for name in values):
                # Make room for every new column at once (one copy, not one per doubling).
                needed = len(columns) + sum(name not in columns for name in values)
                self._grow_columns(1 << (needed - 1).bit_length())
            self._grow_recent(row_index + 1)
            row = self._recent_v[row_index]
            row[:] = np.nan
            for name, value in values.items():
                index = columns.get(name)
                if index is None:
                    index = self._add_column(name)
                    row = self._recent_v[row_index]
                row[index] = value
            self._recent_t[row_index] = t
            self._recent_n = row_index + 1
            self._stats.add(row)
            self._rows_total += 1
            self._version += 1

    def add_span(self, kind: str, start: float, end: float, attrs: Mapping[str, Any] | None = None) -> None:
        """Record an interval."""
        duration = end - start
        with self._lock:
            ring, stats = self._span_kind(kind)
            ring.append(start, end, attrs)
            stats[1] = stats[1] + duration
            stats[2] = min(stats[2], duration)
            stats[3] = max(stats[3], duration)
            stats[0] += 1
            self._version += 1

    def add_spans(self, kind: str, intervals: list[tuple[float, float]],
                  attrs: Mapping[str, Any] | None = None) -> None:
        """Record many intervals of one kind under one lock (probes buffer them per tick); ``attrs``
        (e.g. a child process's ``{"pid": ..., "rank": ...}``) is shared by all of them."""
        if not intervals:
            return
        pairs = np.array(intervals, dtype=float).reshape(-1, 2)
        self._add_arrays(kind, pairs[:, 0], pairs[:, 1], attrs)

    def add_span_arrays(self, kind: str, starts: np.ndarray, ends: np.ndarray) -> None:
        """Record many intervals of one kind given as two arrays of start and end times, in order: the
        same spans and whole-run figures as :meth:`add_spans`, taken in as array copies (the probes'
        batch of a tick on a fast loop is thousands of spans, and the sampler thread holds the GIL meanwhile)."""
        if len(starts):
            self._add_arrays(kind, np.asarray(starts, dtype=float), np.asarray(ends, dtype=float), None)

    def _add_arrays(self, kind: str, starts: np.ndarray, ends: np.ndarray, attrs: Any) -> None:
        durations = ends - starts
        with self._lock:
            ring, stats = self._span_kind(kind)
            ring.extend(starts, ends, attrs)
            # Summed one by one, in order, as the spans came (add.accumulate is sequential): the
            # same total however the spans were batched.
            stats[1] = float(np.add.accumulate(np.concatenate(([stats[1]], durations)))[-1])
            stats[2] = min(stats[2], float(durations.min()))
            stats[3] = max(stats[3], float(durations.max()))
            stats[0] += len(durations)
            self._version += 1

    def _span_kind(self, kind: str) -> tuple[_SpanRing, list[float]]:
        """The columns and whole-run figures of a kind, made at its first span; under the lock."""
        ring = self._spans.get(kind)
        if ring is None:
            ring = self._spans[kind] = _SpanRing(self._span_capacity)
            self._span_stats[kind] = [0, 0.0, math.inf, -math.inf]
        return ring, self._span_stats[kind]

    def _add_column(self, name: str) -> int:
        index = len(self._columns)
        if index >= self._slots:
            self._grow_columns(self._slots * 2)
        self._columns[name] = index
        return index

    def _grow_columns(self, slots: int) -> None:
        pad = slots - self._slots

        def widen(block: np.ndarray, fill: float) -> np.ndarray:
            extra = np.full((block.shape[0], pad), fill, dtype=block.dtype)
            return np.concatenate([block, extra], axis=1)

        self._recent_v = widen(self._recent_v, np.nan)
        self._arch_mean = widen(self._arch_mean, np.nan)
        self._arch_min = widen(self._arch_min, np.nan)
        self._arch_max = widen(self._arch_max, np.nan)
        self._arch_count = widen(self._arch_count, 0)
        self._stats.grow(slots)
        self._slots = slots

    def _grow_recent(self, rows: int) -> None:
        """Room for ``rows`` rows in the recent block (doubling, up to its capacity)."""
        if rows > len(self._recent_t):
            size = min(self._recent_capacity, max(rows, 2 * len(self._recent_t)))
            kept = self._recent_n
            self._recent_t = _with_rows(self._recent_t, size, kept, 0.0)
            self._recent_v = _with_rows(self._recent_v, size, kept, np.nan)

    def _grow_archive(self, rows: int) -> None:
        """Room for ``rows`` buckets in the archive (doubling, up to its capacity)."""
        if rows > len(self._arch_t):
            size = min(self._archive_capacity, max(rows, 2 * len(self._arch_t)))
            kept = self._arch_n
            self._arch_t = _with_rows(self._arch_t, size, kept, 0.0)
            self._arch_t_end = _with_rows(self._arch_t_end, size, kept, 0.0)
            self._arch_mean = _with_rows(self._arch_mean, size, kept, np.nan)
            self._arch_min = _with_rows(self._arch_min, size, kept, np.nan)
            self._arch_max = _with_rows(self._arch_max, size, kept, np.nan)
            self._arch_count = _with_rows(self._arch_count, size, kept, 0)

    def _fold_recent(self) -> None:
        """Move the older half of the recent block into the archive."""
        half = self._recent_n // 2
        t = self._recent_t[:half]
        v = self._recent_v[:half]
        present = ~np.isnan(v)
        self._merge_into_archive(
            t, t, np.where(present, v, 0.0), v, v, present.astype(np.uint32)
        )
        rest = self._recent_n - half
        self._recent_t[:rest] = self._recent_t[half : self._recent_n]
        self._recent_v[:rest] = self._recent_v[half : self._recent_n]
        self._recent_n = rest

    def _merge_into_archive(
        self,
        t_start: np.ndarray,
        t_end: np.ndarray,
        total: np.ndarray,
        vmin: np.ndarray,
        vmax: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """Append rows (already time-ordered) into the archive's buckets, merging by bucket."""
        # Put the archive's last bucket in front so a bucket spanning two folds merges.
        if self._arch_n:
            last = self._arch_n - 1
            lc = self._arch_count[last]
            t_start = np.concatenate([[self._arch_t[last]], t_start])
            t_end = np.concatenate([[self._arch_t_end[last]], t_end])
            total = np.concatenate([np.nan_to_num(self._arch_mean[last] * lc)[None, :], total])
            vmin = np.concatenate([self._arch_min[last][None, :], vmin])
            vmax = np.concatenate([self._arch_max[last][None, :], vmax])
            count = np.concatenate([lc[None, :], count])
            self._arch_n = last
        width = self._bucket_width
        bucket = np.floor(t_start / width)
        starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
        with np.errstate(invalid="ignore", divide="ignore"):
            merged_count = np.add.reduceat(count, starts, axis=0)
            merged_mean = np.add.reduceat(total, starts, axis=0) / merged_count
            merged_min = np.fmin.reduceat(vmin, starts, axis=0)
            merged_max = np.fmax.reduceat(vmax, starts, axis=0)
        merged_mean[merged_count == 0] = np.nan
        rows = len(starts)
        if self._arch_n + rows > self._archive_capacity:
            self._coarsen_archive()
            # Re-merge at the new width (recursion ends: width doubles each time).
            self._merge_into_archive(
                bucket[starts] * width,
                t_end[np.r_[starts[1:] - 1, len(t_end) - 1]],
                np.nan_to_num(merged_mean * merged_count),
                merged_min,
                merged_max,
                merged_count.astype(np.uint32),
            )
            return
        end_index = np.r_[starts[1:] - 1, len(t_end) - 1]
        self._grow_archive(self._arch_n + rows)
        sl = slice(self._arch_n, self._arch_n + rows)
        self._arch_t[sl] = bucket[starts] * width
        self._arch_t_end[sl] = t_end[end_index]
        self._arch_mean[sl] = merged_mean
        self._arch_min[sl] = merged_min
        self._arch_max[sl] = merged_max
        self._arch_count[sl] = merged_count
        self._arch_n += rows

    def _coarsen_archive(self) -> None:
        """Double the bucket width and merge neighbouring buckets in place.

        Works on the float32 blocks directly (one weighted-sum temporary the size of the
        archive's means), so a long run's memory does not spike when the archive fills.
        """
        n = self._arch_n
        self._bucket_width *= 2
        if not n:
            return
        bucket = np.floor(self._arch_t[:n] / self._bucket_width)
        starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
        ends = np.r_[starts[1:] - 1, n - 1]
        m = len(starts)
        counts = self._arch_count[:n]
        weighted = self._arch_mean[:n] * counts  # float32 temporary
        np.nan_to_num(weighted, copy=False)
        with np.errstate(invalid="ignore", divide="ignore"):
            merged_count = np.add.reduceat(counts, starts, axis=0)
            merged_mean = np.add.reduceat(weighted, starts, axis=0) / merged_count
            merged_min = np.fmin.reduceat(self._arch_min[:n], starts, axis=0)
            merged_max = np.fmax.reduceat(self._arch_max[:n], starts, axis=0)
        del weighted
        merged_mean[merged_count == 0] = np.nan
        self._arch_t[:m] = bucket[starts] * self._bucket_width
        self._arch_t_end[:m] = self._arch_t_end[ends]
        self._arch_mean[:m] = merged_mean
        self._arch_min[:m] = merged_min
        self._arch_max[:m] = merged_max
        self._arch_count[:m] = merged_count
        self._arch_mean[m:n] = np.nan
        self._arch_min[m:n] = np.nan
        self._arch_max[m:n] = np.nan
        self._arch_count[m:n] = 0
        self._arch_n = m

    # ------------------------------------------------------------------ reading

    @property
    def columns(self) -> list[str]:
        with self._lock:
            return list(self._columns)

    @property
    def version(self) -> int:
        """Increments on every write; lets readers skip work when nothing changed."""
        return self._version

    @property
    def rows_total(self) -> int:
        """How many sample rows were ever appended (before any downsampling)."""
        return self._rows_total

    @property
    def bucket_width_s(self) -> float:
        return self._bucket_width

    def __len__(self) -> int:
        """Rows held now (archive buckets plus recent samples)."""
        return self._arch_n + self._recent_n

    def stats(self, column: str) -> ColumnStats | None:
        """Exact whole-run statistics of a column, or None if it never had a value."""
        with self._lock:
            index = self._columns.get(column)
            if index is None or self._stats.count[index] == 0:
                return None
            s = self._stats
            n = int(s.count[index])
            return ColumnStats(n, float(s.total[index] / n), float(s.min[index]), float(s.max[index]),
                               float(s.last[index]))

    def last(self) -> tuple[float, dict[str, float]] | None:
        """The newest row as (t, {column: value}) without NaNs, or None if empty."""
        with self._lock:
            if self._recent_n == 0:
                return None
            i = self._recent_n - 1
            row = self._recent_v[i]
            return float(self._recent_t[i]), {
                name: float(row[j]) for name, j in self._columns.items() if not math.isnan(row[j])
            }

    def recent_since(self, t: float, columns: Iterable[str] | None = None) -> Frame:
        """Raw rows newer than ``t`` (for live views that stream increments)."""
        with self._lock:
            n = self._recent_n
            start = int(np.searchsorted(self._recent_t[:n], t, side="right"))
            names = self._select(columns)
            times = self._recent_t[start:n].copy()
            values = {name: self._recent_v[start:n, self._columns[name]].copy()
                      for name in names if name in self._columns}
        for name in names:
            values.setdefault(name, np.full(len(times), np.nan))
        return Frame(times, values, values, values)

    def window(self, t0: float | None = None, t1: float | None = None,
               columns: Iterable[str] | None = None) -> Frame:
        """All rows with ``t0 <= t <= t1`` (archive buckets by their start time), oldest first."""
        lo = -math.inf if t0 is None else t0
        hi = math.inf if t1 is None else t1
        with self._lock:
            names = self._select(columns)
            an, rn = self._arch_n, self._recent_n
            a0 = int(np.searchsorted(self._arch_t[:an], lo, side="left"))
            a1 = int(np.searchsorted(self._arch_t[:an], hi, side="right"))
            r0 = int(np.searchsorted(self._recent_t[:rn], lo, side="left"))
            r1 = int(np.searchsorted(self._recent_t[:rn], hi, side="right"))
            t = np.concatenate([self._arch_t[a0:a1], self._recent_t[r0:r1]])
            mean: dict[str, np.ndarray] = {}
            vmin: dict[str, np.ndarray] = {}
            vmax: dict[str, np.ndarray] = {}
            for name in names:
                j = self._columns.get(name)
                if j is None:
                    empty = np.full(len(t), np.nan)
                    mean[name] = vmin[name] = vmax[name] = empty
                    continue
                raw = self._recent_v[r0:r1, j]
                mean[name] = np.concatenate([self._arch_mean[a0:a1, j], raw])
                vmin[name] = np.concatenate([self._arch_min[a0:a1, j], raw])
                vmax[name] = np.concatenate([self._arch_max[a0:a1, j], raw])
        return Frame(t, mean, vmin, vmax)

    def plot_view(self, columns: Iterable[str], max_points: int = 2000,
                  t0: float | None = None, t1: float | None = None) -> Frame:
        """A window reduced to at most ``max_points`` rows, keeping every spike.

        Rows are grouped into ``max_points // 2`` buckets; each bucket contributes its
        minimum and its maximum (the M4 idea, without first/last), so a one-sample
        spike is still drawn at full height.
        """
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        frame = self.window(t0, t1, columns)
        n = len(frame)
        if n <= max_points:
            return frame
        buckets = max_points // 2
        edges = (np.arange(buckets) * n) // buckets
        t_start = frame.t[edges]
        t_end = np.r_[frame.t[edges[1:] - 1], frame.t[-1]]
        t = np.empty(2 * buckets)
        t[0::2] = t_start
        t[1::2] = (t_start + t_end) / 2
        mean: dict[str, np.ndarray] = {}
        vmin: dict[str, np.ndarray] = {}
        vmax: dict[str, np.ndarray] = {}
        with np.errstate(invalid="ignore"):
            for name in frame.mean:
                lo = np.fmin.reduceat(frame.min[name], edges)
                hi = np.fmax.reduceat(frame.max[name], edges)
                # Draw the min first where it came first, so the line does not zigzag backwards.
                min_first = _argfirst(frame.min[name], lo, edges, n) <= _argfirst(frame.max[name], hi, edges, n)
                out = np.empty(2 * buckets)
                out[0::2] = np.where(min_first, lo, hi)
                out[1::2] = np.where(min_first, hi, lo)
                mean[name] = out
                vmin[name] = np.repeat(lo, 2)
                vmax[name] = np.repeat(hi, 2)
        return Frame(t, mean, vmin, vmax)

    def spans(self, kind: str | None = None, t0: float | None = None,
              t1: float | None = None) -> list[Span]:
        """Kept spans (newest ``span_capacity`` per kind) overlapping [t0, t1], by start time."""
        lo = -math.inf if t0 is None else t0
        hi = math.inf if t1 is None else t1
        with self._lock:
            kinds = [kind] if kind is not None else list(self._spans)
            raw = [(k, ring.newest()) for k in kinds if (ring := self._spans.get(k)) is not None]
        out: list[Span] = []
        for k, (starts, ends, attrs) in raw:
            inside = (ends >= lo) & (starts <= hi)
            if not inside.all():
                starts, ends = starts[inside], ends[inside]
                attrs = None if attrs is None else attrs[inside]
            out.extend(Span(k, s, e, a or {}) for s, e, a in _rows(starts, ends, attrs))
        out.sort(key=lambda span: span.start)
        return out

    def spans_since(self, kind: str, seen: int) -> tuple[list[tuple[float, float, Mapping[str, Any] | None]], int]:
        """Spans of ``kind`` recorded after the first ``seen`` of them, in the order recorded, as
        ``(start, end, attrs)``; and how many were ever recorded, the ``seen`` of the next call.

        For readers that take spans in as they come (the live views' per-rank figures): the cost
        is that of the new spans, not of all the kept ones. Spans that left the kept window before
        a call are not returned.
        """
        starts, ends, attrs, total = self.span_arrays_since(kind, seen)
        return list(_rows(starts, ends, attrs)), total

    def span_arrays_since(self, kind: str, seen: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """:meth:`spans_since` as arrays, ``(starts, ends, attrs or None, total)``: for a reader that looks
        up a few times among thousands of new spans a tick (the stack sampler), with no object per span."""
        with self._lock:
            stats = self._span_stats.get(kind)
            if stats is None:
                return _NO_TIMES, _NO_TIMES, None, seen
            total = int(stats[0])
            starts, ends, attrs = self._spans[kind].newest(total - seen)
        return starts, ends, attrs, total

    def span_kinds(self) -> list[str]:
        """The kinds of spans recorded (``step``, ``loader.wait``, ...)."""
        with self._lock:
            return list(self._spans)

    def span_stats(self, kind: str) -> SpanStats | None:
        """Whole-run count and durations of a span kind, including spans no longer kept."""
        with self._lock:
            stats = self._span_stats.get(kind)
            if stats is None:
                return None
            return SpanStats(int(stats[0]), stats[1], stats[2], stats[3])

    def span_durations(self, kind: str) -> np.ndarray:
        """Durations of the kept spans of one kind, oldest first."""
        with self._lock:
            ring = self._spans.get(kind)
            if ring is None:
                return np.empty(0)
            starts, ends, _ = ring.newest()
        return ends - starts

    @property
    def duration(self) -> float:
        """Time from the trace's start to its newest sample or span end."""
        with self._lock:
            ends = [0.0]
            if self._recent_n:
                ends.append(float(self._recent_t[self._recent_n - 1]))
            for ring in self._spans.values():
                last = ring.last_end()
                if last is not None:
                    ends.append(last)
            return max(ends)

    def nbytes(self) -> int:
        """Memory held by the numeric blocks and the span columns (not the attrs mappings themselves)."""
        blocks = (self._recent_t, self._recent_v, self._arch_t, self._arch_t_end, self._arch_mean,
                  self._arch_min, self._arch_max, self._arch_count)
        return sum(b.nbytes for b in blocks) + sum(ring.nbytes() for ring in self._spans.values())

    def _select(self, columns: Iterable[str] | None) -> list[str]:
        return list(self._columns) if columns is None else list(columns)

    # ------------------------------------------------------------- serialising

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: every kept row and span, whole-run statistics, metadata."""
        frame = self.window()
        with self._lock:
            archive_rows = self._arch_n
            stats = {
                name: {"count": int(self._stats.count[j]), "total": float(self._stats.total[j]),
                       "min": finite_or_none(self._stats.min[j]), "max": finite_or_none(self._stats.max[j]),
                       "last": finite_or_none(self._stats.last[j])}
                for name, j in self._columns.items()
            }
            arch_end = self._arch_t_end[:archive_rows].tolist()
            arch_count = {name: self._arch_count[:archive_rows, j].tolist()
                          for name, j in self._columns.items()}
            span_stats = {k: list(v) for k, v in self._span_stats.items()}
            rows_total = self._rows_total
            bucket_width = self._bucket_width
        return {
            "format": "gpuwidget.trace/1",
            "start_wall": self.start_wall,
            "meta": self.meta,
            "bucket_width_s": bucket_width,
            "rows_total": rows_total,
            "archive_rows": archive_rows,
            "archive_t_end": arch_end,
            "archive_count": arch_count,
            "t": frame.t.tolist(),
            "mean": {k: finite_list(v) for k, v in frame.mean.items()},
            "min": {k: finite_list(v[:archive_rows]) for k, v in frame.min.items()},
            "max": {k: finite_list(v[:archive_rows]) for k, v in frame.max.items()},
            "stats": stats,
            "spans": [s.to_dict() for s in self.spans()],
            "span_stats": {k: [v[0], v[1], finite_or_none(v[2]), finite_or_none(v[3])] for k, v in span_stats.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **kwargs: Any) -> Trace:
        """Rebuild a Trace written by :meth:`to_dict`."""
        if data.get("format") != "gpuwidget.trace/1":
            raise ValueError(f"not a gpuwidget trace (format={data.get('format')!r})")
        t = np.asarray(data["t"], dtype=float)
        archive_rows = int(data["archive_rows"])
        recent_rows = len(t) - archive_rows
        kwargs.setdefault("recent_capacity", max(DEFAULT_RECENT_CAPACITY, recent_rows + 1))
        kwargs.setdefault("archive_capacity", max(DEFAULT_ARCHIVE_CAPACITY, archive_rows + 1))
        kwargs.setdefault("bucket_width_s", float(data["bucket_width_s"]))
        trace = cls(start_wall=float(data["start_wall"]), start_clock=0.0, **kwargs)
        trace.meta = dict(data.get("meta") or {})
        names = list(data["mean"])
        for name in names:
            trace._add_column(name)
        mean = {k: _from_json_list(v) for k, v in data["mean"].items()}
        with trace._lock:
            trace._grow_archive(archive_rows)
            trace._grow_recent(recent_rows)
            sl = slice(0, archive_rows)
            trace._arch_t[sl] = t[:archive_rows]
            trace._arch_t_end[sl] = np.asarray(data["archive_t_end"], dtype=float)
            for name, j in trace._columns.items():
                trace._arch_mean[sl, j] = mean[name][:archive_rows]
                trace._arch_min[sl, j] = _from_json_list(data["min"][name])
                trace._arch_max[sl, j] = _from_json_list(data["max"][name])
                trace._arch_count[sl, j] = np.asarray(data["archive_count"][name], dtype=np.uint32)
                trace._recent_v[:recent_rows, j] = mean[name][archive_rows:]
            trace._arch_n = archive_rows
            trace._recent_t[:recent_rows] = t[archive_rows:]
            trace._recent_n = recent_rows
            for name, s in data["stats"].items():
                j = trace._columns[name]
                trace._stats.count[j] = s["count"]
                trace._stats.total[j] = s["total"]
                trace._stats.min[j] = _to_float(s["min"], math.inf)
                trace._stats.max[j] = _to_float(s["max"], -math.inf)
                trace._stats.last[j] = _to_float(s["last"], math.nan)
            trace._rows_total = int(data["rows_total"])
        by_kind: dict[str, list[Mapping[str, Any]]] = {}
        for span in data["spans"]:
            by_kind.setdefault(span["kind"], []).append(span)
        for kind, spans in by_kind.items():  # each kind's spans in the order saved, as add_span took them
            attrs = np.empty(len(spans), dtype=object)
            attrs[:] = [span.get("attrs") for span in spans]
            trace._add_arrays(kind, np.array([span["start"] for span in spans], dtype=float),
                              np.array([span["end"] for span in spans], dtype=float),
                              attrs if any(a is not None for a in attrs) else None)
        with trace._lock:
            for kind, (count, total, lo, hi) in data["span_stats"].items():
                trace._span_stats[kind] = [count, total, _to_float(lo, math.inf), _to_float(hi, -math.inf)]
        return trace


# Per-GPU columns are named gpu<CUDA index>.<metric> (gpuwidget.sources.nvml).
_GPU_COLUMN = re.compile(r"^gpu(\d+)\.")


def gpu_indices(trace: Trace) -> list[int]:
    """GPU numbers that have at least one column in the trace, ascending."""
    found = {int(m.group(1)) for name in trace.columns if (m := _GPU_COLUMN.match(name))}
    return sorted(found)


def _rows(starts: np.ndarray, ends: np.ndarray, attrs: np.ndarray | None) -> Iterable[tuple[Any, ...]]:
    """Span columns as ``(start, end, attrs)`` tuples of Python objects."""
    return zip(starts.tolist(), ends.tolist(), repeat(None) if attrs is None else attrs.tolist())


def _argfirst(values: np.ndarray, targets: np.ndarray, edges: np.ndarray, n: int) -> np.ndarray:
    """Index, per bucket, of the first row whose value equals the bucket's target."""
    bucket_of_row = np.repeat(np.arange(len(edges)), np.diff(np.r_[edges, n]))
    hit = values == targets[bucket_of_row]
    rows = np.arange(n)
    first = np.full(len(edges), n)
    np.minimum.at(first, bucket_of_row[hit], rows[hit])
    return first


def finite_or_none(value: float) -> float | None:
    """A number JSON can carry: NaN and infinities (no reading) become None (null).

    The one place that maps missing readings for JSON: saved runs, Trace.to_dict and the server.
    """
    value = float(value)
    return value if math.isfinite(value) else None


def finite_list(values: np.ndarray) -> list[float | None]:
    """:func:`finite_or_none` over an array, vectorised (a history holds ~10^5 values)."""
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    if finite.all():
        return values.tolist()  # type: ignore[no-any-return]
    boxed = values.astype(object)
    boxed[~finite] = None
    return boxed.tolist()  # type: ignore[no-any-return]


def _from_json_list(values: list[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=float)


def _to_float(value: float | None, default: float) -> float:
    return default if value is None else float(value)
