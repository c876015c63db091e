"""The live views' per-rank strip: each training process's steps, data wait and step time while the cell runs.

When the watched code trains in several processes (children it started, or the kernel beside
them: gpuwidget.children), their spans arrive in the watch's one Trace, a child's with attrs
``{"pid", "rank"}``, the watch's own without a pid. Once two or more processes have taken a
batch, both live views (gpuwidget.ui.live, gpuwidget.ui.static) show one row per process under
their chart: its batches so far, and over the last :data:`WINDOW_S` seconds the share of its
loop spent waiting for data and its median step time. With a single process there is no strip.

The rank that holds the others back is named in words, not by colour alone: the same judgement
as the ``rank-straggler`` rule at the end of the run (gpuwidget.advice.rules.rank_straggler),
made on the window's figures, so the live view and the panel agree on who the straggler is.

It is cheap enough for the sampler thread: each :meth:`RankStrip.update` takes in only the
spans recorded since the last one (:meth:`Trace.spans_since`), keeps per process the spans of
the window with running sums, and takes a median only for the processes whose window changed
(BENCHMARKS.md section 13b: 8 ranks, under 2 ms an update).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, cast

import numpy as np

from gpuwidget.advice.rules import rank_straggler
from gpuwidget.advice.rules._ranks import rank_label
from gpuwidget.facts import RankEntry, WorkloadFacts
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
from gpuwidget.report import fmt_fraction, fmt_seconds
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

# The figures are over the last WINDOW_S seconds: long enough for a median of slow steps (a few
# per second), short enough that a rank that slows down shows it within seconds.
WINDOW_S = 10.0
# Per process and span kind the window keeps at most this many spans (faster loops: the window is
# their last MAX_WINDOW_SPANS steps), and the median is taken over the newest MEDIAN_SPANS.
MAX_WINDOW_SPANS = 4096
MEDIAN_SPANS = 512
# The rank-straggler rule judges the newest RULE_SPANS steps of each process: enough for its sign test
# across steps, few enough that judging 8 ranks stays within an update's budget (BENCHMARKS.md 13b).
RULE_SPANS = 128
# More processes than this (a wide torchrun): the first rows by rank, and the straggler always.
MAX_ROWS = 16
COLUMNS = ("process", "steps", "data wait", "step p50")


@dataclass(frozen=True)
class RankRow:
    """One training process as the strip shows it; the window's figures are None without a step in it."""

    label: str
    pid: int | None
    rank: int | None
    steps: int
    data_wait_fraction: float | None
    step_time_p50_s: float | None
    straggler: bool = False
    note: str = ""  # in words: the straggler's mark and its cause where measured, or a process gone quiet

    def cells(self) -> tuple[str, str, str, str]:
        return (self.label, str(self.steps), fmt_fraction(self.data_wait_fraction), fmt_seconds(self.step_time_p50_s))


class _Window:
    """The spans of one kind of one process within the window: end times, durations, their sum."""

    __slots__ = ("ends", "durations", "total")

    def __init__(self) -> None:
        self.ends: deque[float] = deque()
        self.durations: deque[float] = deque()
        self.total = 0.0

    def extend(self, items: Sequence[tuple[float, float, Any]]) -> None:
        self.ends.extend(end for _, end, _ in items)
        durations = [end - start for start, end, _ in items]
        self.durations.extend(durations)
        self.total += sum(durations)
        extra = len(self.ends) - MAX_WINDOW_SPANS
        if extra > 0:
            self._drop(extra)

    def prune(self, cutoff: float) -> bool:
        """Drop the spans that ended before ``cutoff``; True if any went."""
        ends, count = self.ends, 0
        while count < len(ends) and ends[count] < cutoff:
            count += 1
        if count:
            self._drop(count)
        return bool(count)

    def _drop(self, count: int) -> None:
        for _ in range(count):
            self.ends.popleft()
            self.total -= self.durations.popleft()
        if not self.ends:
            self.total = 0.0  # no drift left over from the running sum


class _Process:
    __slots__ = ("pid", "rank", "own", "batches", "steps", "waits", "p50", "changed")

    def __init__(self, pid: int, own: bool) -> None:
        self.pid = pid
        self.rank: int | None = None
        self.own = own
        self.batches = 0
        self.steps = _Window()
        self.waits = _Window()
        self.p50: float | None = None
        self.changed = True

    def entry(self) -> RankEntry:
        """The window's figures as a rank entry (the keys ``run.ranks`` has, which the rule reads)."""
        steps = self.steps
        wait = min(1.0, self.waits.total / steps.total) if steps.total > 0 else None
        return {"rank": self.rank, "pid": self.pid, "steps": len(steps.ends), "data_wait_fraction": wait,
                "step_time_p50_s": self.p50,  # and its latest steps one by one, the rule's evidence
                "step_times": list(islice(steps.durations, max(0, len(steps.durations) - RULE_SPANS), None)),
                "wait_times": list(islice(self.waits.durations, max(0, len(self.waits.durations) - RULE_SPANS),
                                          None))}


class RankStrip:
    """Per-process figures of one Trace, brought up to date by :meth:`update` (one thread at a time)."""

    def __init__(self, trace: Trace, window_s: float = WINDOW_S) -> None:
        self.trace = trace
        self.window_s = window_s
        self._seen = {STEP_SPAN: 0, DATA_WAIT_SPAN: 0}
        self._processes: dict[int | None, _Process] = {}
        self._own_pid = os.getpid()
        self.rows: list[RankRow] = []
        self.error: str | None = None  # why the strip stopped, if it failed: the chart goes on without it

    def update(self, now: float | None = None) -> list[RankRow]:
        """Take in the spans recorded since the last call; the rows to show (empty for one process)."""
        if self.error is not None:
            return []
        try:
            return self._update(now)
        except Exception as exc:  # noqa: BLE001 - on the sampler thread: a strip less, never a chart less
            self.error = repr(exc)
            log.warning("gpuwidget: the per-rank strip stopped: %r", exc)
            self.rows = []
            return self.rows

    def _update(self, now: float | None) -> list[RankRow]:
        for kind in (STEP_SPAN, DATA_WAIT_SPAN):
            items, self._seen[kind] = self.trace.spans_since(kind, self._seen[kind])
            if items:
                self._take(kind, items)
        if sum(1 for process in self._processes.values() if process.batches) < 2:
            self.rows = []
            return self.rows
        cutoff = (self.trace.now() if now is None else now) - self.window_s
        trained = [process for process in self._processes.values() if process.batches]
        for process in trained:
            pruned_steps = process.steps.prune(cutoff)
            if process.waits.prune(cutoff) or pruned_steps or process.changed:
                process.changed = True
        if any(process.changed for process in trained):
            self.rows = self._rows(trained)
        return self.rows

    # ------------------------------------------------------------------ taking spans in

    def _take(self, kind: str, items: list[tuple[float, float, Mapping[str, Any] | None]]) -> None:
        """File each run of spans that share one attrs object (a child's batch) under its process."""
        start = 0
        for index in range(1, len(items) + 1):
            if index == len(items) or items[index][2] is not items[start][2]:
                process = self._process(items[start][2])
                run = items[start:index]
                if kind == STEP_SPAN:
                    process.steps.extend(run)
                else:
                    process.waits.extend(run)
                    process.batches += len(run)
                process.changed = True
                start = index

    def _process(self, attrs: Mapping[str, Any] | None) -> _Process:
        pid = attrs.get("pid") if attrs else None
        key = pid if isinstance(pid, int) else None  # None: the watch's own process
        process = self._processes.get(key)
        if process is None:
            process = self._processes[key] = _Process(self._own_pid if key is None else key, own=key is None)
        rank = attrs.get("rank") if attrs else None
        if isinstance(rank, int):
            process.rank = rank
        return process

    # ------------------------------------------------------------------ the rows

    def _rows(self, trained: list[_Process]) -> list[RankRow]:
        for process in trained:
            if process.own and process.rank is None:
                process.rank = _own_rank()
            if process.changed:
                durations = process.steps.durations
                recent = np.sort(np.fromiter(islice(reversed(durations), MEDIAN_SPANS), dtype=float,
                                             count=min(len(durations), MEDIAN_SPANS)))
                middle = len(recent) // 2  # the median; np.median imports numpy.ma on its first call (14 ms)
                process.p50 = (float(recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2)
                               if len(recent) else None)
                process.changed = False
        # By rank; of the unranked, the watch's own process first (as the panel's run.ranks lists it,
        # gpuwidget.children.ranks.merge), then the children by pid: the same order whatever the pids are.
        trained.sort(key=lambda p: (p.rank is None, p.rank if p.rank is not None else 0, not p.own, p.pid or 0))
        entries = [process.entry() for process in trained]
        finding = rank_straggler.check({}, cast(WorkloadFacts, {"ranks": entries}), {})
        slow_pid = finding.evidence.get("pid") if finding is not None else None
        cause = (finding.change or {}).get("cause") if finding is not None else None
        rows = []
        for process, entry in zip(trained, entries):
            label = rank_label(entry) + (" (this process)" if process.own else "")
            straggler = slow_pid is not None and process.pid == slow_pid
            if straggler:
                note = "◀ slowest" + (f" ({cause})" if cause and cause != "cause not measured" else "")
            else:
                note = "" if process.steps.ends else f"no step in the last {self.window_s:g} s"
            rows.append(RankRow(label, process.pid, process.rank, process.batches, entry["data_wait_fraction"],
                                entry["step_time_p50_s"], straggler, note))
        if len(rows) > MAX_ROWS:
            shown = rows[:MAX_ROWS - 1]
            shown += [row for row in rows[MAX_ROWS - 1:] if row.straggler] or [rows[MAX_ROWS - 1]]
            rows = shown
        return rows

    @property
    def processes(self) -> int:
        """How many processes have taken a batch (the rows may show fewer: :data:`MAX_ROWS`)."""
        return sum(1 for process in self._processes.values() if process.batches)


def _own_rank() -> int | None:
    """The watch's own process's rank where it joined a process group (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a figure less, never an error on the sampler thread
        return None
    return None


def caption(strip: RankStrip) -> str:
    """The strip's title: how many processes and over which window."""
    return f"{strip.processes} training processes · last {strip.window_s:g} s"


def text_lines(strip: RankStrip, rows: Sequence[RankRow]) -> list[str]:
    """The strip as aligned plain-text lines (the static view's text/plain, terminals)."""
    if not rows:
        return []
    table = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = [caption(strip)]
    for line, row in zip(table, [None, *rows]):
        text = "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(line, widths)))
        lines.append((text + ("  " + row.note if row is not None and row.note else "")).rstrip())
    return lines
