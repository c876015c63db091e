"""Run: everything one watched cell produced, as data that renders and saves itself."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from gpuwidget.advice.finding import Finding, SavedFinding
from gpuwidget.export import trace_csv
from gpuwidget.facts import MachineFacts, RankEntry, Summary, WorkloadFacts, saved_machine
from gpuwidget.options import SavedOptions, WatchOptions
from gpuwidget.report import html_document, run_html, run_text
from gpuwidget.runfile import RUN_FORMAT, RunFormatError, check_run, read_json, save_target, write_atomic
from gpuwidget.sources.base import SavedSourceError
from gpuwidget.trace import Trace, finite_or_none

if TYPE_CHECKING:
    from gpuwidget.measure.changes import TrialChange
    from gpuwidget.measure.measurement import Measurement

__all__ = ["RUN_FORMAT", "Run", "RunError", "RunFormatError"]


@dataclass
class RunError:
    """The exception a watched cell ended with, as data: no frames, so nothing of the cell's stays alive."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> RunError:
        try:
            message = str(exc)
        except Exception as error:  # noqa: BLE001 - a user's __str__ may raise; the run is still recorded
            message = f"<str() failed: {error!r}>"
        try:
            text = "".join(traceback.format_exception(exc))
        except Exception:  # noqa: BLE001 - same for anything in the chain
            text = ""
        return cls(type(exc).__name__, message, text)

    def __str__(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


class SamplerRecord(TypedDict, total=False):
    """How the sampler behaved during the watch (``Run.sampler``): useful to trust (or distrust) the figures."""

    ticks: int
    missed_ticks: int
    cpu_time_s: float  # the sampler thread's own CPU time
    # cpu_time_s by part of a tick: "stack sample", each source by name ("host", "nvml"), "trace row",
    # "listeners" (absent in runs saved before it was kept)
    part_cpu_s: dict[str, float]
    errors: list[str]  # the last 10
    stalled: Sequence[Mapping[str, object]]  # sources dropped because a read never returned: source, at_s, message
    source_errors: list[SavedSourceError]  # the last 20 failures the sources recorded


class Comparison(TypedDict):
    """Before -> after against the previous run of the same cell (:meth:`Run.comparison`)."""

    samples_per_s: list[float]  # [before, after]
    data_wait_fraction: list[float | None]  # [before, after]
    speedup: float  # after / before samples/s


class SavedError(TypedDict):
    type: str
    message: str
    traceback: str


class SavedRun(TypedDict):
    """A run as ``Run.save`` writes it to JSON (:meth:`Run.to_dict`; ``runfile.check_run`` reads it back)."""

    format: str  # RUN_FORMAT
    label: str
    finished: bool
    summary: Summary
    findings: list[SavedFinding]
    workload: WorkloadFacts
    ranks: list[RankEntry]
    machine: MachineFacts
    options: SavedOptions
    error: SavedError | None
    sampler: SamplerRecord
    trace: Mapping[str, object]  # Trace.to_dict()


@dataclass
class Run:
    """One watched cell: its Trace, summary figures, findings, workload facts and outcome.

    ``error`` is a :class:`RunError` (type, message, formatted traceback): the cell's own
    exception goes on to the user unchanged, and the Run keeps none of its frames.
    """

    trace: Trace
    summary: Summary = field(default_factory=Summary)
    findings: list[Finding] = field(default_factory=list)
    workload: WorkloadFacts = field(default_factory=WorkloadFacts)
    machine: MachineFacts = field(default_factory=MachineFacts)
    options: WatchOptions = field(default_factory=WatchOptions)
    error: RunError | None = None
    sampler: SamplerRecord = field(default_factory=lambda: SamplerRecord())
    label: str = ""
    finished: bool = False
    # Set by --tune or the panel's Measure button: the tuner's result (not saved).
    tuning: Any = None
    # The last run of the same cell (its cell id: session.cell_key) on the same data in this kernel, for
    # before -> after (not saved; it holds no previous run of its own).
    previous: Run | None = None
    # What Run.measure runs on (gpuwidget.measure.subjects: weak references to the cell's model,
    # optimizer and loaders, one copied batch); not saved: a loaded run has nothing to measure.
    subjects: Any = None
    # Set by --tune or the panel's Measure button: every finding's change measured (not saved).
    measured: Any = None

    # ------------------------------------------------------------- conveniences

    def comparison(self) -> Comparison | None:
        """Before -> after against :attr:`previous`: samples/s and data wait of both runs and
        the speed-up (after / before samples/s); None without a previous run with a loop."""
        before = self.previous.summary if self.previous is not None else Summary()
        rate_before, rate_after = before.get("samples_per_s"), self.summary.get("samples_per_s")
        if not rate_before or not rate_after:
            return None
        return {
            "samples_per_s": [rate_before, rate_after],
            "data_wait_fraction": [before.get("data_wait_fraction"), self.summary.get("data_wait_fraction")],
            "speedup": rate_after / rate_before,
        }

    def measure(self, change: TrialChange, budget_s: float = 30.0, step: Any = None,
                progress: Any = None) -> Measurement:
        """Try ``change`` in this cell's own training step and measure it against the step as it is.

        ``change`` is a dict of the keys in gpuwidget.measure.changes (``autocast``, ``tf32``, ``compile``,
        ``channels_last``, ``fused_optimizer``, ``batch_size``, and the loader's ``num_workers``,
        ``pin_memory``, ``persistent_workers``, ``prefetch_factor``); several keys are measured together.
        ``step(model, batch) -> loss`` overrides the loss gpuwidget finds (gpuwidget.measure.loss);
        ``progress(line, elapsed_s)`` is told as it goes. Returns a
        :class:`~gpuwidget.measure.measurement.Measurement` (``speedup``, ``ci``, ``verdict``,
        ``peak_memory_ratio``, ``numerics``, ``notes``) within about ``budget_s`` seconds. The model and
        optimizer are copies; RNG, ``torch.backends`` switches and compile caches are put back.
        ``ValueError`` for an unknown key or a bad value, before anything runs;
        :class:`~gpuwidget.measure.sides.MeasureError` when this run has nothing to measure.
        Ctrl-C stops it and returns what was measured so far.
        """
        from gpuwidget.measure.ab import measure_change
        from gpuwidget.measure.changes import check_change
        from gpuwidget.measure.sides import MeasureError

        check_change(change)
        if self.subjects is None:
            raise MeasureError("this run's model and loaders are not in this process (a loaded or still running "
                               "run): run the watched cell again and measure its run")
        return measure_change(self.subjects, change, budget_s, step=step, progress=progress)

    def adopt_findings(self) -> None:
        """Let each finding reach this run (Finding.measure), without the run keeping anything new alive."""
        import weakref

        for finding in self.findings:
            object.__setattr__(finding, "_run", weakref.ref(self))

    @property
    def ranks(self) -> list[RankEntry]:
        """One entry per training process (the watch's own when it trained, then the children it
        started): ``rank``, ``pid``, ``gpu``, ``steps``, ``samples_per_s``, ``data_wait_fraction``,
        ``step_time_p50_s``, ``step_time_p95_s``; ``workload["ranks"]`` has each one's facts too."""
        from gpuwidget.children.ranks import public

        return public(self.workload.get("ranks") or [])

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
        return "interrupted" if self.error.type == "KeyboardInterrupt" else "error"

    # ------------------------------------------------------------- serialising

    def __post_init__(self) -> None:
        if isinstance(self.error, BaseException):  # never keep the frames of an exception handed in
            self.error = RunError.from_exception(self.error)
        if isinstance(self.options, Mapping):  # options as plain data, as saved
            self.options = WatchOptions.from_dict(self.options)

    def to_dict(self) -> SavedRun:
        error = self.error
        return {
            "format": RUN_FORMAT,
            "label": self.label,
            "finished": self.finished,
            "summary": _jsonable(self.summary),
            "findings": [f.to_dict() for f in self.findings],
            "workload": _jsonable(self.workload),
            "ranks": _jsonable(self.ranks),
            "machine": _jsonable(self.machine),
            "options": _jsonable(self.options.to_dict()),
            "error": None if error is None else {"type": error.type, "message": error.message,
                                                 "traceback": error.traceback},
            "sampler": _jsonable(self.sampler),
            "trace": self.trace.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Run:
        """Rebuild a Run from :meth:`to_dict`'s data; :class:`RunFormatError` for anything else."""
        check_run(data)
        trace = data["trace"]
        rows, archive_rows = len(trace["t"]), trace["archive_rows"]
        error = data.get("error")
        try:
            return cls(
                # Capacities from the rows the file holds (the defaults are sized for a live run).
                trace=Trace.from_dict(trace, recent_capacity=max(4, rows - archive_rows + 1),
                                      archive_capacity=max(4, archive_rows + 1)),
                summary=cast(Summary, dict(data.get("summary") or {})),
                findings=[Finding.from_dict(f) for f in data.get("findings") or []],
                workload=cast(WorkloadFacts, dict(data.get("workload") or {})),
                machine=saved_machine(data.get("machine") or {}),
                options=WatchOptions.from_dict(data.get("options") or {}),
                error=None if error is None else RunError(error["type"], error["message"],
                                                          error.get("traceback") or ""),
                sampler=cast(SamplerRecord, dict(data.get("sampler") or {})),
                label=data.get("label") or "",
                finished=bool(data.get("finished", True)),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise RunFormatError(f"not a saved gpuwidget run: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the run as JSON (``.json``), a self-contained HTML report (``.html``) or
        the trace's columns as CSV (``.csv``), chosen by the file's suffix."""
        target = save_target(path)
        suffix = target.suffix.lower()
        if suffix == ".json":
            text = json.dumps(self.to_dict(), allow_nan=False)
        elif suffix in (".html", ".htm"):
            text = html_document(self)
        elif suffix == ".csv":
            text = trace_csv(self.trace)
        else:
            raise ValueError(f"cannot save a run as {suffix or 'a file without suffix'!r}: "
                             "use .json, .html or .csv")
        write_atomic(target, text)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Run:
        """Read a run written by ``save(... .json)``; :class:`RunFormatError` if the file is not one."""
        return cls.from_dict(read_json(path))

    # ------------------------------------------------------------- rendering

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/html": run_html(self), "text/plain": run_text(self)}

    def __repr__(self) -> str:
        duration = self.summary.get("duration_s")
        shown = f"{duration:.1f} s" if isinstance(duration, (int, float)) else "?"
        return f"<gpuwidget Run {self.outcome}, {shown}, {len(self.findings)} finding(s)>"


def _jsonable(value: Any) -> Any:
    """Plain JSON data: NaN/inf become None, tuples lists, unknown objects their repr."""
    if isinstance(value, float):
        return finite_or_none(value)
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
