"""Buttons under the post-run panel: measure the suggested DataLoader settings on the user's loader.

Clicks are served once the cell has finished (the kernel is idle then), so the tuner runs
in the kernel like any cell would, and its table replaces the button.

A widget lives only as long as its kernel: a saved notebook reopened later has no model
behind a widget's output and JupyterLab shows "Error displaying widget: model not found"
there. So the button never stays in the notebook as a bare widget: its output carries a
plain text/HTML fallback (what sanitizing and widget-less front-ends show), and it is
replaced by static content once it has done its work (the measured table) or once the
next cell runs (a note saying how to measure again).
"""

from __future__ import annotations

import contextlib
import html
import uuid
import weakref
from typing import Any

RETIRED_NOTE = ("Measuring the suggested DataLoader settings was offered here after {label}. "
                "To measure them, run that cell again with %%gpuwatch --tune.")
FALLBACK_NOTE = ("A 'Measure the suggested settings' button was here; it works while the kernel that "
                 "ran the cell is running. To measure them, run the cell again with %%gpuwatch --tune.")


def _note_bundle(text: str) -> dict[str, str]:
    return {"text/plain": text,
            "text/html": f"<div class='gpuwidget-measure-note' style='font-size:12px;margin:2px 0'>"
                         f"{html.escape(text)}</div>"}


class MeasureOffer:
    """The Measure button for one run, shown with ``display()``; retires itself to static content."""

    def __init__(self, run: Any, loader: Any) -> None:
        import ipywidgets

        self.run = run
        self.display_id = f"gpuwidget-measure-{uuid.uuid4().hex}"
        self.retired = False
        self._loader = weakref.ref(loader)
        self.button = ipywidgets.Button(
            description="Measure the suggested settings", icon="tachometer", layout=ipywidgets.Layout(width="auto"),
            tooltip="Time candidate DataLoader settings on this loader (about 20 s)")
        self.output = ipywidgets.Output()
        self.box = ipywidgets.VBox([self.button, self.output])
        self.button.on_click(self._clicked)
        self._shell: Any = None

    def _ipython_display_(self) -> None:
        """Publish the widget with its fallback, and retire it when the next cell starts."""
        from IPython import get_ipython
        from IPython.display import publish_display_data

        bundle: dict[str, Any] = {**_note_bundle(FALLBACK_NOTE), **self.box._repr_mimebundle_()}
        bundle["text/plain"] = FALLBACK_NOTE  # not the widget's repr ("VBox(children=(Button(...")
        publish_display_data(bundle, transient={"display_id": self.display_id})
        self._shell = get_ipython()
        if self._shell is not None:
            self._shell.events.register("pre_run_cell", self._next_cell)

    def _next_cell(self, *_: Any) -> None:
        label = getattr(self.run, "label", "") or "the watched cell"
        self.retire(_note_bundle(RETIRED_NOTE.format(label=label)))

    def retire(self, bundle: dict[str, Any]) -> None:
        """Replace the button's output by ``bundle`` and close its widgets (idempotent)."""
        if self.retired:
            return
        self.retired = True
        if self._shell is not None:
            with contextlib.suppress(ValueError):
                self._shell.events.unregister("pre_run_cell", self._next_cell)
        from IPython.display import publish_display_data

        publish_display_data(bundle, transient={"display_id": self.display_id}, update=True)
        for widget in (self.button, self.output, self.box):
            # With their layout and style models: close() alone leaves those open in the kernel.
            for part in (getattr(widget, "layout", None), getattr(widget, "style", None), widget):
                if part is not None:
                    part.close()

    def _clicked(self, _: Any) -> None:
        from IPython.display import display

        from gpuwidget.measure.tuner import DEFAULT_BUDGET_S, tune_for_run
        from gpuwidget.ui.progress import tuning_progress

        current = self._loader()
        self.button.disabled = True
        with self.output:
            if current is None:
                print("The loader no longer exists; run the watched cell again.")
                return
            try:
                with tuning_progress(DEFAULT_BUDGET_S, show=True) as progress:
                    self.run.tuning = tune_for_run(self.run, current, DEFAULT_BUDGET_S, progress)
            except Exception as exc:  # noqa: BLE001 - shown to the user, not raised into the widget
                print(f"Could not measure: {exc}")
                self.button.disabled = False
                return
        try:
            # The measured table, static: it stays readable in the saved notebook.
            self.retire(self.run.tuning._repr_mimebundle_())
        except Exception:  # noqa: BLE001 - never leave the user without the result
            with self.output:
                display(self.run.tuning)


def measure_button(run: Any, loader: Any) -> MeasureOffer:
    """A Measure button that runs the tuner for ``loader`` against ``run``'s measurements."""
    return MeasureOffer(run, loader)
