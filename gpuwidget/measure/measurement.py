"""Measurement: what trying one change in the user's own training step gave, as data that renders itself."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

from gpuwidget.measure.changes import TrialChange, describe
from gpuwidget.report import fmt_seconds, html_table, text_table

# The numerics line says "loss within N%" up to this relative difference, else "loss differs by N%".
LOSS_WITHIN = 0.01


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def fmt_share(value: float | None) -> str:
    """A relative difference: 0.3%, 0.004%, 12%."""
    if value is None or not math.isfinite(value):
        return "n/a"
    percent = 100 * value
    return f"{percent:.2g}%" if percent < 1 else f"{percent:.1f}%" if percent < 10 else f"{percent:.0f}%"


class SavedMeasurement(TypedDict):
    """A Measurement as a saved run keeps it with its finding (:meth:`Measurement.to_dict`)."""

    change: TrialChange
    speedup: float | None
    ci: list[float] | None
    verdict: str
    peak_memory_ratio: float | None
    numerics: dict[str, float | None]
    notes: list[str]
    blocks: int
    coverage: float | None
    ratios: list[float]
    elapsed_s: float
    decided_s: float | None
    compile_s: float | None
    budget_s: float
    device: str
    loss: str
    rates: list[float] | None
    interrupted: bool
    bound: float | None


@dataclass
class Measurement:
    """One change measured against the step as it is.

    ``speedup``: the median over ABBA blocks of the changed step's throughput (samples/s) over the
    unchanged one's; ``ci``: its 95% interval (gpuwidget.measure.stats: the sign-test interval for a
    median); ``verdict``: ``"faster"``, ``"slower"`` or ``"no difference"``, from the interval
    (always "no difference" for a change that runs the same code on this device, gpuwidget.measure.ab);
    ``peak_memory_ratio``: the changed step's peak memory over the unchanged one's (CUDA's peak
    counter; None on the CPU); ``numerics``: ``loss_rel_diff`` and ``grad_rel_diff`` after the same
    steps from the same state and batches (None where they cannot be compared); ``notes``.
    """

    change: TrialChange
    speedup: float | None
    ci: tuple[float, float] | None
    verdict: str
    peak_memory_ratio: float | None = None
    numerics: dict[str, float | None] = field(default_factory=lambda: {"loss_rel_diff": None, "grad_rel_diff": None})
    notes: list[str] = field(default_factory=list)
    blocks: int = 0
    coverage: float | None = None  # the interval's actual coverage (>= 0.95 from 6 blocks)
    ratios: list[float] = field(default_factory=list)  # each block's ratio, in order
    elapsed_s: float = 0.0
    decided_s: float | None = None  # when the verdict was first what it ended as, for the last time
    compile_s: float | None = None
    budget_s: float = 0.0
    device: str = "cpu"
    loss: str = ""  # how the loss was found (gpuwidget.measure.loss)
    rates: tuple[float, float] | None = None  # median samples/s unchanged, changed
    interrupted: bool = False
    bound: float | None = None  # the finding's expected_speedup, when measured for one

    @property
    def half_width(self) -> float | None:
        if self.ci is None or not self.speedup:
            return None
        return (self.ci[1] - self.ci[0]) / 2 / self.speedup

    @property
    def recommended(self) -> bool:
        return self.verdict == "faster"

    # ---------------------------------------------------------------- lines

    def numerics_line(self) -> str:
        loss = self.numerics.get("loss_rel_diff")
        if loss is None:
            return "numerics not compared"
        if loss <= LOSS_WITHIN:
            return f"loss within {fmt_share(max(loss, 0.0) or 0.0) if loss > 0 else '0%'}"
        return f"loss differs by {fmt_share(loss)}"

    def short(self) -> str:
        """``measured 1.31x [1.24, 1.38], loss within 0.3%`` (or why nothing was measured)."""
        if self.speedup is None or self.ci is None:
            return "not measured" + (" (interrupted)" if self.interrupted else "")
        return f"measured {fmt_ratio(self.speedup)} [{self.ci[0]:.2f}, {self.ci[1]:.2f}], {self.numerics_line()}"

    def verdict_line(self) -> str:
        """The verdict in words, with why a change is not recommended."""
        what = describe(self.change)
        if self.verdict == "faster":
            return f"{what}: faster, {self.short()}"
        if self.verdict == "slower":
            return (f"{what}: slower on {self.device} ({self.short()}): not recommended here, it costs "
                    f"{fmt_share(1 - (self.speedup or 1))} of the throughput")
        if self.ci is not None and self.ci[0] <= 1.0 <= self.ci[1]:
            why = "the interval spans 1" + ("" if self.interrupted else ", within the budget")
        else:
            why = "the difference is under 2%"
        return f"{what}: no difference on {self.device} ({self.short()}; {why}): not worth adopting for speed"

    def headline(self) -> str:
        """The line a finding shows: ``up to 1.8x (bound) · measured 1.31x [1.24, 1.38], loss within 0.3%``,
        and for a change that did not gain, why it is not recommended."""
        bound = f"up to {fmt_ratio(self.bound)} (bound) \u00b7 " if self.bound else ""
        line = bound + self.short()
        if self.verdict == "slower":
            line += f": slower on {self.device}, not recommended here"
        elif self.verdict == "no difference" and self.ci is not None:
            line += f": no measurable gain on {self.device}, not recommended for speed"
        if self.interrupted:
            line += " (interrupted)"
        return line

    # ---------------------------------------------------------------- data

    def to_dict(self) -> SavedMeasurement:
        return {
            "change": TrialChange(**self.change), "speedup": self.speedup, "ci": list(self.ci) if self.ci else None,
            "verdict": self.verdict, "peak_memory_ratio": self.peak_memory_ratio, "numerics": dict(self.numerics),
            "notes": list(self.notes), "blocks": self.blocks, "coverage": self.coverage, "ratios": list(self.ratios),
            "elapsed_s": self.elapsed_s, "decided_s": self.decided_s, "compile_s": self.compile_s,
            "budget_s": self.budget_s, "device": self.device, "loss": self.loss,
            "rates": list(self.rates) if self.rates else None, "interrupted": self.interrupted, "bound": self.bound,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Measurement:
        """Rebuilt from :meth:`to_dict` (a saved run's finding)."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for key in ("ci", "rates"):
            if known.get(key) is not None:
                known[key] = tuple(known[key])
        return cls(**{"change": {}, "speedup": None, "ci": None, "verdict": "no difference", **known})

    def rows(self) -> list[list[str]]:
        memory = fmt_ratio(self.peak_memory_ratio) if self.peak_memory_ratio is not None else "n/a (CPU)"
        unchanged, changed = self.rates if self.rates else (None, None)
        return [[describe(self.change), self.verdict, fmt_ratio(self.speedup),
                 f"[{self.ci[0]:.2f}, {self.ci[1]:.2f}]" if self.ci else "n/a",
                 f"{unchanged:,.1f} -> {changed:,.1f}" if unchanged and changed else "n/a",
                 memory, fmt_share(self.numerics.get("loss_rel_diff")), fmt_share(self.numerics.get("grad_rel_diff")),
                 f"{self.blocks} in {fmt_seconds(self.elapsed_s)}"]]

    HEADERS = ("change", "verdict", "speed-up", "95% interval", "samples/s", "peak memory", "loss diff",
               "grad diff", "blocks")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self._repr_html_()}

    def text(self) -> str:
        lines = [self.verdict_line(), *text_table(self.HEADERS, self.rows())]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        notes = "".join(f"<li>{html.escape(note)}</li>" for note in self.notes)
        return (f"<div class='gpuwidget-measurement' data-verdict='{html.escape(self.verdict)}'>"
                f"<div>{html.escape(self.verdict_line())}</div>"
                f"{html_table(self.HEADERS, self.rows(), [self.recommended])}"
                + (f"<ul style='margin:2px 0;font-size:12px'>{notes}</ul>" if notes else "") + "</div>")

    def __repr__(self) -> str:
        return f"<gpuwidget Measurement {describe(self.change)}: {self.verdict}, {self.short()}>"
