"""The tuner's progress bar in a notebook: the callback the measuring code tells of each trial.

The measuring code (gpuwidget.measure) knows nothing of widgets; whoever shows a tuning in a
notebook (the --tune run, the panel's Measure button) passes it one of these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuwidget.measure.tuner import Trial, TrialCallback


class TuningProgress:
    """A bar over the time budget with the latest trial beside it, displayed when made."""

    def __init__(self, budget_s: float) -> None:
        import ipywidgets
        from IPython.display import display

        self._bar = ipywidgets.FloatProgress(value=0.0, min=0.0, max=budget_s, description="tuning",
                                             bar_style="info")
        self._label = ipywidgets.Label("")
        self._box: Any = ipywidgets.HBox([self._bar, self._label])
        display(self._box)

    def __call__(self, trial: Trial, elapsed_s: float) -> None:
        self._bar.value = min(elapsed_s, self._bar.max)
        self._label.value = f"{trial.label}: {trial.batches_per_s:.1f} batches/s"

    def close(self) -> None:
        for widget in (self._bar, self._label, self._box):
            widget.close()


@contextmanager
def tuning_progress(budget_s: float, show: bool) -> Iterator[TrialCallback | None]:
    """A :class:`TuningProgress` for the length of the block, closed however it ends; None when
    ``show`` is false or widgets are unavailable (the tuning runs the same without a bar)."""
    bar = None
    if show:
        try:
            bar = TuningProgress(budget_s)
        except Exception:  # noqa: BLE001 - no progress bar is fine
            bar = None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()
