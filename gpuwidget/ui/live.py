"""The live plot under a watched cell: a Bokeh figure in an ipywidget, fed from the sampler thread.

Updates are batched: the sampler calls :meth:`LiveView.on_tick` every tick, and at most every
``PUSH_INTERVAL_S`` (every tick in the view's first seconds) the view streams the rows that arrived
since the last push into its ColumnDataSource (jupyter_bokeh turns that into a few comm messages,
which reach the browser while the cell is still busy). Everything is on one 0-100 % axis: per GPU
its SM activity (GPM) with "kernel running" (NVML utilisation) beside it, or utilisation alone
without GPM, and its memory; host CPU; intervals when the loop waited for data are shaded bands.
When several processes train, a per-rank table under the plot (gpuwidget.ui.rank_strip) shows each
one's steps, data wait and step time, updated with the plot.

BokehJS is put on the page from the installed bokeh package (no CDN) by
:func:`ensure_bokehjs`.

The plot only receives. jupyter_bokeh's view sends every change the browser makes to a
document back to the kernel, including an echo of each streamed patch (it collects the
events the patch itself raises and sends them after applying it) and the ranges and sizes
BokehJS computes. Those comm messages reach a busy kernel: JupyterLab 4.6 sends them on a
kernel subshell, whose busy/idle status the page shows as the kernel's ("Idle" while the
cell runs), and a subshell JupyterLab deletes once the plot's comms are closed still holds
some of them ("Task was destroyed but it is pending!" under the next cell); the rest wait
for the cell to end and find the comms closed ("No such comm", dozens per cell). Nothing
in the live plot needs the kernel to hear from the page (pan, zoom and the legend work in
the browser), so :data:`CLIENT_JS`, sent with BokehJS's loader, keeps jupyter_bokeh's listener
off documents tagged :data:`LIVE_TAG` and gives the plot JupyterLab's theme colours.
"""

from __future__ import annotations

import html
import json
import math
import re
import threading
import uuid
from typing import Any

import numpy as np

from gpuwidget.chart import (
    CPU_COLOR,
    PROCESS_COLOR,
    WAIT_COLOR,
    gpu_series,
    machine_gpu_lines,
    merge_bands,
    percent_data,
    plot_columns,
)
from gpuwidget.clock import now
from gpuwidget.facts import MachineFacts
from gpuwidget.probes import DATA_WAIT_SPAN
from gpuwidget.trace import Frame, Trace
from gpuwidget.ui.rank_strip import COLUMNS as RANK_COLUMNS
from gpuwidget.ui.rank_strip import RankRow, RankStrip, caption
from gpuwidget.ui.static import status_parts

# Each push makes the browser draw the whole plot again: at 4 a second that took 15 % of a core in
# Chromium (benchmarks/browser_cost.py), the most a live view may cost being 10 %. Once a second, as
# the static view redraws, after a first RESEND_WHOLE_S at every tick (the plot shows at once).
PUSH_INTERVAL_S = 1.0
FIRST_PUSH_INTERVAL_S = 0.25
MAX_POINTS = 2000
# Waits shorter than this are invisible at any sensible zoom; adjacent ones closer than
# MERGE_GAP_S are drawn as one band so a starved loop shows a few bands, not thousands.
MIN_BAND_S = 0.002
MERGE_GAP_S = 0.02
MAX_BANDS = 2000
# The x axis starts at 0..INITIAL_SPAN_S s (an empty Bokeh plot would show -0.5..1) and
# doubles whenever the run outgrows it, so a pan or zoom survives for a while.
INITIAL_SPAN_S = 10.0
# The page builds the plot's view some time after the widget is displayed (0.1-1.5 s, more on a
# busy machine), and jupyter_bokeh drops the patches that arrive before it: for this long the
# whole run so far is sent each push (a few dozen rows), so the plot starts at 0 s wherever it
# was built.
RESEND_WHOLE_S = 3.0
# After those first seconds, every push this long after the last whole one sends the whole run again
# (what a push past MAX_POINTS sends anyway): a page that drew the plot later than RESEND_WHOLE_S (a
# loaded laptop), or lost a push, shows the run from its first sample within this long. It costs the
# browser what any push does (one redraw) and the kernel a downsampled copy of the run.
RESYNC_EVERY_S = 10.0
LIVE_TAG = "gpuwidget-live"
# Bokeh's dash of each kind of GPU line (gpuwidget.chart.gpu_series): the busy figure solid, "kernel
# running" beside SM activity dash-dotted (this process's CPU is dotted), memory dashed.
LINE_DASH = {"busy": "solid", "kernel": "dotdash", "memory": "dashed"}
# The per-rank table's figures are over seconds (gpuwidget.ui.rank_strip.WINDOW_S): once shown, it
# is brought up to date at most this often, not on every push.
RANKS_INTERVAL_S = 1.0

# Runs in the page before each live plot is shown (idempotent): jupyter_bokeh's listener (the
# one that talks to the kernel: BokehJS's own take batches) is not added to a live plot's
# document, and the plot gets the theme's colours, read once from JupyterLab's CSS variables
# (a canvas cannot follow them). Sent with every BokehJS loader, so kept short (spaces next to
# punctuation dropped: none of its strings has one).
#
# And BokehJS's message receiver finds the start of the next message again where it lost it. Each
# push reaches the page as several widget messages (a patch's header, metadata and content, then a
# header and a payload per array), which jupyter_bokeh's view drops until it has drawn the plot and
# then hands one by one to a receiver that takes the first one it gets for a header. A plot drawn
# while a push was arriving took that push's metadata for a header, and every message after it for
# the part before: it never showed a point (fresh-check run 87, beside a CPU-bound neighbour). Now a
# fragment that is no message header (it names no msgtype) is passed over where a header is due.
CLIENT_JS = re.sub(r"\s*([-+{}()\[\];,=:|&!?<>])\s*", r"\1", """(function () {
  var B = window.Bokeh;
  if (!B || !B.require) { return; }
  var R = B.require("protocol/receiver").Receiver.prototype;
  if (!R.gpuwidget) {
    var header = R._HEADER;
    R.gpuwidget = true;
    R._HEADER = function (fragment) {
      var parsed = null;
      if (typeof fragment === "string") { try { parsed = JSON.parse(fragment); } catch (e) {} }
      if (parsed && typeof parsed.msgtype === "string") { return header.call(this, fragment); }
    };
  }
  var D = B.require("document").Document.prototype;
  if (D.gpuwidget) { return; }
  var add = D.on_change;
  D.gpuwidget = true;
  D.on_change = function (f, batch) {
    if (batch || !this.roots().some(function (r) { return (r.tags || []).indexOf(__TAG__) >= 0; })) {
      return add.call(this, f, batch);
    }
    if (!this.themed) {
      this.themed = true;
      try { theme(this); } catch (e) { console.warn("gpuwidget theme", e); }
    }
  };
  function theme(doc) {
    var style = getComputedStyle(document.body);
    var v = function (name) { return style.getPropertyValue("--jp-" + name).trim(); };
    var text = v("ui-font-color1"), line = v("border-color1"), grid = v("border-color2");
    if (!text) { return; }
    var roles = {axis_label_text_color: text, label_text_color: text, major_label_text_color: v("ui-font-color2"),
      axis_line_color: line, major_tick_line_color: line, minor_tick_line_color: line,
      grid_line_color: grid, outline_line_color: grid, border_line_color: grid};
    doc.all_models.forEach(function (m) {
      var set = m.type === "Legend" ? {background_fill_color: v("layout-color0")} : {};
      for (var k in roles) { if (k in m.properties && m[k] !== null) { set[k] = roles[k]; } }
      m.setv(set);
    });
  }
})();""").replace("__TAG__", json.dumps(LIVE_TAG))


_bokehjs_inlined = False
_loader_display_id: str | None = None

# Asks the Jupyter server (gpuwidget's server extension) for BokehJS when the page lacks
# it, e.g. after a browser reload while the kernel kept running. Synchronous on purpose:
# the widget view that follows needs window.Bokeh when it is created.
_SERVER_LOADER = """(function () {
  var version = %(version)s;
  if (window.Bokeh && window.Bokeh.version === version) { return; }
  var config = {};
  var node = document.getElementById("jupyter-config-data");
  if (node) { try { config = JSON.parse(node.textContent); } catch (e) {} }
  var base = (config.baseUrl || "/").replace(/\\/?$/, "/");
  var request = new XMLHttpRequest();
  request.open("GET", base + "gpuwidget/static/bokeh-" + version + ".min.js", false);
  if (config.token) { request.setRequestHeader("Authorization", "token " + config.token); }
  try { request.send(); } catch (e) { request = null; }
  if (!request || request.status !== 200) {
    console.warn("gpuwidget: the server has no BokehJS " + version + "; run gpuwidget.load_bokehjs()");
    return;
  }
  var script = document.createElement("script");
  script.textContent = request.responseText;
  document.head.appendChild(script);
})();"""

_INLINE_LOADER = """(function () {
  if (window.Bokeh && window.Bokeh.version === %(version)s) { return; }
  var script = document.createElement("script");
  script.textContent = %(code)s;
  document.head.appendChild(script);
})();"""


def ensure_bokehjs(force: bool = False) -> str:
    """Make sure the page has this kernel's BokehJS before a live plot is shown; no CDN.

    Where the Jupyter server that started this kernel serves BokehJS of this version
    (gpuwidget's server extension; see gpuwidget.ui.bokehjs), a few hundred bytes that fetch
    it from there if the page lacks it. Elsewhere the first watch in a kernel sends it inline
    (about 1.3 MB, Bokeh's core bundle from the installed package) and later watches the
    small loader (for a page reloaded meanwhile). ``force`` sends the inline copy again.
    Returns which was sent.
    """
    global _bokehjs_inlined, _loader_display_id
    import bokeh
    from IPython.display import publish_display_data

    from gpuwidget.ui.bokehjs import server_serves_bokehjs

    version = json.dumps(bokeh.__version__)
    if not force and (_bokehjs_inlined or server_serves_bokehjs(bokeh.__version__)):
        kind, code = "server", _SERVER_LOADER % {"version": version}
    else:
        from bokeh.resources import Resources

        bundle = "\n".join(Resources(mode="inline", components=["bokeh"]).js_raw)
        kind, code = "inline", _INLINE_LOADER % {"version": version, "code": json.dumps(bundle)}
        _bokehjs_inlined = True
    # With a display id, so that retire_bokehjs_loader() can empty it: the page keeps BokehJS,
    # the saved notebook does not (1.3 MB inline), and nothing runs again when it is reopened.
    _loader_display_id = f"gpuwidget-bokehjs-{uuid.uuid4().hex}"
    # The live plot's page side (CLIENT_JS) rides along: it needs BokehJS and must run before the plot.
    publish_display_data({"application/javascript": code + "\n" + CLIENT_JS, "text/plain": ""},
                         metadata={"gpuwidget": {"bokehjs": bokeh.__version__, "loader": kind}},
                         transient={"display_id": _loader_display_id})
    return kind


def take_loader_output() -> str | None:
    """The display id of the loader's output just sent, for the live plot to take over (its output then
    becomes the plot, and later the panel: one output, ui.outputs); None when there is none."""
    global _loader_display_id
    display_id, _loader_display_id = _loader_display_id, None
    return display_id


def retire_bokehjs_loader() -> None:
    """Empty the output that carried the last loader (once the live plot it served is gone)."""
    global _loader_display_id
    if _loader_display_id is None:
        return
    from IPython.display import publish_display_data

    display_id, _loader_display_id = _loader_display_id, None
    publish_display_data({"text/plain": ""}, transient={"display_id": display_id}, update=True)


class LiveView:
    """A live-updating plot of one Trace; ``widget`` is what gets displayed."""

    def __init__(self, trace: Trace, machine: MachineFacts, label: str = "") -> None:
        import ipywidgets
        from bokeh.core.property.vectorization import value
        from bokeh.models import ColumnDataSource, Range1d
        from bokeh.models.annotations import Legend, LegendItem
        from bokeh.plotting import figure
        from jupyter_bokeh import BokehModel

        self.trace = trace
        self.label = label
        self._gpus, self._sm, running = machine_gpu_lines(machine)
        self._names = {int(d["index"]): d.get("name", "") for d in machine.get("gpus") or []}
        self._gpu_message = machine.get("gpu_message")
        self._lock = threading.Lock()
        self._last_push = -math.inf
        self._last_whole = -math.inf
        self._last_t = -math.inf
        self._last_band_end = -math.inf
        self._points = 0
        self._bands = 0
        self._closed = False
        self._created = now()

        # (column in the plot, label, colour, dash)
        self._series: list[tuple[str, str, str, str]] = [
            (line.key, line.label, line.color, LINE_DASH[line.kind])
            for line in gpu_series(self._gpus, self._sm, running)]
        self._series.append(("cpu_util", "CPU (all cores)", CPU_COLOR, "solid"))
        self._series.append(("proc_cpu", "this process (% of a core)", PROCESS_COLOR, "dotted"))

        self._x_end = INITIAL_SPAN_S
        self._x_range = Range1d(start=0, end=INITIAL_SPAN_S)
        # Every column percent_data gives (Bokeh streams only to a source's exact columns), drawn or not.
        keys = ["cpu_util", "proc_cpu", *(f"gpu{i}_{part}" for i in self._gpus for part in ("util", "mem")),
                *(f"gpu{i}_sm" for i in self._sm)]
        self.source = ColumnDataSource(data={"t": [], **{key: [] for key in keys}})
        self.bands = ColumnDataSource(data={"left": [], "right": []})
        fig = figure(
            height=230,
            sizing_mode="stretch_width",
            x_axis_label="seconds",
            y_axis_label="%",
            x_range=self._x_range,
            y_range=Range1d(start=0, end=105),
            tools="xpan,xwheel_zoom,box_zoom,reset,save",
            active_scroll=None,
            toolbar_location="right",
        )
        fig.toolbar.logo = None
        fig.tags = [LIVE_TAG]
        # Transparent: the notebook's own background shows through, light or dark.
        fig.background_fill_alpha = 0
        fig.border_fill_alpha = 0
        wait = fig.quad(left="left", right="right", bottom=0, top=105, source=self.bands,
                        fill_color=WAIT_COLOR, fill_alpha=0.3, line_alpha=0)
        # LegendItems, not (label, renderers) tuples: Bokeh converts those only while its property checks
        # are on, and a process where two threads imported bokeh at once can have them off (gpuwidget._warm_up).
        def item(label: str, renderer: Any) -> LegendItem:
            return LegendItem(label=value(label), renderers=[renderer])

        items = [item("waiting for data", wait)]
        for key, name, color, dash in self._series:
            items.append(item(name, fig.line("t", key, source=self.source, color=color, line_dash=dash,
                                             line_width=1.6)))
        legend = Legend(items=items, click_policy="hide", location="top_left", background_fill_alpha=0.6,
                        label_text_font_size="9pt", spacing=0,
                        padding=4)  # type: ignore[arg-type]  # bokeh's stubs reject a plain int
        fig.add_layout(legend, "right")
        self.figure = fig
        self.model = BokehModel(fig)
        self.header = ipywidgets.HTML(value=self._header_html(0.0, {}))
        # The per-rank table: hidden (no room taken) until a second process trains.
        self._strip = RankStrip(trace)
        self.rank_rows: list[RankRow] = []
        self._ranks_at = -math.inf
        self.ranks = ipywidgets.HTML(value="", layout=ipywidgets.Layout(display="none"))
        self.widget = ipywidgets.VBox([self.header, self.model, self.ranks])
        self.widget.add_class(LIVE_TAG)
        self.handle: Any = None

    def show(self) -> Any:
        """Display the widget (after :func:`ensure_bokehjs`, which also sends :data:`CLIENT_JS`) in the
        loader's own output, which has run its script by then: the cell gets one output, not two; returns
        its handle."""
        from IPython.display import DisplayHandle, display, update_display

        slot = take_loader_output()
        if slot is None:
            self.handle = display(self.widget, display_id=True)
        else:
            update_display(self.widget, display_id=slot)
            self.handle = DisplayHandle(slot)
        return self.handle

    # ---------------------------------------------------------------- updates

    def on_tick(self, trace: Trace) -> None:
        """Sampler-thread hook: push at most every PUSH_INTERVAL_S (FIRST_PUSH_INTERVAL_S at first)."""
        t = now()
        interval = FIRST_PUSH_INTERVAL_S if t - self._created < RESEND_WHOLE_S else PUSH_INTERVAL_S
        if t - self._last_push >= interval:
            self.push()

    def push(self) -> None:
        """Send what arrived since the last push (safe from any thread)."""
        with self._lock:
            if self._closed:
                return
            self._last_push = now()
            whole = (self._last_push - self._created < RESEND_WHOLE_S
                     or self._last_push - self._last_whole >= RESYNC_EVERY_S)
            columns = self._columns()
            frame = self.trace.recent_since(self._last_t, columns)
            if len(frame):
                self._last_t = float(frame.t[-1])
                if self._last_t > self._x_end:
                    self._x_end = max(2 * self._x_end, self._last_t)
                    self._x_range.end = self._x_end
                data = self._plot_data(frame)
                if whole or self._points + len(frame) > MAX_POINTS:
                    # Redraw the whole run, downsampled with spikes kept, then go on streaming.
                    full = self._plot_data(self.trace.plot_view(columns, MAX_POINTS // 2))
                    self.source.data = full
                    self._points = len(full["t"])
                    self._last_whole = self._last_push
                else:
                    self.source.stream(data)
                    self._points += len(frame)
            self._push_bands(whole)
            last = self.trace.last()
            self.header.value = self._header_html(self.trace.now(), last[1] if last else {})
            self._push_ranks()

    def close(self) -> None:
        """Final push, then stop updating. The widget is replaced by the run's report."""
        self.push()
        with self._lock:
            self._closed = True
        _close_tree(self.widget)

    def _columns(self) -> list[str]:
        return plot_columns(self._gpus, sm_active=self._sm)

    def _plot_data(self, frame: Frame) -> dict[str, Any]:
        return {"t": frame.t, **percent_data(frame, self._gpus, sm_active=self._sm)}

    def _push_bands(self, whole: bool = False) -> None:
        after = -math.inf if whole else self._last_band_end
        spans = self.trace.spans(DATA_WAIT_SPAN, t0=after)
        bands = merge_bands(spans, MERGE_GAP_S, after=after)
        keep = [(a, b) for a, b in bands if b - a >= MIN_BAND_S]
        if not keep:
            return
        self._last_band_end = keep[-1][1]
        # Arrays, not lists: BokehJS silently stops applying patches after a list is streamed
        # into this source (seen with bokeh 3.9 and jupyter_bokeh 4.1).
        new: dict[str, Any] = {"left": np.array([a for a, _ in keep]), "right": np.array([b for _, b in keep])}
        if whole or self._bands + len(keep) > MAX_BANDS:
            self.bands.data = new
            self._bands = len(keep)
        else:
            self.bands.stream(new)
            self._bands += len(keep)

    def _push_ranks(self) -> None:
        if self.rank_rows and now() - self._ranks_at < RANKS_INTERVAL_S:
            return
        self._ranks_at = now()
        rows = self._strip.update()
        if rows == self.rank_rows:
            return
        self.rank_rows = rows
        # ipywidgets sends a change only when the value differs; shown once there are rows, kept after.
        self.ranks.value = ranks_html(caption(self._strip), rows) if rows else ""
        if rows and self.ranks.layout.display == "none":
            self.ranks.layout.display = None

    def _header_html(self, elapsed: float, last: dict[str, float]) -> str:
        parts = [f"<b>gpuwidget</b> · watching {html.escape(self.label)} · {elapsed:5.1f} s"]
        figures = [html.escape(part) for part in status_parts(last, self._gpus, self._gpu_message, self._sm)]
        if not self._gpus:  # the no-GPU notice stands out (and may wrap: it is a sentence)
            figures[0] = f"<span style='color:#b35c00;white-space:normal'>{figures[0]}</span>"
        parts += figures
        # A label and its value stay on one line ("CPU 100%"): the line breaks between parts only.
        parts = [f"<span style='white-space:nowrap'>{part}</span>" for part in parts]
        # Bokeh's toolbar icons take their colour from this variable (it reaches into their shadow DOM).
        return (f"<style>.{LIVE_TAG}{{--bokeh-icon-color:var(--jp-ui-font-color2,#747679)}}</style>"
                "<div style='font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;"
                "color:var(--jp-ui-font-color1,#222)'>" + " &nbsp;|&nbsp; ".join(parts) + "</div>")


def ranks_html(title: str, rows: list[RankRow]) -> str:
    """The per-rank table: theme colours with fallbacks; the straggler's row is bold, coloured and
    marked in words."""
    table = "gpuwidget-live-ranks"
    head = "".join(f"<th scope='col'>{html.escape(name)}</th>" for name in RANK_COLUMNS)
    body = "".join(
        ("<tr class='straggler'>" if row.straggler else "<tr>")
        + "".join(f"<td>{html.escape(value)}</td>" for value in row.cells())
        + f"<td>{html.escape(row.note)}</td></tr>" for row in rows)
    return (f"<style>.{table}{{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;"
            f"border-collapse:collapse;color:var(--jp-ui-font-color1,#222);margin:2px 0 0 4px}}"
            f".{table} td,.{table} th,.{table} caption{{padding:0 12px 0 0;line-height:17px;text-align:right;"
            "white-space:nowrap}"
            f".{table} td:first-child,.{table} th:first-child,.{table} td:last-child{{text-align:left}}"
            f".{table} th,.{table} caption{{font-weight:normal;text-align:left;color:var(--jp-ui-font-color2,#777)}}"
            f".{table} tr.straggler{{font-weight:bold;color:var(--jp-warn-color0,#b35c00)}}</style>"
            f"<table class='{table}'><caption>{html.escape(title)}</caption>"
            f"<thead><tr>{head}<th></th></tr></thead><tbody>{body}</tbody></table>")


def _closed() -> None:
    """What close() becomes on a widget this module already closed."""


def _close_tree(widget: Any) -> None:
    """Close a widget, its children and their layout/style models (``close()`` alone leaks those)."""
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    for part in ("layout", "style"):
        model = getattr(widget, part, None)
        if model is not None and hasattr(model, "close"):
            model.close()
    widget.close()
    # ipywidgets calls close() again from __del__; jupyter_bokeh's BokehModel.close() raises
    # KeyError the second time (its document callback is already gone), printed as
    # "Exception ignored in Widget.__del__" under a later cell. Once is enough.
    widget.close = _closed
