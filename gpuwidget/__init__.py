"""gpuwidget: see why the GPU waits while a notebook cell trains, and what to change.

In a notebook::

    %load_ext gpuwidget

    %%gpuwatch
    for x, y in train_loader:
        ...

Elsewhere: ``with gpuwidget.watch() as run: ...``, then ``gpuwidget.last_run()``.
Importing this package is cheap: torch, bokeh and NVML are only loaded when used, and the
measuring functions (``tune_loader``, ``probe_batch_size``) when first looked up (PEP 562).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from gpuwidget._labext import DISTRIBUTION_NAME, _jupyter_labextension_paths
from gpuwidget.advice.finding import Finding
from gpuwidget.run import Run
from gpuwidget.session import last_run, watch

if TYPE_CHECKING:
    from gpuwidget.measure.batch_probe import probe_batch_size
    from gpuwidget.measure.tuner import tune_loader

try:
    # Written by hatch's version hook at build/install time (from package.json), not tracked.
    from gpuwidget._version import __version__
except ImportError:  # a source tree never built: the installed metadata, if there is any
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version(DISTRIBUTION_NAME)
    except PackageNotFoundError:
        __version__ = "0+unknown"

# Public names re-exported from the module that defines them, imported on first use.
_LAZY = {"tune_loader": "gpuwidget.measure.tuner", "probe_batch_size": "gpuwidget.measure.batch_probe"}

__all__ = [
    "Finding",
    "Run",
    "probe_batch_size",
    "tune_loader",
    "_jupyter_labextension_paths",
    "_jupyter_server_extension_points",
    "last_run",
    "load_bokehjs",
    "load_ipython_extension",
    "watch",
]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """Where jupyter_server finds the extension (gpuwidget.server, imported only by the server)."""
    return [{"module": "gpuwidget.server"}]


def __getattr__(name: str) -> Any:
    """``gpuwidget.tune_loader`` and ``gpuwidget.probe_batch_size``: the functions themselves."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuwidget' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load_bokehjs() -> None:
    """Send BokehJS to the page again (inline, no network), e.g. if a live plot shows an error."""
    from gpuwidget.ui.live import ensure_bokehjs

    ensure_bokehjs(force=True)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpuwidget``: register ``%%gpuwatch``."""
    from gpuwidget.magic import GpuWatchMagics, check_cell_syntax, record_cell_info

    ipython.register_magics(GpuWatchMagics)
    # First the wait for the warm-up's imports (before any cell runs), then the syntax check.
    for position, transformer in enumerate((warm_up_first, check_cell_syntax)):
        if transformer not in ipython.input_transformers_cleanup:
            ipython.input_transformers_cleanup.insert(position, transformer)
    callback = getattr(ipython, "_gpuwidget_pre_run_cell", None)
    if callback is None:
        def callback(info: Any) -> None:
            cell_started()
            record_cell_info(ipython, info)

        ipython._gpuwidget_pre_run_cell = callback
        ipython.events.register("pre_run_cell", callback)
        _warm_up()


# The thread _warm_up imports on: a caller that must not race its imports (they add modules and
# loggers) waits for it with wait_for_warm_up().
WARM_UP_THREAD = "gpuwidget-warm-up"
# How long the first watched cell waits for those imports before it goes on without them.
WARM_UP_WAIT_S = 30.0


def _bokeh_validates() -> bool:
    """Whether Bokeh checks and converts property values now (True before bokeh is imported)."""
    module = sys.modules.get("bokeh.core.property.bases")
    return True if module is None else bool(module.Property._should_validate)


def _warm_up() -> None:
    """Import the live view's libraries in the background, so the first watched cell
    shows its plot without waiting for bokeh's import (about a second); start the reader
    process where ``GPUWIDGET_READER=process`` asks for it (gpuwidget.sources.reader).

    Bokeh switches its property checks off process-wide while it defines a model class or a
    glyph method (``bokeh.core.property.validation.validate``: a flag, set and restored, not a
    count). Two threads importing bokeh at once can leave it off for good: then ``Legend(items=
    [(label, renderers)])`` keeps its tuples and BokehJS refuses the plot (fresh-check run 81,
    CI). So no cell starts while this thread imports: the extension's first input transformer
    waits for it (warm_up_first; the imports take a second or a few, once per kernel). What the cell that
    loaded the extension runs after ``%load_ext``, or a thread of the user's, is not ours to hold:
    the checks are put back on afterwards where they were on when the extension loaded and these
    imports left them off (a block of the user's that is still open then can still leave them off:
    bokeh's flag is not a count).
    """
    import threading

    validated = _bokeh_validates()

    def imports() -> None:
        try:
            import ipywidgets  # noqa: F401
            import jupyter_bokeh  # noqa: F401
            from bokeh import plotting  # noqa: F401

            import gpuwidget.sources.host  # noqa: F401
            import gpuwidget.ui.live  # noqa: F401
            from gpuwidget.sources.reader import reader_choice, shared_reader

            if reader_choice() == "process":
                shared_reader()  # started now: the first watched cell does not wait for it
        except Exception:  # noqa: BLE001, S110 - the watch imports them again and reports failures
            pass
        finally:
            if validated and not _bokeh_validates():
                from bokeh.core.property.bases import Property

                Property._should_validate = True

    threading.Thread(target=imports, name=WARM_UP_THREAD, daemon=True).start()


# What a cell runs instead of its own code when Ctrl-C stopped the wait for the warm-up before it.
INTERRUPTED_BEFORE_THE_CELL = "raise KeyboardInterrupt  # Ctrl-C before the cell ran, while gpuwidget was loading\n"
_interrupted_before_the_cell = False


def warm_up_first(lines: list[str]) -> list[str]:
    """IPython input transformer (cleanup stage, first): no cell starts while the warm-up imports.

    A Ctrl-C during the wait stops the cell as a Ctrl-C at its first line would: the cell's code does
    not run and the user sees a KeyboardInterrupt. (Waited for in a ``pre_run_cell`` hook instead,
    IPython reported the interrupt as an error of the hook and then ran the cell anyway.)
    """
    global _interrupted_before_the_cell
    if not _interrupted_before_the_cell:
        try:
            wait_for_warm_up()
        except KeyboardInterrupt:
            _interrupted_before_the_cell = True
    # ipykernel transforms each cell twice (once to tell whether it runs async, then in run_cell): both
    # get the interrupted cell, until the cell starts (the pre_run_cell hook, cell_started).
    return [INTERRUPTED_BEFORE_THE_CELL] if _interrupted_before_the_cell else lines


def cell_started() -> None:
    """``pre_run_cell``: the cell interrupted while it waited for the warm-up (if any) is the one running."""
    global _interrupted_before_the_cell
    _interrupted_before_the_cell = False


# Run only when a cell is executed, not when a console asks whether the cell typed so far is complete.
warm_up_first.has_side_effects = True  # type: ignore[attr-defined]


def wait_for_warm_up(timeout: float = WARM_UP_WAIT_S) -> None:
    """Wait (at most ``timeout`` s) for _warm_up's imports, if they are still running."""
    import threading

    for thread in threading.enumerate():
        if thread.name == WARM_UP_THREAD and thread is not threading.current_thread():
            thread.join(timeout)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext gpuwidget``: nothing stays registered that a re-load would duplicate."""
    magics = ipython.magics_manager.magics.get("cell", {})
    magics.pop("gpuwatch", None)
    callback = getattr(ipython, "_gpuwidget_pre_run_cell", None)
    if callback is not None:
        ipython.events.unregister("pre_run_cell", callback)
        del ipython._gpuwidget_pre_run_cell
    from gpuwidget.magic import check_cell_syntax

    for transformer in (warm_up_first, check_cell_syntax):
        while transformer in ipython.input_transformers_cleanup:
            ipython.input_transformers_cleanup.remove(transformer)
