"""gpuwidget: see why the GPU waits while a notebook cell trains, and what to change.

In a notebook::

    %load_ext gpuwidget

    %%gpuwatch
    for x, y in train_loader:
        ...

Elsewhere: ``with gpuwidget.watch() as run: ...``, then ``gpuwidget.last_run()``.
Importing this package is cheap: torch, bokeh and NVML are only loaded when used.
"""

from __future__ import annotations

from typing import Any

from gpuwidget.advice.finding import Finding
from gpuwidget.run import Run
from gpuwidget.session import last_run, watch

__version__ = "0.1.0"
__all__ = ["Finding", "Run", "last_run", "load_ipython_extension", "watch"]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpuwidget``: register ``%%gpuwatch``."""
    from gpuwidget.magic import GpuWatchMagics, record_cell_info

    ipython.register_magics(GpuWatchMagics)
    callback = getattr(ipython, "_gpuwidget_pre_run_cell", None)
    if callback is None:
        def callback(info: Any) -> None:
            record_cell_info(ipython, info)

        ipython._gpuwidget_pre_run_cell = callback
        ipython.events.register("pre_run_cell", callback)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext gpuwidget``: nothing stays registered that a re-load would duplicate."""
    magics = ipython.magics_manager.magics.get("cell", {})
    magics.pop("gpuwatch", None)
    callback = getattr(ipython, "_gpuwidget_pre_run_cell", None)
    if callback is not None:
        ipython.events.unregister("pre_run_cell", callback)
        del ipython._gpuwidget_pre_run_cell
