"""Finding: one named cause of GPU idle time, with its evidence, the change and the gain bound."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuwidget.report import finding_html, finding_text

Severity = Literal["info", "warn", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warn", "critical")
# Causes that lie in the machine, not in the user's code: other processes holding the cores, a GPU
# slowed by heat or a lowered power limit. They rank by their gain like any other, and say whose they are.
MACHINE_RULES = frozenset({"cpu-contention", "gpu-throttled"})
# A gain under this shows as 1.00x: nothing to gain that the measurement can tell (the loop's timers
# are good to a few ms over the second a cause needs, advice.evidence.MIN_CAUSE_LOOP_S: half a percent).
NOTHING_TO_GAIN = 1.005


@dataclass(frozen=True)
class Finding:
    """What the advisor concluded about one cause.

    ``rule`` is a stable id (see DESIGN.md); ``evidence`` holds the measured figures the
    conclusion rests on; ``change`` is structured (e.g. ``{"num_workers": 6}``) and
    ``code`` a copyable snippet using the user's own names; ``expected_speedup`` is what
    this finding's change can gain by the measurement (``1.8`` means 1.8x faster), or
    None when the measurement gives no bound.
    """

    rule: str
    severity: Severity
    title: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    suggestion: str = ""
    change: Mapping[str, Any] = field(default_factory=dict)
    code: str = ""
    expected_speedup: float | None = None
    # What Finding.measure (or --tune) measured of this finding's change: a Measurement, or None.
    measured: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if self.expected_speedup is not None and not self.expected_speedup >= 1.0:
            raise ValueError(f"expected_speedup is a bound >= 1.0, not {self.expected_speedup!r}")

    @property
    def machine_level(self) -> bool:
        """The cause is the machine's (its cores, its GPU's clocks), not a change to the user's code."""
        return self.rule in MACHINE_RULES

    @property
    def nothing_to_gain(self) -> bool:
        """Its change gains nothing the measurement can tell (``expected_speedup`` under 1.005)."""
        return self.expected_speedup is not None and self.expected_speedup < NOTHING_TO_GAIN

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "title": self.title,
            "evidence": dict(self.evidence),
            "suggestion": self.suggestion,
            "change": dict(self.change),
            "code": self.code,
            "expected_speedup": self.expected_speedup,
            **({"measured": self.measured.to_dict()} if self.measured is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            rule=data["rule"],
            severity=data["severity"],
            title=data["title"],
            evidence=dict(data.get("evidence") or {}),
            suggestion=data.get("suggestion", ""),
            change=dict(data.get("change") or {}),
            code=data.get("code", ""),
            expected_speedup=data.get("expected_speedup"),
            measured=_measurement(data.get("measured")),
        )

    def trial_changes(self) -> list[dict[str, Any]]:
        """The changes that try this finding's suggestion in a training step (gpuwidget.measure.changes),
        the one its bound refers to first; [] when its change is not one a step can try."""
        from gpuwidget.measure.changes import finding_changes

        return finding_changes(self.rule, self.change)

    def measure(self, budget_s: float = 30.0, step: Any = None, progress: Any = None) -> Any:
        """Measure this finding's own change in its run's training step (``Run.measure``); the
        Measurement is also kept on the finding (``.measured``), which then shows the bound beside it."""
        changes = self.trial_changes()
        if not changes:
            raise ValueError(f"{self.rule}'s change ({dict(self.change) or 'none'}) is not one a training step can "
                             "try: it is measured by running the cell again with it")
        owner = getattr(self, "_run", None)
        run = owner() if owner is not None else None
        if run is None:
            from gpuwidget.measure.sides import MeasureError

            raise MeasureError("this finding's run is not in this process (a loaded run): run the cell again")
        measurement = run.measure(changes[0], budget_s=budget_s, step=step, progress=progress)
        measurement.bound = self.expected_speedup
        object.__setattr__(self, "measured", measurement)
        return measurement

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/html": finding_html(self), "text/plain": finding_text(self)}


def _measurement(data: Any) -> Any:
    if not data:
        return None
    from gpuwidget.measure.measurement import Measurement

    return Measurement.from_dict(data)
