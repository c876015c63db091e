"""Bokeh's property checks and the threads that import bokeh (no browser needed).

Bokeh switches its property checks off process-wide while it defines a model class or a glyph method
(a flag set and restored, not a count), so two threads importing bokeh at once can leave them off for
good. The extension's warm-up imports bokeh on a thread of its own: a live plot built meanwhile kept its
legend's (label, renderers) tuples, which BokehJS refuses, and the page showed no plot (CI and
fresh-check run 81: "Legend.items given invalid value").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time

from bokeh.core.property.bases import Property

import gpuwidget
from gpuwidget.trace import Trace
from gpuwidget.ui import views
from gpuwidget.ui.live import LiveView

MACHINE = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "gpm": True}], "gpu_message": None}


def document_sent(view: LiveView) -> str:
    """The plot's document as the page gets it, with Bokeh's generated ids left out."""
    text = json.dumps(view.model.render_bundle["docs_json"], sort_keys=True)
    return re.sub(r'"(p\d+|[0-9a-f]{8}-[0-9a-f-]{27})"', '"ID"', text)


def test_the_page_gets_the_same_plot_with_bokehs_property_checks_off(monkeypatch):
    checked = LiveView(Trace(), MACHINE, label="In [1]")
    monkeypatch.setattr(Property, "_should_validate", False)
    unchecked = LiveView(Trace(), MACHINE, label="In [1]")
    monkeypatch.undo()
    try:
        kinds = {type(item).__name__ for item in unchecked.figure.legend[0].items}
        assert kinds == {"LegendItem"} and len(unchecked.figure.legend[0].items) == 6  # 3 GPU lines, 2 CPU, waits
        assert document_sent(unchecked) == document_sent(checked)
    finally:
        checked.close()
        unchecked.close()


# A fresh interpreter (bokeh not yet imported): the extension's warm-up imports bokeh while a cell's
# thread defines bokeh models, switching threads every 10 us as a loaded machine does.
RACE = textwrap.dedent("""
    import sys, threading
    sys.setswitchinterval(1e-5)
    import gpuwidget

    calls = 0

    def cell():
        global calls
        import bokeh.models
        while ("bokeh.plotting" not in sys.modules
               or getattr(sys.modules["bokeh.plotting"].__spec__, "_initializing", False)):
            bokeh.models.Range1d.parameters()  # what defining a model class does
            calls += 1

    thread = threading.Thread(target=cell)
    gpuwidget._warm_up()
    thread.start()
    thread.join()
    gpuwidget.wait_for_warm_up()
    from bokeh.core.property.bases import Property
    print(calls, Property._should_validate)
""")


def test_the_warm_up_leaves_bokehs_checks_on_when_a_cell_imports_bokeh_beside_it():
    result = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, check=True)
    calls, validates = result.stdout.split()
    assert int(calls) > 0, "the cell's thread ended before the warm-up imported bokeh.plotting: no race was run"
    assert validates == "True", result.stdout


def test_checks_the_user_switched_off_before_loading_the_extension_stay_off():
    script = textwrap.dedent("""
        from bokeh.core.property.validation import validate
        validate(False)  # bokeh's documented way to switch its checks off for good
        import gpuwidget
        gpuwidget._warm_up()
        gpuwidget.wait_for_warm_up()
        from bokeh.core.property.bases import Property
        print(Property._should_validate)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False"]


def test_the_first_watched_cell_builds_its_plot_after_the_warm_up_imports(monkeypatch):
    ended: list[float] = []
    built: list[float] = []

    def warm_up() -> None:
        time.sleep(0.5)
        ended.append(time.monotonic())

    original = LiveView.__init__

    def init(self, *args, **kwargs) -> None:
        built.append(time.monotonic())
        original(self, *args, **kwargs)

    monkeypatch.setattr(LiveView, "__init__", init)
    monkeypatch.setattr("gpuwidget.ui.live.ensure_bokehjs", lambda: "server")
    monkeypatch.setattr(LiveView, "show", lambda self: None)
    thread = threading.Thread(target=warm_up, name=gpuwidget.WARM_UP_THREAD)
    thread.start()
    view = views.show_live_view("bokeh", Trace(), MACHINE)
    try:
        assert isinstance(view, LiveView)
        assert ended and built[0] >= ended[0]
    finally:
        view.close()
        thread.join()


def test_a_watch_goes_on_when_the_warm_up_does_not_end():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name=gpuwidget.WARM_UP_THREAD)
    thread.start()
    try:
        gpuwidget.wait_for_warm_up(timeout=0.2)
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join()
