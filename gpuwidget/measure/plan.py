"""--tune and the panel's Measure: every finding's change measured in the cell's own step within one budget,
then the best set of them measured together (gains do not multiply).

In order: the DataLoader tuner's search on the cell's loader (gpuwidget.measure.tuner: worker counts
from the loader's own upwards); each finding's trialable change (``Finding.trial_changes``: fp32-math's TF32
and bfloat16 autocast, launch-bound's compile, small-batch's batch size, the loader findings' settings)
with ``Run.measure``; then, when two or more findings measured faster, all of their best changes
together. The budget is split evenly among what is left to do, so a measurement that decides early
leaves its time to the next. Each finding keeps its measurement (``finding.measured``), and the panel
shows it beside the bound.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from gpuwidget.clock import now
from gpuwidget.measure.changes import LOADER_KEYS, TrialChange, describe
from gpuwidget.measure.measurement import Measurement, fmt_ratio, fmt_share
from gpuwidget.measure.sides import MeasureError
from gpuwidget.report import fmt_seconds, html_table, text_table

if TYPE_CHECKING:
    from gpuwidget.advice.finding import Finding

# Seconds per measured change, and the tuner's share, when the caller gives no budget.
PER_CHANGE_S = 15.0
TUNER_S = 20.0


@dataclass
class MeasuredChange:
    """One finding's change and what measuring it gave (or why it could not be measured)."""

    rule: str
    change: TrialChange
    measurement: Measurement | None = None
    error: str | None = None
    bound: float | None = None


@dataclass
class MeasurePlan:
    """Every finding's change measured, the combination, and the choice."""

    items: list[MeasuredChange]
    combined: Measurement | None = None
    tuning: Any = None  # the tuner's TuneResult, for a loader finding
    budget_s: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> tuple[TrialChange, Measurement] | None:
        """The change to adopt: the combination if it measured faster than the best single change's
        interval allows, else the fastest single change measured faster; None when nothing was faster."""
        faster = [i.measurement for i in self.items if i.measurement is not None and i.measurement.verdict == "faster"]
        best = max(faster, key=lambda m: m.speedup or 0.0, default=None)
        combined = self.combined
        if combined is not None and combined.verdict == "faster" and (
                best is None or (combined.speedup or 0) > (best.ci[1] if best.ci else 0)):
            return combined.change, combined
        return (best.change, best) if best is not None else None

    def summary(self) -> str:
        chosen = self.chosen
        spent = f"{len(self.items)} change(s) in {fmt_seconds(self.elapsed_s)} of a {fmt_seconds(self.budget_s)} budget"
        if chosen is None and self.items and all(item.measurement is None for item in self.items):
            # Nothing was measured: saying "none was faster" would claim a measurement that never ran.
            reason = next((item.error for item in self.items if item.error), "no change could be tried")
            return f"Measured none of {len(self.items)} change(s): {reason}."
        if chosen is None:
            return f"Measured {spent}: none was faster in this step; keep the step as it is."
        change, measured = chosen
        together = " (together)" if measured is self.combined else ""
        return f"Measured {spent}. Adopt {describe(change)}{together}: {measured.short()}."

    def rows(self) -> list[list[str]]:
        rows = []
        for item in self.items:
            m = item.measurement
            if m is None:
                rows.append([item.rule, describe(item.change), "not measured", "", "", "", item.error or ""])
                continue
            bound = f"up to {fmt_ratio(item.bound)}" if item.bound else ""
            rows.append([item.rule, describe(item.change), m.verdict, fmt_ratio(m.speedup),
                         f"[{m.ci[0]:.2f}, {m.ci[1]:.2f}]" if m.ci else "n/a", bound,
                         fmt_share(m.numerics.get("loss_rel_diff"))])
        if self.combined is not None:
            m = self.combined
            rows.append(["together", describe(m.change), m.verdict, fmt_ratio(m.speedup),
                         f"[{m.ci[0]:.2f}, {m.ci[1]:.2f}]" if m.ci else "n/a", "",
                         fmt_share(m.numerics.get("loss_rel_diff"))])
        return rows

    HEADERS = ("finding", "change", "verdict", "measured", "95% interval", "bound", "loss diff")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        rows = self.rows()
        chosen = self.chosen
        marks = [chosen is not None and row[1] == describe(chosen[0]) and row[2] == "faster" for row in rows]
        why = [m.verdict_line() for m in self._measurements() if m.verdict != "faster"]
        tuning = self.tuning._repr_mimebundle_() if self.tuning is not None else {}
        text = [self.summary(), "", *text_table(self.HEADERS, rows), *why, *self.notes]
        if tuning:
            text += ["", tuning["text/plain"]]
        page = (f"<div class='gpuwidget-plan'><div>{html.escape(self.summary())}</div>"
                f"{html_table(self.HEADERS, rows, marks)}"
                + "".join(f"<div style='font-size:12px'>{html.escape(line)}</div>" for line in why + self.notes)
                + tuning.get("text/html", "") + "</div>")
        return {"text/plain": "\n".join(text), "text/html": page}

    def _measurements(self) -> list[Measurement]:
        found = [i.measurement for i in self.items if i.measurement is not None]
        return found + ([self.combined] if self.combined is not None else [])


def plan_budget(run: Any) -> float:
    """The seconds :func:`measure_findings` will take for ``run`` when given no budget (what a button
    announces): the run's ``--budget`` where it set one, else :data:`TUNER_S` for the loader and
    :data:`PER_CHANGE_S` per change (and one more for the best set together); 0 with nothing to measure."""
    changes = sum(len(f.trial_changes()) for f in run.findings)
    tuner = TUNER_S if _tunes(run) else 0.0
    planned = tuner + PER_CHANGE_S * (changes + (1 if changes >= 2 else 0))
    chosen = getattr(getattr(run, "options", None), "budget", None)
    return float(chosen) if planned and chosen else planned


def _tunes(run: Any) -> bool:
    """The tuner searches the cell's loader whenever one fed it (as --tune always did)."""
    subjects = getattr(run, "subjects", None)
    return bool(subjects is not None and subjects.loaders)


def measure_findings(run: Any, budget_s: float | None = None, progress: Callable[[str, float], None] | None = None,
                     tuner_progress: Any = None) -> MeasurePlan:
    """Measure every finding of ``run`` that has a trialable change, then the best set together (module
    docstring). ``progress(line, elapsed_s)`` hears of each; ``tuner_progress`` is the tuner's callback."""
    budget = plan_budget(run) if budget_s is None else float(budget_s)
    started = now()
    todo: list[tuple[Finding, TrialChange]] = [(f, c) for f in run.findings for c in f.trial_changes()]
    tunes = _tunes(run)
    left = len(todo) + (1 if tunes else 0) + (1 if len(todo) >= 2 else 0)
    plan = MeasurePlan([], budget_s=budget)

    def share() -> float:
        nonlocal left
        remaining = max(1.0, budget - (now() - started))
        part = remaining / max(1, left)
        left -= 1
        return part

    if tunes:
        from gpuwidget.measure.tuner import tune_for_run

        try:
            plan.tuning = tune_for_run(run, run.subjects.loaders[0], min(TUNER_S, share()), tuner_progress)
        except Exception as exc:  # noqa: BLE001 - the loader's own measurement follows anyway
            plan.notes.append(f"the DataLoader tuner could not measure the loader: {exc}")
    for finding, change in todo:
        item = MeasuredChange(finding.rule, change, bound=finding.expected_speedup)
        plan.items.append(item)
        label = f"{finding.rule}: {describe(change)}"
        if progress is not None:
            progress(label, now() - started)
        try:
            item.measurement = run.measure(change, budget_s=share(), progress=_told(progress, label, started))
        except (MeasureError, ValueError) as exc:
            item.error = str(exc)
            continue
        item.measurement.bound = finding.expected_speedup
        kept = finding.measured
        if kept is None or (item.measurement.speedup or 0) > (kept.speedup or 0):
            object.__setattr__(finding, "measured", item.measurement)
        if item.measurement.interrupted:
            plan.notes.append("interrupted: the changes after this one were not measured")
            break
    plan.combined = _together(run, plan, share, progress, started)
    plan.elapsed_s = now() - started
    return plan


def _told(progress: Callable[[str, float], None] | None, label: str, started: float) -> Any:
    if progress is None:
        return None
    return lambda line, _elapsed: progress(f"{label}: {line}", now() - started)


def _together(run: Any, plan: MeasurePlan, share: Callable[[], float], progress: Any,
              started: float) -> Measurement | None:
    """The best faster change of each finding, measured together (where two or more findings gained)."""
    best: dict[str, Measurement] = {}
    for item in plan.items:
        m = item.measurement
        if m is not None and m.verdict == "faster" and (item.rule not in best
                                                       or (m.speedup or 0) > (best[item.rule].speedup or 0)):
            best[item.rule] = m
    if len(best) < 2 or any(i.measurement is not None and i.measurement.interrupted for i in plan.items):
        return None
    merged: dict[str, object] = {}
    for m in best.values():
        for key, value in m.change.items():
            if key in LOADER_KEYS and key in merged and merged[key] != value:
                continue  # two loader findings: the first (the larger gain) keeps its setting
            merged.setdefault(key, value)
    label = f"together: {describe(merged)}"
    try:
        return run.measure(cast(TrialChange, merged), budget_s=share(), progress=_told(progress, label, started))
    except (MeasureError, ValueError) as exc:
        plan.notes.append(f"the changes together could not be measured: {exc}")
        return None
