"""The Bokeh live plot's GPU lines: SM activity where GPM is read with "kernel running" beside it,
utilisation alone without GPM, no empty utilisation line for a MIG instance (no browser needed)."""

from __future__ import annotations

import numpy as np

from gpuwidget.trace import Trace
from gpuwidget.ui.live import LiveView

MACHINE = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "gpm": True},
                    {"index": 1, "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "gpm": True, "is_mig": True},
                    {"index": 2, "name": "NVIDIA A40", "gpm": False}],
           "gpu_message": None}


def legend(view: LiveView) -> list[str]:
    return [str(item.label.value) for item in view.figure.legend[0].items]


def test_the_live_plot_draws_sm_activity_where_gpm_is_read_and_streams_it():
    trace = Trace(start_clock=0.0)
    for tick in range(20):
        trace.append(tick * 0.05, {"cpu.util": 30.0, "proc.cpu": 99.0,
                                   "gpu0.util": 92.0, "gpu0.sm_active": 6.0, "gpu0.mem_used": 1e9,
                                   "gpu0.mem_total": 8e10, "gpu1.sm_active": 40.0, "gpu1.mem_used": 1e9,
                                   "gpu1.mem_total": 4e10, "gpu2.util": 70.0, "gpu2.mem_used": 1e9,
                                   "gpu2.mem_total": 4.8e10})
    view = LiveView(trace, MACHINE, label="In [2]")
    try:
        assert legend(view) == ["waiting for data", "GPU0 SM active", "GPU0 kernel running", "GPU0 memory",
                                "GPU1 SM active", "GPU1 memory", "GPU2 kernel running (nvidia-smi)", "GPU2 memory",
                                "CPU (all cores)", "this process (% of a core)"]
        view.push()
        data = view.source.data
        assert np.nanmean(data["gpu0_sm"]) == 6.0 and np.nanmean(data["gpu0_util"]) == 92.0
        assert np.nanmean(data["gpu1_sm"]) == 40.0 and "gpu2_sm" not in data
        assert "GPU0 SM active 6% (kernel running 92%)" in view.header.value
        assert "GPU1 SM active 40%" in view.header.value and "GPU2 kernel running 70%" in view.header.value
        for tick in range(20, 30):  # later rows stream into the same columns
            trace.append(tick * 0.05, {"cpu.util": 30.0, "gpu0.util": 90.0, "gpu0.sm_active": 50.0})
        view._last_push = -np.inf
        view._created -= 10  # past the first seconds' resends: this push streams
        view.push()
        assert view.source.data["gpu0_sm"][-1] == 50.0
    finally:
        view.close()


def test_the_plot_is_sent_every_tick_in_its_first_seconds_then_once_a_second(monkeypatch):
    """Each push makes the browser draw the plot again (15 % of a core in Chromium at 4 a second)."""
    from gpuwidget.ui import live

    clock = [100.0]
    monkeypatch.setattr(live, "now", lambda: clock[0])
    trace = Trace(start_clock=0.0)
    view = LiveView(trace, MACHINE, label="In [2]")
    pushes: list[float] = []
    monkeypatch.setattr(view, "push", lambda: (pushes.append(clock[0]), setattr(view, "_last_push", clock[0])))
    try:
        for _ in range(40):  # 10 s of ticks at the default 0.25 s
            view.on_tick(trace)
            clock[0] += 0.25
        first = [t for t in pushes if t < 100.0 + live.RESEND_WHOLE_S]
        assert first == [100.0 + 0.25 * i for i in range(len(first))] and len(first) == 12  # at once, every tick
        later = np.diff([t for t in pushes if t >= 100.0 + live.RESEND_WHOLE_S])
        assert len(later) >= 5 and set(later.tolist()) == {1.0}
    finally:
        monkeypatch.undo()
        view.close()


def test_after_its_first_seconds_the_plot_gets_the_whole_run_again_every_resync_time(monkeypatch):
    """A page that drew the plot after the first seconds' whole pushes (or lost a push) has only what was
    streamed after: every RESYNC_EVERY_S a push sends the whole run from its first sample again."""
    from bokeh.models import ColumnDataSource

    from gpuwidget.ui import live

    clock = [100.0]
    monkeypatch.setattr(live, "now", lambda: clock[0])
    trace = Trace(start_clock=0.0)
    view = LiveView(trace, MACHINE, label="In [2]")
    streamed: list[int] = []  # rows per push that streamed (Bokeh's models take no attribute of ours)
    stream = ColumnDataSource.stream

    def spy(source: ColumnDataSource, data: dict, *args: object) -> None:
        if source is view.source:
            streamed.append(len(data["t"]))
        stream(source, data, *args)

    monkeypatch.setattr(ColumnDataSource, "stream", spy)
    whole: list[float] = []  # the first time of each whole push
    try:
        for tick in range(120):  # 30 s of ticks at the default 0.25 s, a row each
            trace.append(tick * 0.25, {"cpu.util": 30.0, "proc.cpu": 99.0})
            before = len(streamed)
            view.on_tick(trace)
            if len(streamed) == before and view._last_push == clock[0]:
                whole.append(float(view.source.data["t"][0]))
                assert len(view.source.data["t"]) == tick + 1  # every row so far (under MAX_POINTS)
            clock[0] += 0.25
        resyncs = whole[12:]  # past the first seconds' pushes at every tick
        assert len(resyncs) == 2 and set(resyncs) == {0.0}, whole
        assert len(streamed) >= 15 and max(streamed) <= 5  # between them, only the new rows
    finally:
        monkeypatch.undo()
        view.close()
