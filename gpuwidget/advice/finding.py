"""Finding: one named cause of GPU idle time, with its evidence, the change and the gain bound."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuwidget.report import finding_html, finding_text

Severity = Literal["info", "warn", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warn", "critical")


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

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if self.expected_speedup is not None and not self.expected_speedup >= 1.0:
            raise ValueError(f"expected_speedup is a bound >= 1.0, not {self.expected_speedup!r}")

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
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/html": finding_html(self), "text/plain": finding_text(self)}
