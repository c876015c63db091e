"""Finding: one named cause of GPU idle time, with its evidence, the change and the gain bound."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from gpuwidget.facts import LoaderChange
from gpuwidget.report import finding_html, finding_text

if TYPE_CHECKING:
    from gpuwidget.measure.changes import TrialChange
    from gpuwidget.measure.measurement import Measurement, SavedMeasurement

Severity = Literal["info", "warn", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warn", "critical")
# Causes that lie in the machine, not in the user's code: other processes holding the cores, a GPU
# slowed by heat or a lowered power limit. They rank by their gain like any other, and say whose they are.
MACHINE_RULES = frozenset({"cpu-contention", "gpu-throttled"})
# A gain under this shows as 1.00x: nothing to gain that the measurement can tell (the loop's timers
# are good to a few ms over the second a cause needs, advice.evidence.MIN_CAUSE_LOOP_S: half a percent).
NOTHING_TO_GAIN = 1.005


class FindingChange(LoaderChange, total=False):
    """``Finding.change``: the change a finding suggests, structured. Each rule sets its own keys and only
    those: the loader findings the DataLoader settings (:class:`~gpuwidget.facts.LoaderChange`), the
    others the keys below, by rule. A change with no keys is one the code and the suggestion describe."""

    # fp32-math: allow TF32 (torch.set_float32_matmul_precision), or train under this autocast dtype
    float32_matmul_precision: str
    autocast_dtype: str
    cudnn_allow_tf32: bool
    # launch-bound: torch.compile the model (again, in this mode: "reduce-overhead" for CUDA graphs)
    torch_compile: bool
    compile_mode: str
    # memory-pressure: the allocator setting
    PYTORCH_CUDA_ALLOC_CONF: str
    # data-parallel, gpu-imbalance: one process per GPU under a launcher ("gpu": one per visible GPU)
    wrapper: str
    launcher: str
    nproc_per_node: int | str
    device_ids: None  # DataParallel over every GPU
    # gpu-unused: where to train
    device: str
    # ddp-communication: DistributedDataParallel's keywords, and gradient accumulation under no_sync()
    bucket_cap_mb: int
    gradient_as_bucket_view: bool
    find_unused_parameters: bool
    static_graph: bool
    no_sync_accumulation_steps: int
    # periodic-stall: what stalls, how often, and whether it can leave the training thread
    every_n_steps: int
    off_training_thread: bool
    stall: str
    # loop-waits: move these tensors to the device once; copy without blocking; prefetch this function's batches
    move_to_device_once: list[str]
    non_blocking: bool
    prefetch: str | None
    # rank-straggler: which rank, and its measured cause
    rank: int | None
    cause: str


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
    evidence: Mapping[str, object] = field(default_factory=dict)
    suggestion: str = ""
    change: FindingChange = field(default_factory=lambda: FindingChange())
    code: str = ""
    expected_speedup: float | None = None
    # What Finding.measure (or --tune) measured of this finding's change: a Measurement, or None.
    measured: Measurement | None = field(default=None, compare=False, repr=False)

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

    def to_dict(self) -> SavedFinding:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "title": self.title,
            "evidence": dict(self.evidence),
            "suggestion": self.suggestion,
            "change": FindingChange(**self.change),
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
            change=cast(FindingChange, dict(data.get("change") or {})),
            code=data.get("code", ""),
            expected_speedup=data.get("expected_speedup"),
            measured=_measurement(data.get("measured")),
        )

    def trial_changes(self) -> list[TrialChange]:
        """The changes that try this finding's suggestion in a training step (gpuwidget.measure.changes),
        the one its bound refers to first; [] when its change is not one a step can try."""
        from gpuwidget.measure.changes import finding_changes

        return finding_changes(self.rule, self.change)

    def measure(self, budget_s: float = 30.0, step: Any = None, progress: Any = None) -> Measurement:
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

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/html": finding_html(self), "text/plain": finding_text(self)}


class SavedFinding(TypedDict, total=False):
    """A finding as ``Run.save`` writes it (:meth:`Finding.to_dict`); ``measured`` only where it was."""

    rule: str
    severity: Severity
    title: str
    evidence: dict[str, object]
    suggestion: str
    change: FindingChange
    code: str
    expected_speedup: float | None
    measured: SavedMeasurement


def _measurement(data: Any) -> Measurement | None:
    if not data:
        return None
    from gpuwidget.measure.measurement import Measurement

    return Measurement.from_dict(data)
