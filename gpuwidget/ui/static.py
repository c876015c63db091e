"""The live view that needs no widget manager: an SVG chart the sampler thread redraws in place.

VS Code shows third-party widgets only where its users allow a CDN, Colab only with its own
widget manager; a plain display output works in both, and everywhere else. This view shows
one output (an ``image/svg+xml`` chart and a ``text/plain`` line) and, from the sampler
thread, replaces it about once a second (:data:`UPDATE_INTERVAL_S`) with IPython's display
update: an ``update_display_data`` message, which front-ends apply while the cell runs. When
the cell ends the run's panel replaces it, as it replaces the Bokeh plot.

The chart is drawn here, not by the panel's ``report.chart_svg``: that one reads every kept
span of the run each time, 14 ms for 20,000 data waits, where this one takes the waits
that arrived since its last update and keeps them as pixel-free intervals, and draws whole
pixels. A redraw costs 0.5 ms of CPU for one GPU, 5 ms for 8 GPUs after an hour
(BENCHMARKS.md); one that costs more than :data:`MAX_CPU_SHARE` of a core at one a second
makes the next come later. Same series, colours and 0-100 % axis as the other charts
(gpuwidget.chart). When several processes train, a per-rank strip (gpuwidget.ui.rank_strip)
follows the chart, in the SVG and in the text.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import Collection
from typing import Any

import numpy as np

from gpuwidget.chart import CPU_COLOR, SVG_DASH, WAIT_COLOR, gpu_series, machine_gpu_lines, merge_bands
from gpuwidget.clock import now
from gpuwidget.facts import MachineFacts
from gpuwidget.probes import DATA_WAIT_SPAN
from gpuwidget.trace import Span, Trace
from gpuwidget.ui.rank_strip import COLUMNS as RANK_COLUMNS
from gpuwidget.ui.rank_strip import RankRow, RankStrip, caption, text_lines

UPDATE_INTERVAL_S = 1.0
# Redraws slow down rather than take more than this share of a core (8 GPUs after hours).
MAX_CPU_SHARE = 0.005
# The time axis starts at 0..INITIAL_SPAN_S s and doubles when the run outgrows it.
INITIAL_SPAN_S = 10.0
WIDTH = 640
HEIGHT = 160
# Plot area inside the SVG: room for the header line above, the % labels left, the time
# labels and the legend below.
LEFT, TOP, RIGHT, BOTTOM = 38, 22, 14, 40
# Waits closer than this are one interval (as in the Bokeh plot); at most this many intervals are kept.
MERGE_GAP_S = 0.02
MAX_INTERVALS = 4000
TEXT_COLOR = "#888"  # reads on light and dark backgrounds alike
HEADER_CHARS = 108  # what fits the width at 11 px (the text line has it all)
# The per-rank strip below the legend: one line per process; the straggler's in bold, this colour
# and with its mark in words. Its columns: the label starts at the first x, figures end at the others.
RANK_ROW_H = 13
RANK_COLUMN_X = (LEFT, LEFT + 190, LEFT + 265, LEFT + 335)
STRAGGLER_COLOR = "#d9822b"  # reads on light and dark backgrounds alike


def status_parts(last: dict[str, float], gpus: list[int], gpu_message: str | None,
                 sm_active: Collection[int] = ()) -> list[str]:
    """The running figures after the title: per GPU how busy (SM active where GPM has it, with kernel
    running beside it; else kernel running) and its memory, then the host CPU."""
    parts = []
    if gpus:
        for index in gpus:
            util = last.get(f"gpu{index}.util")
            sm = last.get(f"gpu{index}.sm_active") if index in sm_active else None
            used = last.get(f"gpu{index}.mem_used")
            total = last.get(f"gpu{index}.mem_total")
            text = f"GPU{index}"
            running = util is not None and math.isfinite(util)
            if sm is not None and math.isfinite(sm):
                text += f" SM active {sm:.0f}%" + (f" (kernel running {util:.0f}%)" if running else "")
            elif running:
                text += f" kernel running {util:.0f}%"
            if used is not None and total:
                text += f" · {used / 1e9:.1f}/{total / 1e9:.0f} GB"
            parts.append(text)
    else:
        parts.append(f"{gpu_message}: host metrics only")
    cpu = last.get("cpu.util")
    if cpu is not None and math.isfinite(cpu):
        parts.append(f"CPU {cpu:.0f}%")
    return parts


class StaticView:
    """A chart of one Trace, shown with :meth:`show` and redrawn from the sampler thread."""

    def __init__(self, trace: Trace, machine: MachineFacts, label: str = "") -> None:
        self.trace = trace
        self.label = label
        self._gpus, self._sm, running = machine_gpu_lines(machine)
        self._gpu_message = machine.get("gpu_message")
        # A GPU's memory total does not change: it is read from the last row, not downsampled
        # with the rest (a third fewer columns through plot_view, the dearest part of a redraw).
        self._columns = ["cpu.util", *(f"gpu{i}.{m}" for i in self._gpus for m in ("util", "mem_used")),
                         *(f"gpu{i}.sm_active" for i in self._sm)]
        # (label, colour, dash, key in _percent)
        self._series: list[tuple[str, str, str, str]] = [
            (line.label, line.color, SVG_DASH[line.kind], line.key)
            for line in gpu_series(self._gpus, self._sm, running)]
        self._series.append(("CPU (all cores)", CPU_COLOR, "", "cpu_util"))
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._intervals_end = -math.inf
        self._x_end = INITIAL_SPAN_S
        self._last_update = -math.inf
        self._interval = UPDATE_INTERVAL_S
        self._closed = False
        self.handle: Any = None
        self.updates = 0
        self._strip = RankStrip(trace)
        self.rank_rows: list[RankRow] = []  # what the last redraw showed (empty: one process)

    def show(self) -> Any:
        """Display the (empty) chart; returns the display handle the run's panel later replaces it through."""
        from IPython.display import display

        self.handle = display(self.bundle(), raw=True, display_id=True)
        return self.handle

    def on_tick(self, trace: Trace) -> None:
        """Sampler-thread hook: redraw every UPDATE_INTERVAL_S (later if a redraw costs over MAX_CPU_SHARE)."""
        if now() - self._last_update >= self._interval:
            self.update()

    def update(self) -> None:
        """Replace the displayed chart with the current one (safe from any thread)."""
        with self._lock:
            if self._closed or self.handle is None:
                return
            self._last_update = now()
            started = time.thread_time()
            self.handle.update(self.bundle(), raw=True)
            self._interval = max(UPDATE_INTERVAL_S, (time.thread_time() - started) / MAX_CPU_SHARE)
            self.updates += 1

    def close(self) -> None:
        """Stop updating; the run's panel replaces the chart."""
        with self._lock:
            self._closed = True

    # ---------------------------------------------------------------- rendering

    def bundle(self) -> dict[str, str]:
        """The output: the chart as SVG, and one line of text for front-ends without images."""
        last = self.trace.last()
        values = last[1] if last else {}
        elapsed = self.trace.now()
        title = " ".join(["gpuwidget · watching", *([self.label] if self.label else []), f"· {elapsed:.1f} s"])
        line = fit_parts([title, *status_parts(values, self._gpus, self._gpu_message, self._sm)], HEADER_CHARS)
        self.rank_rows = rows = self._strip.update()
        text = "\n".join([line, *text_lines(self._strip, rows)])
        return {"image/svg+xml": self.svg(line, rows), "text/plain": text}

    def svg(self, header: str, rows: list[RankRow] | None = None) -> str:
        # A minimum and a maximum every 4 px: spikes stay, the SVG stays small (a few kB per series).
        frame = self.trace.plot_view(self._columns, max_points=(WIDTH - LEFT - RIGHT) // 2)
        t = frame.t
        if len(t) and float(t[-1]) > self._x_end:
            self._x_end = max(2 * self._x_end, float(t[-1]))
        plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
        x_scale = plot_w / self._x_end
        height = HEIGHT + (RANK_ROW_H * (len(rows) + 2) + 4 if rows else 0)

        def y(v: np.ndarray) -> np.ndarray:
            return TOP + (1 - np.clip(v, 0.0, 100.0) / 100) * plot_h

        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
                 f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="10" fill="{TEXT_COLOR}">',
                 f'<text x="2" y="11" font-size="11">{html.escape(header)}</text>']
        for x0, x1 in self._wait_pixels(plot_w, x_scale):
            parts.append(f'<rect x="{LEFT + x0}" y="{TOP}" width="{x1 - x0}" height="{plot_h}" '
                         f'fill="{WAIT_COLOR}" fill-opacity="0.3"/>')
        for level in (0, 50, 100):
            level_y = float(y(np.array(level)))
            parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{level_y:.1f}" y2="{level_y:.1f}" '
                         f'stroke="{TEXT_COLOR}" stroke-opacity="0.35"/>')
            parts.append(f'<text x="{LEFT - 5}" y="{level_y + 3.5:.1f}" text-anchor="end">{level}%</text>')
        for tick, anchor in ((0.0, "start"), (self._x_end / 2, "middle"), (self._x_end, "end")):
            parts.append(f'<text x="{LEFT + tick * x_scale:.1f}" y="{TOP + plot_h + 12}" '
                         f'text-anchor="{anchor}">{tick:g} s</text>')
        if len(t) >= 2:
            data = self._percent(frame, values_now=self.trace.last())
            xs = LEFT + t * x_scale
            for _, color, dash, key in self._series:
                points = _points(xs, y(data[key]))
                if points:
                    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                    parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                                 f'stroke-width="1.4"{dash_attr}/>')
        parts.append(self._legend(TOP + plot_h + 28))
        if rows:
            parts.append(self._ranks(rows, HEIGHT + RANK_ROW_H - 2))
        parts.append("</svg>")
        return "".join(parts)

    def _percent(self, frame: Any, values_now: tuple[float, dict[str, float]] | None) -> dict[str, np.ndarray]:
        """The plotted series on the 0-100 % axis, keyed as gpuwidget.chart.percent_data keys them."""
        last = values_now[1] if values_now else {}
        data = {"cpu_util": frame.mean["cpu.util"]}
        for index in self._gpus:
            data[f"gpu{index}_util"] = frame.mean[f"gpu{index}.util"]
            if index in self._sm:
                data[f"gpu{index}_sm"] = frame.mean[f"gpu{index}.sm_active"]
            total = last.get(f"gpu{index}.mem_total")
            used = frame.mean[f"gpu{index}.mem_used"]
            data[f"gpu{index}_mem"] = 100.0 * used / total if total else np.full(len(used), np.nan)
        return data

    def _legend(self, baseline: float) -> str:
        items = [(name, color, dash, 1.0) for name, color, dash, _ in self._series]
        items.append(("waiting for data", WAIT_COLOR, "", 0.6))
        out, x = [], float(LEFT)
        for name, color, dash, opacity in items:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<line x1="{x:.0f}" x2="{x + 14:.0f}" y1="{baseline - 3.5}" y2="{baseline - 3.5}" '
                       f'stroke="{color}" stroke-width="{4 if opacity < 1 else 2}" stroke-opacity="{opacity}"'
                       f'{dash_attr}/>')
            out.append(f'<text x="{x + 18:.0f}" y="{baseline}">{html.escape(name)}</text>')
            x += 18 + 5.6 * len(name) + 14
        return "".join(out)

    def _ranks(self, rows: list[RankRow], baseline: float) -> str:
        """The per-rank strip: a caption, the column names, one line per process."""
        out = [f'<text x="{LEFT}" y="{baseline}">{html.escape(caption(self._strip))}</text>']
        lines: list[tuple[tuple[str, ...], RankRow | None]] = [(RANK_COLUMNS, None)]
        lines += [(row.cells(), row) for row in rows]
        for n, (cells, row) in enumerate(lines, start=1):
            y = baseline + n * RANK_ROW_H
            style = f' font-weight="bold" fill="{STRAGGLER_COLOR}"' if row is not None and row.straggler else ""
            out.append(f'<g{style}>')
            for i, (cell, x) in enumerate(zip(cells, RANK_COLUMN_X)):
                anchor = "start" if i == 0 else "end"
                out.append(f'<text x="{x}" y="{y}" text-anchor="{anchor}">{html.escape(cell)}</text>')
            if row is not None and row.note:
                out.append(f'<text x="{RANK_COLUMN_X[-1] + 12}" y="{y}">{html.escape(row.note)}</text>')
            out.append("</g>")
        return "".join(out)

    def _wait_pixels(self, plot_w: int, x_scale: float) -> list[tuple[int, int]]:
        """Runs of pixel columns in which the loop waited for data (from the waits seen so far)."""
        spans = self.trace.spans(DATA_WAIT_SPAN, t0=self._intervals_end)
        new = merge_bands(spans, MERGE_GAP_S, after=self._intervals_end)
        if new:
            if self._intervals and new[0][0] - self._intervals[-1][1] <= MERGE_GAP_S:
                new[0] = (self._intervals.pop()[0], new[0][1])
            self._intervals.extend(new)
            self._intervals_end = new[-1][1]
            if len(self._intervals) > MAX_INTERVALS:  # merge neighbours: detail finer than a pixel is lost anyway
                kept = [Span(DATA_WAIT_SPAN, a, b, {}) for a, b in self._intervals]
                self._intervals = merge_bands(kept, gap=self._x_end / plot_w)
        if not self._intervals:
            return []
        bounds = np.array(self._intervals) * x_scale
        start = np.clip(np.floor(bounds[:, 0]).astype(int), 0, plot_w - 1)
        end = np.clip(np.ceil(bounds[:, 1]).astype(int), start + 1, plot_w)
        covered = np.zeros(plot_w + 1, dtype=int)
        np.add.at(covered, start, 1)
        np.add.at(covered, end, -1)
        waiting = np.cumsum(covered[:-1]) > 0
        edges = np.flatnonzero(np.diff(np.r_[0, waiting.astype(int), 0]))
        return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def fit_parts(parts: list[str], chars: int, separator: str = " | ") -> str:
    """The header's parts joined within ``chars``: every part stays (the CPU figure after a long no-GPU
    notice too), the longest is shortened at a word with "…" until the line fits."""
    parts = list(parts)
    while len(separator.join(parts)) > chars:
        longest = max(range(len(parts)), key=lambda i: len(parts[i]))
        words = parts[longest].rstrip("…").split(" ")
        if len(words) < 2:
            break
        parts[longest] = " ".join(words[:-1]).rstrip(" :,(") + "…"
    return separator.join(parts)


def _points(xs: np.ndarray, ys: np.ndarray) -> str:
    """SVG polyline points, whole pixels ("x y x y ...": formatting ints is what keeps a redraw cheap)."""
    keep = np.isfinite(ys)
    if keep.sum() < 2:
        return ""
    pairs = np.empty(2 * int(keep.sum()), dtype=int)
    pairs[0::2] = np.rint(xs[keep])
    pairs[1::2] = np.rint(ys[keep])
    return " ".join(map(str, pairs.tolist()))
