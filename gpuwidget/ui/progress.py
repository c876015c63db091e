"""The tuner's progress bar in a notebook: the callback the measuring code tells of each trial.

The measuring code (gpuwidget.measure) knows nothing of widgets; whoever shows a tuning in a
notebook (the --tune run, the panel's Measure button) passes it one of these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuwidget.measure.tuner import Trial, TrialCallback, trial_line
from gpuwidget.report import fmt_seconds


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

    def planned(self, estimate_s: float, settings: int) -> None:
        """The tuner's plan: the bar runs over the time it announced, not the budget."""
        self._bar.max = max(estimate_s, 0.1)
        self._label.value = f"{settings} settings, about {fmt_seconds(estimate_s)}" if settings else \
            f"at most {fmt_seconds(estimate_s)}"

    def __call__(self, trial: Trial, elapsed_s: float) -> None:
        self.line(trial_line(trial), elapsed_s)

    def line(self, text: str, elapsed_s: float) -> None:
        """A measurement's progress (gpuwidget.measure.plan): what it is doing, seconds since it began."""
        self._bar.value = min(elapsed_s, self._bar.max)
        self._label.value = text

    def close(self) -> None:
        for widget in (self._bar, self._label, self._box):
            widget.close()


class DisplayProgress:
    """The same bar as a plain display updated in place (``update_display_data``): no widget,
    so it renders wherever outputs do, including outputs a front-end renders itself (Measure)."""

    def __init__(self, budget_s: float) -> None:
        import uuid

        from IPython.display import display

        self._budget_s = budget_s
        self._handle: Any = display(self._bundle(0.0, "starting"), raw=True,
                                    display_id=f"gpuwidget-tuning-{uuid.uuid4().hex}")

    def planned(self, estimate_s: float, settings: int) -> None:
        """The tuner's plan: the bar runs over the time it announced, not the budget."""
        self._budget_s = max(estimate_s, 0.1)
        self._handle.update(self._bundle(0.0, f"{settings} settings, about {fmt_seconds(estimate_s)}" if settings
                                         else f"at most {fmt_seconds(estimate_s)}"), raw=True)

    def _bundle(self, elapsed_s: float, label: str) -> dict[str, str]:
        import html

        done = min(elapsed_s, self._budget_s)
        text = f"tuning {fmt_seconds(done)} of {fmt_seconds(self._budget_s)}: {label}"
        return {"text/plain": text,
                "text/html": f"<div class='gpuwidget-tuning'><progress value='{done:.1f}' "
                             f"max='{self._budget_s:.1f}' aria-label='tuning'></progress> "
                             f"{html.escape(text)}</div>"}

    def __call__(self, trial: Trial, elapsed_s: float) -> None:
        self.line(trial_line(trial), elapsed_s)

    def line(self, text: str, elapsed_s: float) -> None:
        self._handle.update(self._bundle(elapsed_s, text), raw=True)

    def close(self) -> None:
        self._handle.update({"text/plain": ""}, raw=True)


@contextmanager
def tuning_progress(budget_s: float, show: bool, widgets: bool = True) -> Iterator[TrialCallback | None]:
    """A :class:`TuningProgress` (``widgets``) or :class:`DisplayProgress` for the length of the
    block, closed however it ends; None when ``show`` is false or it cannot be shown (the tuning
    runs the same without a bar)."""
    bar: TuningProgress | DisplayProgress | None = None
    if show:
        try:
            bar = TuningProgress(budget_s) if widgets else DisplayProgress(budget_s)
        except Exception:  # noqa: BLE001 - no progress bar is fine
            bar = None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()
