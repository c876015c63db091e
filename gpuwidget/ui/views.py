"""Which live view a watch shows under the running cell (``--view``), and showing it.

``bokeh`` is the interactive plot (gpuwidget.ui.live), a jupyter_bokeh widget: JupyterLab
and Notebook render it with the widget manager they ship. ``static`` (gpuwidget.ui.static)
is a chart redrawn in place with plain display updates, for front-ends whose widgets
cannot work here. ``auto`` picks ``static`` where the kernel's environment names such a
front-end, ``bokeh`` elsewhere:

* VS Code's Jupyter extension renders third-party widgets only when its user allows a CDN
  (``jupyter.widgetScriptSources``), which an offline machine cannot use. The extension
  starts kernels with its own environment (it sets ``PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING``
  for Python kernels; ``VSCODE_PID``/``VSCODE_CWD`` come from its extension host). A
  server started from VS Code's terminal carries ``VSCODE_*`` too, with
  ``TERM_PROGRAM=vscode``: its kernels serve a browser, so that alone does not count.
  (``JPY_PARENT_PID`` says nothing: jupyter_client sets it for every kernel it starts.)
* Colab renders only widgets its own manager knows (custom ones need
  ``output.enable_custom_widget_manager()``); its kernel imports ``google.colab`` at start
  and runs with ``COLAB_*`` variables set.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from gpuwidget.facts import MachineFacts
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

VSCODE_KERNEL_VARS = ("PYDEVD_IPYTHON_COMPATIBLE_DEBUGGING",)
VSCODE_HOST_VARS = ("VSCODE_PID", "VSCODE_CWD", "VSCODE_IPC_HOOK")
COLAB_VARS = ("COLAB_RELEASE_TAG", "COLAB_BACKEND_VERSION", "COLAB_GPU", "COLAB_JUPYTER_IP")
BOKEH_MODULES = ("bokeh", "ipywidgets", "jupyter_bokeh")


def frontend(environ: Mapping[str, str] | None = None, modules: Mapping[str, Any] | None = None) -> str | None:
    """``"vscode"`` or ``"colab"`` when the kernel's environment names one of them, else None."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "google.colab" in modules or any(name in environ for name in COLAB_VARS):
        return "colab"
    if any(name in environ for name in VSCODE_KERNEL_VARS):
        return "vscode"
    if any(name in environ for name in VSCODE_HOST_VARS) and environ.get("TERM_PROGRAM") != "vscode":
        return "vscode"
    return None


def resolve_view(view: str, environ: Mapping[str, str] | None = None,
                 modules: Mapping[str, Any] | None = None) -> str:
    """The view ``--view`` asks for, ``auto`` made concrete for this kernel."""
    if view != "auto":
        return view
    if frontend(environ, modules) is not None:
        return "static"
    if any(importlib.util.find_spec(name) is None for name in BOKEH_MODULES):
        return "static"
    return "bokeh"


def show_live_view(view: str, trace: Trace, machine: MachineFacts, label: str = "") -> Any:
    """Display the live view ``view`` asks for; None for ``none``.

    The view has ``handle`` (its display, which the run's panel replaces), ``on_tick`` (the
    sampler-thread listener) and ``close()``. A Bokeh view that cannot be built (bokeh or
    jupyter_bokeh missing or broken) falls back to the static one.
    """
    chosen = resolve_view(view)
    if chosen == "none":
        return None
    if chosen == "bokeh":
        # Not while the extension's warm-up imports bokeh: two threads in bokeh's imports can switch its
        # property checks off for good (gpuwidget._warm_up).
        from gpuwidget import wait_for_warm_up

        wait_for_warm_up()
        try:
            from gpuwidget.ui.live import LiveView, ensure_bokehjs

            ensure_bokehjs()
            live = LiveView(trace, machine, label=label)
        except Exception as exc:  # noqa: BLE001 - a plain chart is better than none
            log.warning("gpuwidget: the Bokeh live plot is unavailable (%s); showing the static view", exc)
        else:
            live.show()
            return live
    from gpuwidget.ui.static import StaticView

    static = StaticView(trace, machine, label=label)
    static.show()
    return static
