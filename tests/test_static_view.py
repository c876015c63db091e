"""--view: the option, the choice of view per front-end, and the widget-free live view (a chart
redrawn in place with update_display_data) in a real kernel read through raw jupyter_client
messages, as a front-end without a widget manager sees it."""

from __future__ import annotations

import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest
from IPython.core.error import UsageError

import gpuwidget
from gpuwidget.options import OptionError, WatchOptions, make_options, parse_line
from gpuwidget.probes import DATA_WAIT_SPAN
from gpuwidget.trace import Trace
from gpuwidget.ui.static import StaticView
from gpuwidget.ui.views import frontend, resolve_view

from support import cell_messages as run_cell
from support import gpuwidget_kernel

# Judges the live view's redraw cost and real-kernel updates: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

SVG = "{http://www.w3.org/2000/svg}"

# ------------------------------------------------------------------ the option


def test_view_option_parses_and_no_live_is_view_none():
    assert parse_line("").view == "auto"
    assert parse_line("--view static").view == "static"
    assert parse_line("--view=bokeh").view == "bokeh"
    for line in ("--no-live", "--view none", "--no-live --view none"):
        options = parse_line(line)
        assert (options.view, options.live) == ("none", False)
    assert parse_line("--view static").live is True


def test_bad_or_contradicting_view_is_a_one_line_usage_error(ip):
    with pytest.raises(UsageError) as bad:
        ip.run_cell_magic("gpuwatch", "--view svg", "raise AssertionError('the cell must not run')")
    assert str(bad.value) == "%%gpuwatch: --view: expected one of auto, bokeh, static, none, got 'svg'"
    with pytest.raises(OptionError, match="^--no-live means --view none, which contradicts --view bokeh$"):
        parse_line("--no-live --view bokeh")
    with pytest.raises(ValueError, match="--view: expected one of"), gpuwidget.watch(view="svg"):
        pass


def test_live_false_still_turns_the_live_view_off_for_callers_and_saved_runs():
    assert make_options(live=False).view == "none"
    assert WatchOptions(live=False).view == "none"
    assert WatchOptions(view="none").live is False
    # A run saved before `view` existed has only `live`.
    old = {"interval": 0.25, "gpus": None, "live": False, "advice": True, "tune": False, "save": None,
           "quiet": False}
    assert WatchOptions.from_dict(old).view == "none"
    assert WatchOptions.from_dict({**old, "live": True}).view == "auto"
    assert WatchOptions.from_dict(make_options(view="static").to_dict()) == make_options(view="static")


# ------------------------------------------------------------------ which view "auto" picks


@pytest.mark.parametrize(("environ", "modules", "expected"), [
    ({}, {}, None),
    # VS Code's Jupyter extension sets this for the Python kernels it starts.
    ({"PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING": "1"}, {}, "vscode"),
    # ...and its extension host's own variables reach the kernel too.
    ({"VSCODE_PID": "4242", "VSCODE_CWD": "/home/me"}, {}, "vscode"),
    # A JupyterLab started from VS Code's terminal serves a browser: not VS Code's front-end.
    ({"VSCODE_PID": "4242", "TERM_PROGRAM": "vscode"}, {}, None),
    ({"COLAB_RELEASE_TAG": "release-colab_20261120-060104_RC00"}, {}, "colab"),
    ({}, {"google.colab": object()}, "colab"),
])
def test_frontend_is_recognised_from_the_kernel_environment(environ, modules, expected):
    assert frontend(environ, modules) == expected


def test_auto_is_static_where_widgets_cannot_work_and_bokeh_elsewhere():
    assert resolve_view("auto", {"PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING": "1"}, {}) == "static"
    assert resolve_view("auto", {}, {"google.colab": object()}) == "static"
    assert resolve_view("auto", {}, {}) == "bokeh"
    # An explicit choice is kept wherever the kernel runs.
    assert resolve_view("bokeh", {"VSCODE_PID": "1"}, {}) == "bokeh"
    assert resolve_view("static", {}, {}) == "static"


def test_a_bokeh_view_that_cannot_be_built_falls_back_to_the_static_one(ip, monkeypatch, caplog):
    import gpuwidget.ui.live as live
    from gpuwidget.ui.views import show_live_view

    def broken(*args, **kwargs):
        raise ImportError("No module named 'jupyter_bokeh'")

    monkeypatch.setattr(live, "ensure_bokehjs", lambda: "server")
    monkeypatch.setattr(live, "LiveView", broken)
    view = show_live_view("bokeh", busy_trace(2.0, waits=2), {"gpus": [], "gpu_message": "no GPU found"})
    assert isinstance(view, StaticView) and view.handle is not None
    assert ("the Bokeh live plot is unavailable (No module named 'jupyter_bokeh'); showing the static view"
            in caplog.text)
    assert show_live_view("none", busy_trace(1.0, waits=0), {"gpus": []}) is None


# ------------------------------------------------------------------ the chart


def busy_trace(seconds: float, waits: int, gpu: bool = True) -> Trace:
    trace = Trace(start_clock=0.0)
    for i in range(int(seconds * 4)):
        values = {"cpu.util": 40.0 + (i % 7), "proc.cpu": 95.0}
        if gpu:
            values.update({"gpu0.util": 70.0 + (i % 11), "gpu0.mem_used": 3e9, "gpu0.mem_total": 8e9})
        trace.append(i / 4, values)
    step = seconds / max(waits, 1)
    trace.add_spans(DATA_WAIT_SPAN, [(k * step, k * step + step / 3) for k in range(waits)])
    return trace


def svg_texts(svg: str) -> list[str]:
    return [node.text or "" for node in ET.fromstring(svg).iter(f"{SVG}text")]


def test_chart_has_its_axis_labels_series_legend_and_waits():
    machine = {"gpus": [{"index": 0, "name": "Fake GPU"}], "gpu_message": None}
    view = StaticView(busy_trace(6.0, waits=12), machine, label="In [3]")
    bundle = view.bundle()
    assert re.fullmatch(r"gpuwidget · watching In \[3\] · [\d.]+ s \| GPU0 kernel running \d+% · 3\.0/8 GB \| "
                        r"CPU \d+%", bundle["text/plain"])
    root = ET.fromstring(bundle["image/svg+xml"])
    texts = svg_texts(bundle["image/svg+xml"])
    # 0..10 s until the run outgrows it, 0-100 % on the other axis.
    assert {"0%", "50%", "100%", "0 s", "5 s", "10 s"} <= set(texts)
    assert {"GPU0 kernel running (nvidia-smi)", "GPU0 memory", "CPU (all cores)", "waiting for data"} <= set(texts)
    assert not any("SM active" in text for text in texts)  # no GPM on this GPU: nothing claims SM activity
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3 and all(len(line.get("points", "").split()) >= 20 for line in lines)
    # Twelve waits of 0.17 s, apart from each other by 0.33 s: twelve bands.
    assert len(root.findall(f"{SVG}rect")) == 12


def test_with_gpm_the_chart_draws_sm_activity_with_kernel_running_beside_it():
    machine = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "gpm": True}], "gpu_message": None}
    trace = busy_trace(6.0, waits=0)
    for i in range(24):
        trace.append(6.0 + i / 4, {"cpu.util": 40.0, "gpu0.util": 92.0, "gpu0.sm_active": 6.0,
                                   "gpu0.mem_used": 3e9, "gpu0.mem_total": 8e9})
    bundle = StaticView(trace, machine, label="In [3]").bundle()
    assert "| GPU0 SM active 6% (kernel running 92%) · 3.0/8 GB |" in bundle["text/plain"]
    texts = svg_texts(bundle["image/svg+xml"])
    assert {"GPU0 SM active", "GPU0 kernel running", "GPU0 memory"} <= set(texts)
    dashes = {line.get("stroke-dasharray") for line in ET.fromstring(bundle["image/svg+xml"]).findall(f"{SVG}polyline")}
    assert {None, "1 2", "4 3"} <= dashes  # SM active solid, kernel running dotted, memory dashed


def test_a_mig_instance_draws_its_sm_activity_and_no_empty_utilisation_line():
    machine = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "gpm": True, "is_mig": True}],
               "gpu_message": None}
    trace = Trace(start_clock=0.0)
    for i in range(24):
        trace.append(i / 4, {"cpu.util": 40.0, "gpu0.sm_active": 30.0, "gpu0.mem_used": 3e9, "gpu0.mem_total": 8e9})
    bundle = StaticView(trace, machine).bundle()
    texts = svg_texts(bundle["image/svg+xml"])
    assert "GPU0 SM active" in texts and not any("kernel running" in text for text in texts)
    assert "GPU0 SM active 30% · 3.0/8 GB" in bundle["text/plain"]


def test_chart_axis_doubles_when_the_run_outgrows_it_and_says_when_there_is_no_gpu():
    machine = {"gpus": [], "gpu_message": "no GPU found"}
    view = StaticView(busy_trace(13.0, waits=0, gpu=False), machine)
    bundle = view.bundle()
    assert "no GPU found: host metrics only" in bundle["text/plain"]
    assert {"0 s", "10 s", "20 s"} <= set(svg_texts(bundle["image/svg+xml"]))


def test_redraw_cost_does_not_grow_with_the_run():
    """A redraw reads only the waits since the last one: cheap after an hour with 20,000 waits."""
    machine = {"gpus": [{"index": 0}], "gpu_message": None}
    view = StaticView(busy_trace(3600.0, waits=20_000), machine)
    view.bundle()  # the first redraw takes in every wait so far
    started = time.perf_counter()
    for _ in range(5):
        view.bundle()
    per_redraw = (time.perf_counter() - started) / 5
    assert per_redraw < 0.05, f"{per_redraw * 1000:.1f} ms per redraw"  # under 1 ms here (BENCHMARKS.md)


# ------------------------------------------------------------------ in a real kernel, without a widget manager


@pytest.fixture(scope="module")
def vscode_kernel() -> Iterator[object]:
    """A kernel started as VS Code's Jupyter extension starts one (its environment variable set)."""
    with gpuwidget_kernel(env={**os.environ, "PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING": "1"}) as kc:
        yield kc


WATCHED = """%%gpuwatch {options}
import time
end = time.perf_counter() + {seconds}
while time.perf_counter() < end:
    time.sleep(0.01)
'done'"""


@pytest.mark.kernel
def test_static_view_updates_in_place_while_the_cell_runs_then_the_panel_follows(vscode_kernel):
    messages = run_cell(vscode_kernel, WATCHED.format(options="--view static --interval 0.1", seconds=3))
    (first,) = [m for _, m in messages if m["msg_type"] == "display_data"
                and "image/svg+xml" in m["content"]["data"]]
    display_id = first["content"]["transient"]["display_id"]
    updates = [(t, m["content"]["data"]) for t, m in messages if m["msg_type"] == "update_display_data"
               and m["content"]["transient"]["display_id"] == display_id]
    charts = [(t, data) for t, data in updates if "image/svg+xml" in data]
    (reply_at,) = [t for t, m in messages if m["msg_type"] == "status"][-1:]
    # Redrawn about once a second while the cell runs, not in a burst at its end.
    assert len(charts) >= 2
    assert charts[-1][0] - charts[0][0] >= 0.8
    assert reply_at - charts[0][0] >= 1.5
    for _, data in charts:
        texts = svg_texts(data["image/svg+xml"])
        assert {"0%", "100%", "0 s", "CPU (all cores)"} <= set(texts)
        assert data["text/plain"].startswith("gpuwidget · watching In [")
    assert len(ET.fromstring(charts[-1][1]["image/svg+xml"]).findall(f"{SVG}polyline")) >= 1
    # No widget, no comm: nothing a front-end without a widget manager cannot show.
    assert not [m for _, m in messages if m["msg_type"].startswith("comm_")]
    # When the cell ends (it printed nothing) the chart's output becomes the run's panel: no emptied
    # output stays in the saved notebook (ui.outputs).
    assert "gpuwidget-run" in updates[-1][1]["text/html"]
    assert not [m for _, m in messages if m["msg_type"] == "display_data" and m is not first]
    (result,) = [m for _, m in messages if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"] == "'done'"


@pytest.mark.kernel
def test_auto_shows_the_static_view_in_a_vscode_kernel(vscode_kernel):
    messages = run_cell(vscode_kernel, WATCHED.format(options="--interval 0.1", seconds=1.2))
    assert [m for _, m in messages if m["msg_type"] == "display_data" and "image/svg+xml" in m["content"]["data"]]
    assert not [m for _, m in messages if m["msg_type"].startswith("comm_")]
    assert not [m for _, m in messages if "application/javascript" in m["content"].get("data", {})]


# ------------------------------------------------------------------ the server: subshell requests are not activity


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}}


@pytest.mark.server
def test_server_does_not_take_subshell_requests_for_the_kernels_activity(jp_serverapp):
    """JupyterLab creates a subshell for a live plot's widget comms; the kernel's idle status for that
    request must not read as the kernel's state (the browser test pins what the status bar shows)."""
    untracked = jp_serverapp.kernel_manager.untracked_message_types
    assert {"create_subshell_request", "delete_subshell_request"} <= set(untracked)
    assert "debug_request" in untracked and "execute_request" not in untracked and "comm_msg" not in untracked
