"""Buttons under the post-run panel: measure the suggested DataLoader settings on the user's loader.

Clicks are served once the cell has finished (the kernel is idle then), so the tuner runs
in the kernel like any cell would, and its table replaces the button.
"""

from __future__ import annotations

import weakref
from typing import Any


def measure_button(run: Any, loader: Any) -> Any:
    """A button that runs the tuner for ``loader`` against ``run``'s measurements, or None."""
    import ipywidgets
    from IPython.display import display

    from gpuwidget.measure.tuner import DEFAULT_BUDGET_S, tune_for_run
    from gpuwidget.ui.progress import tuning_progress

    loader_ref = weakref.ref(loader)
    button = ipywidgets.Button(description="Measure the suggested settings", icon="tachometer",
                               layout=ipywidgets.Layout(width="auto"),
                               tooltip="Time candidate DataLoader settings on this loader (about 20 s)")
    output = ipywidgets.Output()
    box = ipywidgets.VBox([button, output])

    def clicked(_: Any) -> None:
        current = loader_ref()
        button.disabled = True
        with output:
            if current is None:
                print("The loader no longer exists; run the watched cell again.")
                return
            try:
                with tuning_progress(DEFAULT_BUDGET_S, show=True) as progress:
                    run.tuning = tune_for_run(run, current, DEFAULT_BUDGET_S, progress)
            except Exception as exc:  # noqa: BLE001 - shown to the user, not raised into the widget
                print(f"Could not measure: {exc}")
                button.disabled = False
                return
            display(run.tuning)
        button.layout.display = "none"

    button.on_click(clicked)
    return box
