"""Run: everything one watched cell produced, as data that renders and saves itself."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.trace import Trace

RUN_FORMAT = "gpuwidget.run/1"


@dataclass
class RunError:
    """The exception a watched cell ended with, as data that survives saving."""

    type: str
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> RunError:
        return cls(type(exc).__name__, str(exc))

    def __str__(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass
class Run:
    """One watched cell: its Trace, summary figures, findings, workload facts and outcome.

    ``error`` holds the cell's own exception object while the session lives (so it can be
    re-raised unchanged) and a :class:`RunError` after :meth:`load`.
    """

    trace: Trace
    summary: Summary = field(default_factory=Summary)
    findings: list[Any] = field(default_factory=list)
    workload: WorkloadFacts = field(default_factory=WorkloadFacts)
    machine: MachineFacts = field(default_factory=MachineFacts)
    options: dict[str, Any] = field(default_factory=dict)
    error: BaseException | RunError | None = None
    sampler: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    finished: bool = False
    # Set by --tune or the panel's Measure button: the tuner's result (not saved).
    tuning: Any = None

    # ------------------------------------------------------------- conveniences

    @property
    def gpu_found(self) -> bool:
        return bool(self.machine.get("gpus"))

    @property
    def outcome(self) -> str:
        """'ok', 'interrupted', 'error' or 'running'."""
        if not self.finished:
            return "running"
        if self.error is None:
            return "ok"
        name = self.error.type if isinstance(self.error, RunError) else type(self.error).__name__
        return "interrupted" if name == "KeyboardInterrupt" else "error"

    # ------------------------------------------------------------- serialising

    def to_dict(self) -> dict[str, Any]:
        error = self.error
        if isinstance(error, BaseException):
            error = RunError.from_exception(error)
        return {
            "format": RUN_FORMAT,
            "label": self.label,
            "finished": self.finished,
            "summary": _jsonable(self.summary),
            "findings": [f.to_dict() if hasattr(f, "to_dict") else f for f in self.findings],
            "workload": _jsonable(self.workload),
            "machine": _jsonable(self.machine),
            "options": _jsonable(self.options),
            "error": None if error is None else {"type": error.type, "message": error.message},
            "sampler": _jsonable(self.sampler),
            "trace": self.trace.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Run:
        if data.get("format") != RUN_FORMAT:
            raise ValueError(f"not a saved gpuwidget run (format={data.get('format')!r})")
        from gpuwidget.advice.finding import Finding

        error = data.get("error")
        return cls(
            trace=Trace.from_dict(data["trace"]),
            summary=cast(Summary, dict(data.get("summary") or {})),
            findings=[Finding.from_dict(f) for f in data.get("findings") or []],
            workload=cast(WorkloadFacts, dict(data.get("workload") or {})),
            machine=cast(MachineFacts, dict(data.get("machine") or {})),
            options=dict(data.get("options") or {}),
            error=None if error is None else RunError(error["type"], error["message"]),
            sampler=dict(data.get("sampler") or {}),
            label=data.get("label", ""),
            finished=bool(data.get("finished", True)),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the run as JSON (``.json``), a self-contained HTML report (``.html``) or
        the trace's columns as CSV (``.csv``), chosen by the file's suffix."""
        target = Path(path)
        suffix = target.suffix.lower()
        if suffix == ".json":
            text = json.dumps(self.to_dict(), allow_nan=False)
        elif suffix in (".html", ".htm"):
            from gpuwidget.ui.panel import html_document

            text = html_document(self)
        elif suffix == ".csv":
            from gpuwidget.export import trace_csv

            text = trace_csv(self.trace)
        else:
            raise ValueError(f"cannot save a run as {suffix or 'a file without suffix'!r}: "
                             "use .json, .html or .csv")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Run:
        """Read a run written by ``save(... .json)``."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    # ------------------------------------------------------------- rendering

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        from gpuwidget.ui.panel import run_html, run_text

        return {"text/html": run_html(self), "text/plain": run_text(self)}

    def __repr__(self) -> str:
        duration = self.summary.get("duration_s")
        shown = f"{duration:.1f} s" if isinstance(duration, (int, float)) else "?"
        return f"<gpuwidget Run {self.outcome}, {shown}, {len(self.findings)} finding(s)>"


def _jsonable(value: Any) -> Any:
    """Plain JSON data: NaN/inf become None, tuples lists, unknown objects their repr."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if hasattr(value, "item"):  # numpy scalars
        return _jsonable(value.item())
    return repr(value)
