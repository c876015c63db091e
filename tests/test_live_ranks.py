"""The live views' per-rank strip: spans of 2-4 processes in one Trace become one row per process (steps,
data wait and median step time over the last seconds, the straggler named in words) under the static
chart and the Bokeh plot, nothing for a single process; and in a real kernel, two spawned gloo ranks
show up in the static view's display updates while the cell runs."""

from __future__ import annotations

import os
import socket
import statistics
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from gpuwidget.clock import now as clock_now
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
from gpuwidget.trace import Trace
from gpuwidget.ui.rank_strip import MAX_ROWS, WINDOW_S, RankStrip, text_lines
from gpuwidget.ui.static import HEIGHT, StaticView

from support import cell_messages, gpuwidget_kernel

SVG = "{http://www.w3.org/2000/svg}"
NO_GPU = {"gpus": [], "gpu_message": "no GPU found"}
OWN = None  # the watch's own process: its spans carry no pid
# Made-up children's pids start above any real one (pid_max is at most 2**22), so none is ever this process's.
CHILD = 2**22


def feed(trace: Trace, pid: int | None, rank: int | None, step_s: float, wait_fraction: float, count: int,
         start: float = 1.0, batch: int = 25) -> float:
    """``count`` steps of ``step_s`` from ``start``, each beginning with a wait of ``wait_fraction`` of it,
    sent in batches as a child's agent sends them (the watch's own process: no attrs); returns the end."""
    attrs = None if pid is None else {"pid": pid, "rank": rank}
    for first in range(0, count, batch):
        steps = [(start + k * step_s, start + (k + 1) * step_s) for k in range(first, min(count, first + batch))]
        trace.add_spans(STEP_SPAN, steps, attrs)
        trace.add_spans(DATA_WAIT_SPAN, [(begin, begin + wait_fraction * step_s) for begin, _ in steps], attrs)
    return start + count * step_s


def recent_trace(seconds: float = 10.0) -> Trace:
    """A Trace whose clock says ``seconds`` have passed (the views read the window's end from it)."""
    trace = Trace(start_clock=clock_now() - seconds)
    for i in range(int(seconds * 4)):
        trace.append(i / 4, {"cpu.util": 40.0, "proc.cpu": 90.0})
    return trace


# ------------------------------------------------------------------ the strip's content


def test_rows_give_each_rank_its_steps_data_wait_and_median_step_over_the_last_seconds():
    trace = Trace(start_clock=0.0)
    feed(trace, CHILD + 5001, 0, step_s=0.040, wait_fraction=0.10, count=150)
    feed(trace, CHILD + 5002, 1, step_s=0.050, wait_fraction=0.25, count=120)  # not slow enough to be a straggler
    strip = RankStrip(trace)
    rows = strip.update(now=9.0)
    assert [(row.label, row.pid, row.rank, row.steps) for row in rows] == [("rank 0", CHILD + 5001, 0, 150),
                                                                         ("rank 1", CHILD + 5002, 1, 120)]
    assert [row.data_wait_fraction for row in rows] == pytest.approx([0.10, 0.25])
    assert [row.step_time_p50_s for row in rows] == pytest.approx([0.040, 0.050])
    assert text_lines(strip, rows) == [
        f"2 training processes · last {WINDOW_S:g} s",
        "process  steps  data wait  step p50",
        "rank 0     150        10%     40 ms",
        "rank 1     120        25%     50 ms",
    ]


@pytest.mark.parametrize("offset", [-1, 1], ids=["child-pid-below-this-one", "child-pid-above-this-one"])
def test_one_process_gets_no_strip_and_a_second_one_brings_it(offset):
    trace = Trace(start_clock=0.0)
    feed(trace, OWN, None, step_s=0.05, wait_fraction=0.1, count=40)
    strip = RankStrip(trace)
    assert strip.update(now=5.0) == []
    child = os.getpid() + offset
    feed(trace, child, None, step_s=0.05, wait_fraction=0.1, count=10)
    rows = strip.update(now=5.0)
    # The watch's own process (here beside a child that has no rank) first, whatever the pids, then the child.
    assert [row.label for row in rows] == [f"pid {os.getpid()} (this process)", f"pid {child}"]
    assert [row.steps for row in rows] == [40, 10]


def test_children_without_a_rank_follow_the_watchs_own_process_by_pid():
    trace = Trace(start_clock=0.0)
    own = os.getpid()
    for pid in (own + 7, own - 1, own + 2):
        feed(trace, pid, None, step_s=0.05, wait_fraction=0.1, count=10)
    feed(trace, OWN, None, step_s=0.05, wait_fraction=0.1, count=20)
    rows = RankStrip(trace).update(now=3.0)
    assert [row.pid for row in rows] == [own, own - 1, own + 2, own + 7]


def test_the_window_forgets_older_steps_and_says_when_a_rank_went_quiet():
    trace = Trace(start_clock=0.0)
    end = feed(trace, CHILD + 5001, 0, step_s=0.2, wait_fraction=0.5, count=100, start=0.0)  # 0-20 s: slow
    feed(trace, CHILD + 5001, 0, step_s=0.02, wait_fraction=0.05, count=200, start=end)  # 20-24 s: fast
    feed(trace, CHILD + 5002, 1, step_s=0.1, wait_fraction=0.1, count=100, start=0.0)  # stopped at 10 s
    strip = RankStrip(trace)
    fast, quiet = strip.update(now=25.05)
    assert fast.steps == 300 and fast.step_time_p50_s == pytest.approx(0.02)
    # 10 s back from 25.05 s: the last 25 slow steps with their waits, and all the fast ones.
    slow_s, fast_s = 25 * 0.2, 200 * 0.02
    assert fast.data_wait_fraction == pytest.approx((0.5 * slow_s + 0.05 * fast_s) / (slow_s + fast_s))
    assert quiet.steps == 100 and quiet.step_time_p50_s is None and quiet.data_wait_fraction is None
    assert quiet.note == f"no step in the last {WINDOW_S:g} s" and quiet.cells()[2:] == ("n/a", "n/a")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_rank_slower_than_the_others_is_named_in_words(ranks):
    trace = Trace(start_clock=0.0)
    for rank in range(ranks):
        slow = rank == ranks - 1
        feed(trace, CHILD + 6000 + rank, rank, step_s=0.1 if slow else 0.05, wait_fraction=0.05,
             count=60 if slow else 120)
    rows = RankStrip(trace).update(now=8.0)
    assert [row.straggler for row in rows] == [False] * (ranks - 1) + [True]
    # Its own loader waits no longer than the others': no cause measured, the mark alone.
    assert [row.note for row in rows] == [""] * (ranks - 1) + ["◀ slowest"]


def test_in_lockstep_the_rank_waiting_on_its_own_loader_is_the_straggler():
    trace = Trace(start_clock=0.0)
    feed(trace, CHILD + 6000, 0, step_s=0.05, wait_fraction=0.05, count=120)
    feed(trace, CHILD + 6001, 1, step_s=0.05, wait_fraction=0.6, count=120)
    feed(trace, CHILD + 6002, 2, step_s=0.05, wait_fraction=0.05, count=120)
    rows = RankStrip(trace).update(now=8.0)
    assert [row.note for row in rows] == ["", "◀ slowest (its data loader)", ""]


def test_equal_ranks_have_no_straggler():
    trace = Trace(start_clock=0.0)
    for rank in range(4):
        feed(trace, CHILD + 6000 + rank, rank, step_s=0.05, wait_fraction=0.1, count=120)
    assert not any(row.straggler or row.note for row in RankStrip(trace).update(now=8.0))


def test_a_child_keeps_its_row_when_its_rank_becomes_known_and_updates_take_in_only_new_spans():
    trace = Trace(start_clock=0.0)
    feed(trace, OWN, None, step_s=0.05, wait_fraction=0.1, count=20)
    end = feed(trace, CHILD + 7001, None, step_s=0.05, wait_fraction=0.1, count=10)  # before init_process_group
    strip = RankStrip(trace)
    assert [row.label for row in strip.update(now=3.0)] == [f"pid {os.getpid()} (this process)", f"pid {CHILD + 7001}"]
    feed(trace, CHILD + 7001, 1, step_s=0.05, wait_fraction=0.1, count=30, start=end)
    rows = strip.update(now=3.0)
    assert [(row.label, row.steps) for row in rows] == [("rank 1", 40), (f"pid {os.getpid()} (this process)", 20)]
    assert strip.update(now=3.0) == rows  # nothing new: the same rows, no span counted twice


def test_spans_since_returns_what_was_recorded_after_the_cursor():
    trace = Trace(start_clock=0.0, span_capacity=8)
    assert trace.spans_since(STEP_SPAN, 0) == ([], 0)
    trace.add_spans(STEP_SPAN, [(0, 1), (1, 2)], {"pid": 1})
    items, seen = trace.spans_since(STEP_SPAN, 0)
    assert [(s, e) for s, e, _ in items] == [(0, 1), (1, 2)] and seen == 2 and items[0][2] == {"pid": 1}
    trace.add_span(STEP_SPAN, 2, 3)
    assert trace.spans_since(STEP_SPAN, seen) == ([(2, 3, None)], 3)
    # More than the Trace keeps arrived since: the kept ones, in order.
    trace.add_spans(STEP_SPAN, [(k, k + 1) for k in range(3, 23)])
    items, seen = trace.spans_since(STEP_SPAN, 3)
    assert [s for s, _, _ in items] == list(range(15, 23)) and seen == 23


def test_more_processes_than_rows_still_show_the_straggler():
    trace = Trace(start_clock=0.0)
    count = MAX_ROWS + 4
    for rank in range(count):
        slow = rank == count - 1
        feed(trace, CHILD + 6000 + rank, rank, step_s=0.1 if slow else 0.05, wait_fraction=0.05,
             count=60 if slow else 120)
    strip = RankStrip(trace)
    rows = strip.update(now=8.0)
    assert len(rows) == MAX_ROWS and strip.processes == count
    assert [row.rank for row in rows] == [*range(MAX_ROWS - 1), count - 1] and rows[-1].straggler
    assert text_lines(strip, rows)[0] == f"{count} training processes · last {WINDOW_S:g} s"


def test_an_update_with_8_ranks_of_10000_steps_stays_cheap():
    """Spans arriving as children send them (every 0.3 s), updates every 0.25 s: each update costs the
    spans that came since the last, not the run (BENCHMARKS.md 13b: under 1 ms here). Rank 3 waits 1.2 ms of
    each 2 ms step for data against 0.1 ms on the others: over rank-straggler's 1 ms floor."""
    trace = Trace(start_clock=0.0)
    strip = RankStrip(trace)
    step_s, costs, sent, t = 0.002, [], 0.0, 0.0
    while sent < 10_000 * step_s:
        t += 0.25
        while sent + 0.3 <= t:
            for rank in range(8):
                first, last = round(sent / step_s), round((sent + 0.3) / step_s)
                feed(trace, CHILD + 9000 + rank, rank, step_s, 0.6 if rank == 3 else 0.05, last - first,
                     start=first * step_s, batch=last - first)
            sent += 0.3
        started = time.thread_time()
        rows = strip.update(now=t)
        costs.append(time.thread_time() - started)
    assert [row.steps for row in rows] == [round(sent / step_s)] * 8
    assert [row.rank for row in rows if row.straggler] == [3]
    assert statistics.median(costs) < 0.010, f"{statistics.median(costs) * 1000:.2f} ms per update"


# ------------------------------------------------------------------ the static view


def svg_texts(svg: str) -> list[str]:
    return [node.text or "" for node in ET.fromstring(svg).iter(f"{SVG}text")]


def test_static_view_is_unchanged_for_a_single_process():
    trace = recent_trace()
    feed(trace, OWN, None, step_s=0.05, wait_fraction=0.2, count=100)
    view = StaticView(trace, NO_GPU, label="In [2]")
    bundle = view.bundle()
    assert "\n" not in bundle["text/plain"] and view.rank_rows == []
    root = ET.fromstring(bundle["image/svg+xml"])
    assert root.get("height") == str(HEIGHT) and "process" not in svg_texts(bundle["image/svg+xml"])


def test_static_view_draws_the_ranks_under_the_chart_and_in_its_text():
    trace = recent_trace()
    feed(trace, CHILD + 6000, 0, step_s=0.05, wait_fraction=0.05, count=150)
    feed(trace, CHILD + 6001, 1, step_s=0.05, wait_fraction=0.6, count=150)
    feed(trace, CHILD + 6002, 2, step_s=0.05, wait_fraction=0.05, count=150)
    view = StaticView(trace, NO_GPU, label="In [2]")
    bundle = view.bundle()
    lines = bundle["text/plain"].splitlines()
    assert lines[0].startswith("gpuwidget · watching In [2]")
    assert lines[1:] == text_lines(view._strip, view.rank_rows)
    assert lines[4].split() == ["rank", "1", "150", "60%", "50", "ms", "◀", "slowest", "(its", "data", "loader)"]
    root = ET.fromstring(bundle["image/svg+xml"])
    assert int(root.get("height") or 0) > HEIGHT
    texts = svg_texts(bundle["image/svg+xml"])
    assert {"3 training processes · last 10 s", "process", "steps", "data wait", "step p50", "rank 0", "rank 1",
            "rank 2", "◀ slowest (its data loader)"} <= set(texts)
    # The straggler's line is bold (and coloured), its mark in words beside it.
    (bold,) = [group for group in root.iter(f"{SVG}g") if group.get("font-weight") == "bold"]
    assert [node.text for node in bold.iter(f"{SVG}text")] == ["rank 1", "150", "60%", "50 ms",
                                                               "◀ slowest (its data loader)"]


# ------------------------------------------------------------------ the Bokeh view


class TableRows(HTMLParser):
    """The text of each table row, cell by cell, and each row's class."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str | None, list[str]]] = []
        self._cell: list[str] | None = None
        self.caption = ""
        self._in_caption = False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append((dict(attrs).get("class"), []))
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "caption":
            self._in_caption = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1][1].append("".join(self._cell))
            self._cell = None
        elif tag == "caption":
            self._in_caption = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_caption:
            self.caption += data


def test_bokeh_view_shows_the_rank_table_under_the_plot_once_a_second_process_trains():
    from gpuwidget.ui.live import LiveView

    trace = recent_trace()
    view = LiveView(trace, NO_GPU, label="In [4]")
    try:
        # The steps are placed by the trace's clock once the view is built (seconds on a busy host): the
        # table's window is the last 10 s of that clock, and this leaves 3.5 s before the child's leave it.
        start = trace.now() - 6.5
        end = feed(trace, OWN, None, step_s=0.05, wait_fraction=0.05, count=60, start=start)
        assert view.widget.children == (view.header, view.model, view.ranks)
        view.push()
        # One process: the table takes no room and the plot is as before.
        assert view.ranks.layout.display == "none" and view.ranks.value == "" and view.rank_rows == []
        feed(trace, CHILD + 6001, 1, step_s=0.1, wait_fraction=0.05, count=60, start=start)
        feed(trace, OWN, None, step_s=0.05, wait_fraction=0.05, count=60, start=end)
        view.push()
        assert view.ranks.layout.display is None
        table = TableRows()
        table.feed(view.ranks.value)
        assert table.caption == "2 training processes · last 10 s"
        assert table.rows == [
            (None, ["process", "steps", "data wait", "step p50", ""]),
            ("straggler", ["rank 1", "60", "5%", "100 ms", "◀ slowest"]),
            (None, [f"pid {os.getpid()} (this process)", "120", "5%", "50 ms", ""]),
        ]
        # The plot's own sources carry what they did: the waits of both processes as bands.
        assert len(view.bands.data["left"]) >= 1 and set(view.source.data) >= {"t", "cpu_util"}
        # Theme colours with fallbacks; the straggler stands out by weight and colour as well as words.
        assert "var(--jp-warn-color0" in view.ranks.value and "font-weight:bold" in view.ranks.value
    finally:
        view.close()


# ------------------------------------------------------------------ in a real kernel


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RANKS_CELL = """%%gpuwatch --view static --interval 0.1
import sys
sys.path.insert(0, {tests!r})
import torch.multiprocessing as mp
from gloo_job import slow_loader_rank
mp.spawn(slow_loader_rank, args=(2, {port}, 50, 1, 0.012), nprocs=2, join=True)
"""


@pytest.mark.kernel
@pytest.mark.slow
def test_static_view_in_a_kernel_shows_each_spawned_gloo_rank_while_the_cell_runs():
    with gpuwidget_kernel() as kc:
        cell = RANKS_CELL.format(tests=str(Path(__file__).parent), port=free_port())
        messages = [msg for _, msg in cell_messages(kc, cell, timeout=120)]
    assert not [m for m in messages if m["msg_type"] == "error"]
    (chart,) = [m for m in messages if m["msg_type"] == "display_data" and "image/svg+xml" in m["content"]["data"]]
    display_id = chart["content"]["transient"]["display_id"]
    updates = [m["content"]["data"] for m in messages if m["msg_type"] == "update_display_data"
               and m["content"]["transient"]["display_id"] == display_id and "image/svg+xml" in m["content"]["data"]]
    with_ranks = [data for data in updates if "2 training processes" in data["text/plain"]]
    assert with_ranks, [data["text/plain"] for data in updates]
    # Before the children report, the chart alone (the kernel itself does not train).
    assert "\n" not in updates[0]["text/plain"]
    last = with_ranks[-1]
    rows = {line.split()[1]: line for line in last["text/plain"].splitlines() if line.startswith("rank ")}
    assert set(rows) == {"0", "1"}
    assert {"rank 0", "rank 1", "process", "data wait", "step p50"} <= set(svg_texts(last["image/svg+xml"]))
    # Rank 1's loader sleeps 48 ms a batch, rank 0's not at all: rank 1 waits for data most of its loop.
    waits = {rank: int(line.split()[3].rstrip("%")) for rank, line in rows.items()}
    assert waits["1"] >= waits["0"] + 30, rows
    # The steps so far grow from update to update.
    steps = [int(next(line for line in data["text/plain"].splitlines() if line.startswith("rank 1")).split()[2])
             for data in with_ranks]
    assert steps == sorted(steps) and steps[-1] > 0
    # After the cell the panel takes the chart's place, with its own per-process table.
    last_update = [m["content"]["data"] for m in messages if m["msg_type"] == "update_display_data"
                   and m["content"]["transient"]["display_id"] == display_id][-1]
    assert "gpuwidget-run" in last_update.get("text/html", "")
    assert "gpuwidget-ranks" in last_update["text/html"]


def test_a_failing_strip_leaves_the_chart_drawing(caplog, monkeypatch):
    from gpuwidget.advice.rules import rank_straggler

    def broken(*args):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(rank_straggler, "check", broken)
    trace = recent_trace()
    feed(trace, CHILD + 6000, 0, step_s=0.05, wait_fraction=0.05, count=100)
    feed(trace, CHILD + 6001, 1, step_s=0.05, wait_fraction=0.05, count=100)
    view = StaticView(trace, NO_GPU)
    for _ in range(2):
        bundle = view.bundle()
        assert view.rank_rows == [] and "\n" not in bundle["text/plain"] and "<polyline" in bundle["image/svg+xml"]
    assert view._strip.error == "ZeroDivisionError('float division by zero')"
    assert caplog.text.count("per-rank strip stopped") == 1
