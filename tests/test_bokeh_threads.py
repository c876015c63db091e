"""Bokeh's property checks and the threads that import bokeh (no browser needed).

Bokeh switches its property checks off process-wide while it defines a model class or a glyph method
(a flag set and restored, not a count), so two threads importing bokeh at once can leave them off for
good. The extension's warm-up imports bokeh on a thread of its own: a live plot built meanwhile kept its
legend's (label, renderers) tuples, which BokehJS refuses, and the page showed no plot (CI and
fresh-check run 81: "Legend.items given invalid value").
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
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


# A fresh interpreter (bokeh not yet imported) and IPython's shell: `%load_ext gpuwidget` starts the
# warm-up's imports, and the next cell defines bokeh models for as long as the warm-up runs, switching
# threads every 10 us as a loaded machine does. Beside the imports it left the checks off in CI
# (486 definitions beside them, on e06101b): no cell may start before they end.
RACE = textwrap.dedent("""
    import sys
    sys.setswitchinterval(1e-5)
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext gpuwidget")
    result = shell.run_cell(
        "import threading, bokeh.models\\n"
        "calls = 0\\n"
        "while any(t.name == 'gpuwidget-warm-up' for t in threading.enumerate()):\\n"
        "    bokeh.models.Range1d.parameters()  # what defining a model class does\\n"
        "    calls += 1\\n"
    )
    result.raise_error()
    from bokeh.core.property.bases import Property
    print(shell.user_ns["calls"], "bokeh.plotting" in sys.modules, Property._should_validate)
""")


def test_no_cell_runs_beside_the_warm_ups_imports_and_bokehs_checks_stay_on():
    result = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, check=True)
    calls, imported, validates = result.stdout.split()
    assert imported == "True", "the warm-up did not import bokeh.plotting: no race was run"
    assert calls == "0", f"the cell defined bokeh models {calls} times while the warm-up imported bokeh"
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


# A warm-up whose imports take 30 s, put in before the extension loads (the kernel's first cell).
SLOW_WARM_UP = (
    "import gpuwidget, threading, time\n"
    "gpuwidget._warm_up = lambda: threading.Thread(target=time.sleep, args=(30,), daemon=True,\n"
    "                                              name=gpuwidget.WARM_UP_THREAD).start()\n"
    "%load_ext gpuwidget\n"
)


@pytest.mark.kernel
@pytest.mark.untimed  # its own kernel; its one bound (20 s against the warm-up's 30) is no timing judgement
def test_ctrl_c_while_a_cell_waits_for_the_warm_up_stops_that_cell_and_the_next_one_runs():
    """In a real kernel: ipykernel transforms each cell twice, so a Ctrl-C caught in the first
    transform's wait must still stop the cell (fresh-check: it was lost, and the cell ran 60 s)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        assert kc.execute_interactive(SLOW_WARM_UP, timeout=60)["content"]["status"] == "ok"
        started = time.monotonic()
        msg_id = kc.execute("ran = True")
        interrupted, error = False, None
        while time.monotonic() - started < 20:
            if not interrupted and time.monotonic() - started > 0.5:
                km.interrupt_kernel()
                interrupted = True
            try:
                msg = kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                error = msg["content"]["ename"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert time.monotonic() - started < 20  # the Ctrl-C ended the wait, not the warm-up's end
        assert error == "KeyboardInterrupt"
        checked = kc.execute_interactive("assert 'ran' not in globals()\n%unload_ext gpuwidget\n"
                                         "assert gpuwidget.warm_up_first not in "
                                         "get_ipython().input_transformers_cleanup",
                                         timeout=30)
        assert checked["content"]["status"] == "ok", checked["content"]  # the cell did not run; unloaded
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
