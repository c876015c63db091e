"""Real-GPU check: PASS/FAIL per check that gpuwidget reads an NVIDIA GPU right and judges it right.

On a machine with an NVIDIA GPU (one command, under 5 minutes, outputs under DIR)::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --out DIR

and anywhere, against ``tests/fakenvml.py`` and a fake ``nvidia-smi`` (about a second)::

    .venv/bin/python benchmarks/gpu_check.py --dry-run [--out DIR]

It needs torch, numpy, psutil and nvidia-ml-py, no IPython, Jupyter, bokeh or ipywidgets: the
``watch()`` path imports none of them. Checks, on CUDA device 0:

1. **Readings against ``nvidia-smi --query-gpu``** (:data:`FIELDS`, each with its tolerance), paired
   by UUID, while a bf16 matmul loop keeps the GPU busy and again once it is left alone (utilisation
   must fall, not freeze). A reading gpuwidget leaves out while nvidia-smi has it is a FAIL.
2. **Energy**: the energy counter's rise against the power readings integrated over the same time.
3. **GPM** (required from Hopper on): SM and tensor activity against ``nvidia-smi dmon``; tensor
   activity > 0 under a bf16 matmul and ~0 under a float32 one with TF32 switched off, where the
   float32 matmul must also run at FP32-unit speed (proof that TF32 really was off).
4. **Own process**: ``proc_mem`` against ``torch.cuda.memory_reserved`` (plus the driver's overhead)
   and against nvidia-smi's ``--query-compute-apps``.
5. **Workloads whose cause is known** (``benchmarks/_gpu_workloads.py``): the advisor must name the
   cause and no rival rule; the change must pay; the busy figure is SM activity where GPM exists;
   the bf16 matmul loop has no finding and an MFU near the measured bf16 matmul peak. Each run is
   saved as a fixture (``DIR/fixtures/NAME.json``, a few hundred kB at most) and replayed at once.

Writes ``DIR/gpu_check.json`` (every check, the figures and nvidia-smi's own text, rewritten after
each phase, so a run cut short still leaves what it found) and ``DIR/gpu_check.log``. Exits 1 on
any FAIL. Names other parts of gpuwidget do not have yet are FAILs that say so ("absent").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _gpu_workloads  # noqa: E402
from _gpu_workloads import EXPECTED, judge_rules  # noqa: E402

from gpuwidget.facts import uuid_key  # noqa: E402

MIB = 2.0**20
GIB = 2.0**30
# The one command for the lent GPU machine, run from the repository's root (README, BENCHMARKS).
DEVICE_COMMAND = "PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --out $OUT"

# ------------------------------------------------------------------ what is compared, and how closely


@dataclass(frozen=True)
class Field:
    """One ``nvidia-smi --query-gpu`` field and the gpuwidget reading it must match."""

    smi: str
    metric: str  # gpuwidget's reading: gpu0.<metric>
    scale: float  # nvidia-smi's unit (nounits) -> gpuwidget's SI unit
    absolute: float  # tolerance, in SI units...
    relative: float = 0.0  # ...or this share of nvidia-smi's value, whichever is larger
    why: str = ""


# The two read at moments a few hundred ms apart (nvidia-smi takes that long to start), so what moves
# with load gets room; what the driver only reports gets nvidia-smi's printed precision.
FIELDS: tuple[Field, ...] = (
    Field("memory.used", "mem_used", MIB, 64 * MIB, why="64 MiB plus nvidia-smi's memory.reserved: gpuwidget reads "
          "NVML's v2 struct, whose 'used' leaves the driver's reserve out; nvidia-smi's may include it"),
    Field("memory.total", "mem_total", MIB, 1 * MIB, why="nvidia-smi prints whole MiB"),
    Field("power.draw", "power", 1.0, 25.0, 0.15, why="a 1 s average on Hopper, read at different moments"),
    Field("enforced.power.limit", "power_limit", 1.0, 1.0, why="set by the administrator, printed to 0.01 W"),
    Field("power.default_limit", "power_limit_default", 1.0, 1.0, why="the board's default"),
    Field("power.min_limit", "power_limit_min", 1.0, 1.0, why="the lowest limit the board accepts"),
    Field("power.max_limit", "power_limit_max", 1.0, 1.0, why="the highest limit the board accepts"),
    Field("clocks.sm", "sm_clock", 1e6, 100e6, 0.10, why="moves every few ms at the power cap"),
    Field("clocks.max.sm", "sm_clock_max", 1e6, 1e6, why="a fixed fact of the board"),
    Field("clocks.mem", "mem_clock", 1e6, 1e6, why="the memory clock stays put under load"),
    Field("temperature.gpu", "temperature", 1.0, 3.0, why="rises about a degree a second under load"),
    Field("utilization.gpu", "util", 1.0, 15.0, why="gpuwidget means the driver's samples since its last read"),
    Field("utilization.memory", "mem_util", 1.0, 15.0, why="the same window as utilization.gpu"),
    Field("pcie.link.gen.current", "pcie_gen", 1.0, 0.0, why="the same NVML counter"),
    Field("pcie.link.gen.max", "pcie_gen_max", 1.0, 0.0, why="what the GPU and its slot allow"),
    Field("pcie.link.width.current", "pcie_width", 1.0, 0.0, why="the same NVML counter"),
    Field("pcie.link.width.max", "pcie_width_max", 1.0, 0.0, why="what the GPU and its slot allow"),
)
# Asked of nvidia-smi too, to pair rows and to widen the memory.used tolerance.
AUX_FIELDS = ("uuid", "memory.reserved")
# The loaded GPU must read at least this busy, and at most this once left alone (percent).
BUSY_MIN_PERCENT = 80.0
IDLE_MAX_PERCENT = 10.0
# Paired reads per phase (each: READS_PER_ROUND reads of gpuwidget's source, then one nvidia-smi),
# the medians compared; seconds between two of gpuwidget's reads.
ROUNDS = 5
READS_PER_ROUND = 4
READ_GAP_S = 0.25
# Seconds the load runs before the first reading (the driver's 1 s averages fill), and the idle
# GPU is left alone before its readings (its utilisation window empties).
SETTLE_S = 1.5
IDLE_SETTLE_S = 2.0
# Energy: the counter's rise against the power readings integrated (trapezoids) over the same reads.
ENERGY_RELATIVE = 0.10
ENERGY_ABSOLUTE_J = 5.0
# GPM: tensor activity under a bf16 matmul at least this, under a float32 one with TF32 off at most
# this (percent); the SMs at least BUSY_MIN_PERCENT active in both (so ~0 tensor activity means
# something); dmon's figures within this many points of gpuwidget's.
TENSOR_ACTIVE_BF16_MIN = 20.0
TENSOR_ACTIVE_FP32_MAX = 2.0
DMON_TOLERANCE = 15.0
# NVML GPM metric ids for dmon --gpm-metrics: SM activity, any tensor pipe (nvml.h).
DMON_GPM_IDS = "2,5"
DMON_SECONDS = 5
# The float32 matmul with TF32 off must run at most this share of the bf16 one's FLOP/s: IEEE FP32
# on the FP32 units is ~1/15 of dense bf16 on Hopper and Ampere (H100 SXM 67 vs 989 TFLOP/s, A100
# 19.5 vs 312), TF32 on the Tensor Cores 1/2 (494.7, 156).
FP32_OVER_BF16_MAX = 0.25
# Own process: proc_mem (what the driver says the process holds) minus torch's memory_reserved (what
# the caching allocator holds) is the CUDA context, its loaded kernel modules and cuBLAS/cuDNN
# handles: about 0.5 GiB on an H100 with CUDA 12's lazy loading. Allowed: 0 to this.
DRIVER_OVERHEAD_MAX = 1.5 * GIB
# nvidia-smi --query-compute-apps's used_memory for this pid against proc_mem (the same driver
# figure, read a moment apart while nothing allocates).
APPS_TOLERANCE = 64 * MIB
# Matmul size for the loads; the bf16 one's FLOP/s is the measured peak MFU is compared with.
LOAD_N = 8192
# The bf16 workload's achieved FLOP/s must reach this share of the measured bf16 matmul rate, and must
# not exceed the chip's dense peak from gpuwidget's table (a count that says more than the chip can do
# is wrong). The measured rate is no ceiling: on the first H200 the workload ran at 1.06 of it (706
# against 666 TFLOP/s: the load's matmul was timed on a thread, the clocks moved at the 700 W cap).
ACHIEVED_OF_MEASURED_MIN = 0.75
# FlopCounterMode's count for one step against the analytic count of the bf16 workload.
FLOPS_TOLERANCE = 0.10
# mfu against achieved_flops_per_s / peak_flops_per_s.
MFU_CONSISTENCY = 0.01
# The busy figure must be SM activity where GPM exists: gpu_busy_mean within this of gpu_sm_active_mean.
BUSY_FIGURE_TOLERANCE = 0.5
# A fixture at most this large (JSON); larger ones lose their oldest spans and steps, as a long run does.
FIXTURE_MAX_BYTES = 400_000
# The whole check stops starting phases once this many seconds have gone (the lent machine's command
# runs 5 minutes at most, start-up and transfers apart).
DEFAULT_BUDGET_S = 270.0
# Seconds a phase is expected to take at most, to decide whether it still fits in the budget.
PHASE_S = {"fp32": 15.0, "idle": 20.0, "workload": 25.0}
# Names other parts of gpuwidget add (wave-1 contract): checked as FAIL "absent" until they exist.
CONTRACT = {"flops_per_step": "modelprobe", "achieved_flops_per_s": "modelprobe", "peak_flops_per_s": "modelprobe",
            "mfu": "modelprobe", "flops_dtype": "modelprobe", "gpu_busy_metric": "gpufigures",
            "gpu_kernel_running_mean": "gpufigures"}


@dataclass
class Check:
    name: str
    verdict: str  # PASS, FAIL or SKIP (only where the GPU is known not to have the thing)
    detail: str

    def __str__(self) -> str:
        return f"{self.verdict} {self.name}: {self.detail}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


@dataclass
class Report:
    """The checks so far and what they were judged on; written after each phase."""

    out: Path | None = None
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    budget_s: float = DEFAULT_BUDGET_S
    quiet: bool = False
    # Fixture size limits that differ from FIXTURE_MAX_BYTES, by workload (the dry run's flips).
    fixture_limits: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.put(Check(name, verdict(ok), detail))

    def fail(self, name: str, detail: str) -> None:
        self.put(Check(name, "FAIL", detail))

    def put(self, check: Check) -> None:
        self.checks.append(check)
        if not self.quiet:
            print(check, flush=True)

    def fits(self, phase: str) -> bool:
        return time.monotonic() - self.started + PHASE_S[phase] <= self.budget_s

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"elapsed_s": round(time.monotonic() - self.started, 1), "checks": [asdict(c) for c in self.checks],
                "figures": self.figures, "raw": self.raw}
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "gpu_check.log").write_text("\n".join(map(str, self.checks)) + "\n" + self.totals() + "\n")

    def totals(self) -> str:
        counts = {v: sum(c.verdict == v for c in self.checks) for v in ("PASS", "FAIL", "SKIP")}
        return (f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
                f"in {time.monotonic() - self.started:.0f} s")

    def verdicts(self) -> dict[str, str]:
        return {check.name: check.verdict for check in self.checks}


# ------------------------------------------------------------------ nvidia-smi's text


def parse_query(text: str, fields: Sequence[str]) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` -> one dict per GPU, nvidia-smi's
    units; a field it cannot say (``[N/A]``, ``[Not Supported]``) is absent."""
    rows = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        row: dict[str, Any] = {}
        for name, value in zip(fields, values):
            if name == "uuid":
                row[name] = value
                continue
            with contextlib.suppress(ValueError):
                row[name] = float(value)
        rows.append(row)
    return rows


def parse_apps(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> {pid: bytes}."""
    apps: dict[int, float] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        with contextlib.suppress(ValueError, IndexError):
            apps[int(parts[0])] = apps.get(int(parts[0]), 0.0) + float(parts[1]) * MIB
    return apps


def parse_dmon(text: str) -> dict[int, tuple[float, float]]:
    """``nvidia-smi dmon --gpm-metrics 2,5`` -> {nvidia-smi index: (SM activity, tensor activity)}: the
    last two columns of each row, as the metrics asked for come last; medians over rows. A column
    dmon cannot fill (``-``) keeps its place, so it never shifts another into the GPM slots."""
    found: dict[int, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3 or line.lstrip().startswith("#"):
            continue
        values: list[float | None] = []
        for item in fields:
            try:
                values.append(float(item))
            except ValueError:
                values.append(None)
        sm, tensor = values[-2], values[-1]
        if values[0] is not None and sm is not None and tensor is not None:
            found.setdefault(int(values[0]), []).append((sm, tensor))
    return {index: (statistics.median(s for s, _ in rows), statistics.median(t for _, t in rows))
            for index, rows in found.items()}


# ------------------------------------------------------------------ comparisons


def gpuwidget_metrics() -> frozenset[str]:
    """The readings gpuwidget's NVML source defines (``gpu0.<metric>``)."""
    from gpuwidget.sources.nvml import METRICS

    return frozenset(METRICS)


def summary_keys() -> frozenset[str]:
    """The summary keys gpuwidget defines (facts.Summary)."""
    from gpuwidget.facts import Summary

    return frozenset(Summary.__annotations__)


def median_of(readings: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [r[key] for r in readings if key in r and r[key] is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def tolerance(item: Field, theirs: float, reserved: float | None) -> float:
    allowed = max(item.absolute, item.relative * abs(theirs))
    if item.smi == "memory.used":
        allowed += reserved or 0.0
    return allowed


def compare_readings(report: Report, phase: str, devices: Sequence[Mapping[str, Any]],
                     ours: Sequence[Mapping[str, float]], theirs: Sequence[Sequence[Mapping[str, Any]]],
                     unknown_fields: Sequence[str] = ()) -> None:
    """Each device's median readings against nvidia-smi's row with the same UUID, field by field."""
    defined = gpuwidget_metrics()
    for device in devices:
        label, key = device["id"], uuid_key(device["uuid"])
        rows = [row for rounds in theirs for row in rounds if uuid_key(str(row.get("uuid", ""))) == key]
        report.add(f"{phase} {label} uuid", bool(rows),
                   f"nvidia-smi lists {device['uuid']}" if rows else f"nvidia-smi lists no GPU {device['uuid']}")
        if not rows:
            for item in FIELDS:
                report.fail(f"{phase} {label} {item.metric}", "no nvidia-smi row for this GPU to compare with")
            continue
        reserved_mib = median_of(rows, "memory.reserved")
        reserved = None if reserved_mib is None else reserved_mib * MIB
        for item in FIELDS:
            name = f"{phase} {label} {item.metric}"
            mine = median_of(ours, f"{label}.{item.metric}")
            smi = median_of(rows, item.smi)
            theirs_si = None if smi is None else smi * item.scale
            if item.smi in unknown_fields:
                report.fail(name, f"cannot compare: this nvidia-smi has no --query-gpu={item.smi}")
            elif mine is None and theirs_si is None:
                report.fail(name, f"neither gpuwidget nor nvidia-smi ({item.smi}) reports it on this GPU")
            elif mine is None:
                missing = "" if item.metric in defined else " (not among gpuwidget's NVML readings)"
                report.fail(name, f"absent: gpuwidget reports no {label}.{item.metric}{missing}; "
                                  f"nvidia-smi {item.smi} = {smi:g}")
            elif theirs_si is None:
                report.fail(name, f"gpuwidget reports {mine:.6g} where nvidia-smi has no {item.smi}")
            else:
                allowed = tolerance(item, theirs_si, reserved)
                report.add(name, abs(mine - theirs_si) <= allowed,
                           f"gpuwidget {mine:.6g} vs nvidia-smi {theirs_si:.6g} (allowed {allowed:.3g}: {item.why})")


def check_utilisation(report: Report, phase: str, label: str, ours: Sequence[Mapping[str, float]],
                      busy: bool) -> None:
    value = median_of(ours, f"{label}.util")
    name = f"{phase} {label} utilisation"
    if value is None:
        report.fail(name, f"absent: no {label}.util")
    elif busy:
        report.add(name, value >= BUSY_MIN_PERCENT, f"{value:.0f}% (expected >= {BUSY_MIN_PERCENT:.0f}% "
                                                    "while a matmul loop runs)")
    else:
        report.add(name, value <= IDLE_MAX_PERCENT, f"{value:.0f}% (expected <= {IDLE_MAX_PERCENT:.0f}% once "
                                                    "left alone, not its last busy value)")


def check_energy(report: Report, label: str, timed: Sequence[tuple[float, Mapping[str, float]]]) -> None:
    """The energy counter's rise against power integrated over the same reads (trapezoids)."""
    name = f"energy {label} counter vs power x time"
    points = [(t, r[f"{label}.power"], r[f"{label}.energy_j"]) for t, r in timed
              if f"{label}.power" in r and f"{label}.energy_j" in r]
    if len(points) < 3:
        report.fail(name, f"absent: {len(points)} reads with both {label}.power and {label}.energy_j")
        return
    integral = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0, _), (t1, p1, _) in zip(points, points[1:]))
    rise = points[-1][2] - points[0][2]
    allowed = max(ENERGY_ABSOLUTE_J, ENERGY_RELATIVE * integral)
    report.figures[f"energy_{label}"] = {"counter_j": rise, "power_x_time_j": integral,
                                         "seconds": points[-1][0] - points[0][0]}
    report.add(name, rise > 0 and abs(rise - integral) <= allowed,
               f"counter rose {rise:.0f} J, power x time {integral:.0f} J over {points[-1][0] - points[0][0]:.1f} s "
               f"(allowed {allowed:.0f} J)")


@dataclass
class LoadFigures:
    """What a matmul load measured of itself: FLOP/s, and the TF32 setting it ran under."""

    flops_per_s: float | None = None
    tf32: str | None = None


def check_gpm(report: Report, device: Mapping[str, Any], hopper: bool, bf16: Sequence[Mapping[str, float]],
              fp32: Sequence[Mapping[str, float]], dmon: dict[int, tuple[float, float]] | str,
              bf16_load: LoadFigures, fp32_load: LoadFigures) -> None:
    label = device["id"]
    if not device.get("gpm"):
        if hopper:
            report.fail(f"gpm {label} supported", "absent: no GPM metrics from gpuwidget on a Hopper-or-newer GPU")
        else:
            report.put(Check(f"gpm {label} supported", "SKIP", "no GPM before Hopper"))
            return
    else:
        report.add(f"gpm {label} supported", True, "GPM metrics read")

    def at_least(name: str, readings: Sequence[Mapping[str, float]], metric: str, low: float, why: str) -> None:
        value = median_of(readings, f"{label}.{metric}")
        if value is None:
            report.fail(name, f"absent: no {label}.{metric}")
        else:
            report.add(name, value >= low, f"{value:.1f}% (expected >= {low:g}%: {why})")

    at_least(f"gpm {label} tensor_active under bf16", bf16, "tensor_active", TENSOR_ACTIVE_BF16_MIN,
             "a bf16 matmul runs on the Tensor Cores")
    at_least(f"gpm {label} sm_active under bf16", bf16, "sm_active", BUSY_MIN_PERCENT, "a large matmul fills the SMs")
    at_least(f"gpm {label} sm_occupancy under bf16", bf16, "sm_occupancy", 1.0, "warps resident")
    at_least(f"gpm {label} dram_active under bf16", bf16, "dram_active", 1.0, "operands stream from memory")
    at_least(f"gpm {label} sm_active under fp32", fp32, "sm_active", BUSY_MIN_PERCENT,
             "the SMs were busy, so ~0 tensor activity is a reading, not an idle GPU")
    tensor = median_of(fp32, f"{label}.tensor_active")
    name = f"gpm {label} tensor_active under fp32 with TF32 off"
    if tensor is None:
        report.fail(name, f"absent: no {label}.tensor_active")
    else:
        report.add(name, tensor <= TENSOR_ACTIVE_FP32_MAX,
                   f"{tensor:.1f}% (expected <= {TENSOR_ACTIVE_FP32_MAX:g}%: FP32 units, no Tensor Cores)")

    report.add(f"fp32 {label} TF32 off", fp32_load.tf32 in ("ieee", "highest"),
               f"torch's float32 matmul precision read back as {fp32_load.tf32!r} (expected 'ieee')")
    name = f"fp32 {label} ran on the FP32 units"
    if fp32_load.flops_per_s is None or not bf16_load.flops_per_s:
        report.fail(name, "the matmul loads measured no FLOP/s")
    else:
        ratio = fp32_load.flops_per_s / bf16_load.flops_per_s
        report.add(name, ratio <= FP32_OVER_BF16_MAX,
                   f"fp32 {fp32_load.flops_per_s / 1e12:.1f} vs bf16 {bf16_load.flops_per_s / 1e12:.1f} TFLOP/s "
                   f"= {ratio:.3f} (expected <= {FP32_OVER_BF16_MAX}: TF32 would be ~0.5)")

    for slot, metric in enumerate(("sm_active", "tensor_active")):
        name = f"gpm {label} {metric} vs dmon"
        mine = median_of(bf16, f"{label}.{metric}")
        if isinstance(dmon, str):
            report.fail(name, f"nvidia-smi dmon --gpm-metrics {DMON_GPM_IDS}: {dmon}")
        elif device["driver_index"] not in dmon:
            report.fail(name, f"nvidia-smi dmon gave no row for GPU {device['driver_index']}")
        elif mine is None:
            report.fail(name, f"absent: no {label}.{metric}")
        else:
            theirs = dmon[device["driver_index"]][slot]
            report.add(name, abs(mine - theirs) <= DMON_TOLERANCE,
                       f"gpuwidget {mine:.1f} vs dmon {theirs:.1f} (allowed {DMON_TOLERANCE:g} points)")


def check_own_process(report: Report, label: str, proc_mem: float | None, reserved: float | None,
                      apps: dict[int, float] | str, pid: int, foreign_namespace: bool) -> None:
    name = f"own {label} proc_mem vs torch memory_reserved"
    if proc_mem is None:
        why = " (the driver lists pids of another PID namespace)" if foreign_namespace else ""
        report.fail(name, f"absent: no {label}.proc_mem{why}")
    elif reserved is None:
        report.fail(name, "torch reported no memory_reserved")
    else:
        overhead = proc_mem - reserved
        report.figures[f"driver_overhead_{label}"] = overhead
        report.add(name, 0 <= overhead <= DRIVER_OVERHEAD_MAX,
                   f"proc_mem {proc_mem / GIB:.2f} GiB - memory_reserved {reserved / GIB:.2f} GiB = "
                   f"{overhead / MIB:.0f} MiB (allowed 0 to {DRIVER_OVERHEAD_MAX / MIB:.0f} MiB: the CUDA context, "
                   "its kernel modules and library handles)")
    name = f"own {label} proc_mem vs nvidia-smi compute-apps"
    if isinstance(apps, str):
        report.fail(name, f"nvidia-smi --query-compute-apps: {apps}")
    elif pid not in apps:
        report.fail(name, f"nvidia-smi lists pids {sorted(apps)} but not this process ({pid})")
    elif proc_mem is None:
        report.fail(name, f"absent: no {label}.proc_mem; nvidia-smi says {apps[pid] / MIB:.0f} MiB")
    else:
        report.add(name, abs(proc_mem - apps[pid]) <= APPS_TOLERANCE,
                   f"gpuwidget {proc_mem / MIB:.0f} MiB vs nvidia-smi {apps[pid] / MIB:.0f} MiB "
                   f"(allowed {APPS_TOLERANCE / MIB:.0f} MiB)")


# ------------------------------------------------------------------ workloads: judging a recorded Run


def absent(key: str) -> str:
    owner = CONTRACT.get(key)
    defined = key in summary_keys()
    return (f"absent: summary has no {key!r}"
            + ("" if defined else f" (not defined in this build{f'; {owner} adds it' if owner else ''})"))


def key_figures(summary: Mapping[str, Any]) -> str:
    """The figures the GPU rules judge, in a line, so a FAIL says why without opening the fixture."""
    names = {"gpu_sm_active_mean": "SM active", "gpu_busy_mean": "busy", "gpu_tensor_active_mean": "tensor",
             "process_cpu_mean": "process CPU", "data_wait_fraction": "wait", "peak_gpu_mem_fraction": "memory"}
    parts = []
    for key, word in names.items():
        value = summary.get(key)
        if isinstance(value, (int, float)):
            shown = f"{100 * value:.1f}%" if key in ("data_wait_fraction", "peak_gpu_mem_fraction") else f"{value:.1f}"
            parts.append(f"{word} {shown}")
    return ", ".join(parts)


def sampler_figures(run: Any) -> dict[str, Any]:
    """The watch's own cost: the sampler thread's CPU a tick, in all and by part (ms)."""
    sampler = getattr(run, "sampler", None) or {}
    ticks = sampler.get("ticks") or 0
    if not ticks:
        return {}
    return {"sampler_ms_per_tick": round(1e3 * (sampler.get("cpu_time_s") or 0.0) / ticks, 3),
            "sampler_parts_ms_per_tick": {part: round(1e3 * spent / ticks, 3)
                                          for part, spent in (sampler.get("part_cpu_s") or {}).items()}}


def judge_workload(report: Report, name: str, run: Any, hopper: bool, before: float | None, after: float | None,
                   measured_peak: float | None, analytic_flops: float | None) -> None:
    """The checks on one workload's Run: its rules, its busy figure, its change, its FLOPs and MFU."""
    summary = run.summary
    expectation = EXPECTED[name]
    ok, detail = judge_rules(name, [finding.rule for finding in run.findings])
    report.add(f"{name} rules", ok, f"{detail} [{key_figures(summary)}]")
    report.figures.setdefault("workloads", {})[name] = {
        "rules": [finding.rule for finding in run.findings], "samples_per_s": before, "after_samples_per_s": after,
        **{key: summary.get(key) for key in ("gpu_busy_mean", "gpu_busy_metric", "gpu_sm_active_mean",
                                             "gpu_kernel_running_mean", "gpu_tensor_active_mean", "process_cpu_mean",
                                             "data_wait_fraction", "peak_gpu_mem_fraction", "flops_per_step",
                                             "achieved_flops_per_s", "peak_flops_per_s", "mfu", "flops_dtype")},
        **sampler_figures(run)}

    check = f"{name} busy figure"
    metric, busy, sm = summary.get("gpu_busy_metric"), summary.get("gpu_busy_mean"), summary.get("gpu_sm_active_mean")
    if metric is None:
        report.fail(check, absent("gpu_busy_metric"))
    elif hopper:
        kernel = summary.get("gpu_kernel_running_mean")
        good = metric == "sm_active" and busy is not None and sm is not None and kernel is not None \
            and abs(busy - sm) <= BUSY_FIGURE_TOLERANCE
        report.add(check, good, f"gpu_busy_metric {metric!r}, gpu_busy_mean {busy}, SM active {sm}, kernel running "
                                f"(nvidia-smi) {kernel} (expected SM activity as the busy figure on this GPU)")
    else:
        report.add(check, metric == "kernel_running", f"gpu_busy_metric {metric!r} (no GPM before Hopper)")

    if expectation.change is not None:
        check = f"{name} change pays"
        if not before or after is None:
            report.fail(check, f"not measured ({expectation.change})")
        else:
            gain = after / before
            report.add(check, gain >= expectation.min_gain,
                       f"{before:.0f} -> {after:.0f} samples/s with {expectation.change} = {gain:.2f}x "
                       f"(needs {expectation.min_gain}x)")

    if analytic_flops is not None:
        check = f"{name} flops_per_step"
        counted, dtype = summary.get("flops_per_step"), summary.get("flops_dtype")
        if counted is None:
            report.fail(check, absent("flops_per_step"))
        else:
            error = abs(counted - analytic_flops) / analytic_flops
            report.add(check, error <= FLOPS_TOLERANCE and dtype == "bf16",
                       f"{counted:.4g} FLOPs ({dtype}) vs {analytic_flops:.4g} from the shapes "
                       f"({100 * error:.1f}% off, allowed {100 * FLOPS_TOLERANCE:.0f}%; dtype must be bf16)")
    if expectation.none_at_all:
        achieved = summary.get("achieved_flops_per_s")
        check = f"{name} achieved FLOP/s near the measured peak"
        if achieved is None:
            report.fail(check, absent("achieved_flops_per_s"))
        elif not measured_peak:
            report.fail(check, "the bf16 matmul peak was not measured")
        else:
            share, ceiling = achieved / measured_peak, summary.get("peak_flops_per_s")
            within = ceiling is None or achieved <= ceiling
            report.add(check, share >= ACHIEVED_OF_MEASURED_MIN and within,
                       f"{achieved / 1e12:.0f} TFLOP/s = {share:.2f} of the measured bf16 matmul rate "
                       f"{measured_peak / 1e12:.0f} TFLOP/s (expected >= {ACHIEVED_OF_MEASURED_MIN}, and at most "
                       + (f"the chip's dense peak {ceiling / 1e12:.0f} TFLOP/s)" if ceiling is not None
                          else "the chip's dense peak, unknown for this chip)"))
        check = f"{name} mfu"
        mfu, peak = summary.get("mfu"), summary.get("peak_flops_per_s")
        if mfu is None or peak is None or achieved is None:
            report.fail(check, absent("mfu" if mfu is None else "peak_flops_per_s" if peak is None
                                      else "achieved_flops_per_s"))
        else:
            expected = achieved / peak
            report.add(check, abs(mfu - expected) <= MFU_CONSISTENCY * expected and 0 < mfu <= 1,
                       f"mfu {mfu:.3f} vs achieved/peak {expected:.3f} (chip's dense peak {peak / 1e12:.0f} TFLOP/s)")


def fixture_text(run: Any, limit: int = FIXTURE_MAX_BYTES) -> tuple[str, int]:
    """The Run as fixture JSON of at most ``limit`` bytes where it can be: span times and step lists to
    1 us, and, if still too large, the oldest spans and step times left out as a long run leaves them.
    Returns (text, how many spans and steps were left out)."""
    data = run.to_dict()
    for span in data["trace"]["spans"]:
        span["start"], span["end"] = round(span["start"], 6), round(span["end"], 6)
    lists = [item for item in data["workload"].get("loaders") or []] + [data["workload"].get("training") or {}]
    for item in lists:
        for key in ("step_times", "wait_times", "step_ends"):
            if isinstance(item.get(key), list):
                item[key] = [round(v, 6) if isinstance(v, float) else v for v in item[key]]
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    dropped = 0
    while len(text) > limit and data["trace"]["spans"]:
        keep = max(0, int(len(data["trace"]["spans"]) * 0.7))
        dropped += len(data["trace"]["spans"]) - keep
        data["trace"]["spans"] = data["trace"]["spans"][-keep:] if keep else []
        for item in lists:
            for key in ("step_times", "wait_times", "step_ends"):
                if isinstance(item.get(key), list) and len(item[key]) > 64:
                    cut = int(len(item[key]) * 0.7)
                    dropped += len(item[key]) - cut
                    item[key] = item[key][-cut:]
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text, dropped


def replay_rules(path: Path) -> tuple[list[str], Any]:
    """The rules the current advisor finds on a saved Run, from its trace and facts (summary again)."""
    from gpuwidget.advice.advisor import advise
    from gpuwidget.figures.summary import summarize
    from gpuwidget.run import Run

    run = Run.load(path)
    summary = summarize(run.trace, run.workload, run.summary.get("duration_s"), run.machine)
    return [finding.rule for finding in advise(summary, run.workload, run.machine)], run


def save_fixture(report: Report, name: str, run: Any, folder: Path) -> None:
    """Save the Run as ``folder/NAME.json`` and replay it: small enough, and the same rules again."""
    check = f"{name} fixture"
    limit = report.fixture_limits.get(name, FIXTURE_MAX_BYTES)
    text, dropped = fixture_text(run, limit)
    path = folder / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    replayed, _ = replay_rules(path)
    recorded = sorted(finding.rule for finding in run.findings)
    good = len(text) <= limit and sorted(replayed) == recorded
    report.add(check, good, f"{path.name} {len(text) / 1000:.0f} kB (at most {limit / 1000:.0f} kB"
                            f"{f', {dropped} oldest spans/steps left out' if dropped else ''}); replayed rules "
                            f"{sorted(replayed)} vs recorded {recorded}")


# ------------------------------------------------------------------ the machine: real or fake


class Machine(Protocol):
    """What the check needs of the GPU, nvidia-smi and torch; :class:`RealMachine` and :class:`FakeMachine`."""

    hopper: bool
    name: str

    def close(self) -> None: ...

    def read(self) -> dict[str, float]: ...
    def now(self) -> float: ...
    def wait(self, seconds: float) -> None: ...
    def smi(self) -> list[dict[str, Any]]: ...
    def smi_apps(self) -> dict[int, float] | str: ...
    def dmon_start(self) -> None: ...
    def dmon_result(self) -> dict[int, tuple[float, float]] | str: ...
    def load(self, kind: str) -> contextlib.AbstractContextManager[LoadFigures]: ...
    def torch_reserved(self) -> float | None: ...
    def workload(self, name: str) -> tuple[Any, float | None, float | None, float | None]: ...

    unknown_fields: list[str]
    devices: list[dict[str, Any]]
    foreign_namespace: bool
    dmon_text: str  # what nvidia-smi dmon printed, kept in the report
    about: dict[str, Any]  # versions and nvidia-smi -q, kept in the report


def phase_reads(machine: Machine, rounds: int = ROUNDS) -> tuple[list[tuple[float, dict[str, float]]],
                                                                  list[list[dict[str, Any]]]]:
    """``rounds`` times: READS_PER_ROUND of gpuwidget's reads READ_GAP_S apart, then one nvidia-smi."""
    ours: list[tuple[float, dict[str, float]]] = []
    theirs: list[list[dict[str, Any]]] = []
    for _ in range(rounds):
        for _ in range(READS_PER_ROUND):
            machine.wait(READ_GAP_S)
            ours.append((machine.now(), machine.read()))
        theirs.append(machine.smi())
    return ours, theirs


def run_checks(machine: Machine, report: Report) -> None:
    """Every phase, in order, each only if it still fits in the budget; the report is written after each."""
    devices = machine.devices
    label = devices[0]["id"]
    report.figures["gpu"] = {"name": machine.name, "hopper_or_newer": machine.hopper}
    report.raw["about"] = machine.about

    with machine.load("bf16") as bf16_load:
        machine.wait(SETTLE_S)
        machine.dmon_start()
        timed, theirs = phase_reads(machine)
        dmon = machine.dmon_result()
        report.raw["dmon"] = machine.dmon_text
        reserved = machine.torch_reserved()
        last = machine.read()
        apps = machine.smi_apps()
    ours = bf16_reads = [values for _, values in timed]
    report.raw["smi_busy"] = theirs
    compare_readings(report, "busy", devices, ours, theirs, machine.unknown_fields)
    check_utilisation(report, "busy", label, ours, busy=True)
    check_energy(report, label, timed)
    check_own_process(report, label, last.get(f"{label}.proc_mem"), reserved, apps, os.getpid(),
                      machine.foreign_namespace)
    report.write()

    fp32_reads: list[dict[str, float]] = []
    fp32_load = LoadFigures()
    if report.fits("fp32"):
        with machine.load("fp32") as fp32_load:
            machine.wait(SETTLE_S)
            fp32_reads = [values for _, values in phase_reads(machine, rounds=2)[0]]
    report.figures["matmul_flops_per_s"] = {"bf16": bf16_load.flops_per_s, "fp32": fp32_load.flops_per_s}
    check_gpm(report, devices[0], machine.hopper, bf16_reads, fp32_reads, dmon, bf16_load, fp32_load)
    report.write()

    if report.fits("idle"):
        machine.wait(IDLE_SETTLE_S)
        timed, theirs = phase_reads(machine, rounds=3)
        ours = [values for _, values in timed]
        report.raw["smi_idle"] = theirs
        compare_readings(report, "idle", devices, ours, theirs, machine.unknown_fields)
        check_utilisation(report, "idle", label, ours, busy=False)
        report.write()
    else:
        report.fail("idle phase", "not run: out of time")

    with contextlib.ExitStack() as stack:
        fixtures = report.out / "fixtures" if report.out is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="gpu-check-fixtures-")))
        for name in EXPECTED:
            if not report.fits("workload"):
                report.fail(f"{name} rules", "not run: out of time")
                continue
            try:
                run, before, after, flops = machine.workload(name)
            except Exception as exc:  # noqa: BLE001 - one broken workload must not hide the others
                report.fail(f"{name} rules", f"the workload raised {type(exc).__name__}: {exc}")
                continue
            judge_workload(report, name, run, machine.hopper, before, after, bf16_load.flops_per_s, flops)
            save_fixture(report, name, run, fixtures)
            report.write()


def host_facts() -> dict[str, Any]:
    """What the host source's cost depends on (the H200 machine's sampler took ~12 ms a tick,
    BENCHMARKS.md section 8a): the kernel, its children lists, schedstat, PSI, processes, cores."""
    import platform

    pid = os.getpid()
    try:
        processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        processes = None
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "processes": processes,
            "proc_children_lists": os.path.exists(f"/proc/{pid}/task/{pid}/children"),
            "schedstat": os.path.exists(f"/proc/{pid}/schedstat"), "psi": os.path.exists("/proc/pressure/cpu")}


class RealMachine:  # pragma: no cover - needs an NVIDIA GPU
    """CUDA device 0 through torch, gpuwidget's NVML source, and nvidia-smi."""

    def __init__(self) -> None:
        import torch

        from gpuwidget.sources.nvml import NvmlSource

        self.torch = torch
        torch.cuda.init()  # the source then numbers devices by torch's UUIDs
        props = torch.cuda.get_device_properties(0)
        self.name = props.name
        self.hopper = (props.major, props.minor) >= (9, 0)
        self.source = NvmlSource()
        self.devices = list(self.source.describe())
        if not self.devices:
            raise RuntimeError(f"gpuwidget's NVML source found no GPU: {self.source.unavailable_reason}")
        self.foreign_namespace = bool(self.source.foreign_pid_namespace)
        self.fields = [*AUX_FIELDS, *(item.smi for item in FIELDS)]
        self.unknown_fields: list[str] = []
        self._dmon: subprocess.Popen[str] | None = None
        self.dmon_text = ""
        import pynvml

        query = self._smi("-q")
        self.about = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                      "nvidia_ml_py": getattr(pynvml, "__version__", None), "capability": [props.major, props.minor],
                      "nvidia_smi_q": (query.stdout or query.stderr)[:40_000], "host": host_facts()}

    def close(self) -> None:
        self.source.close()

    def read(self) -> dict[str, float]:
        return self.source.read()

    def now(self) -> float:
        return time.monotonic()

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def _smi(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)

    def smi(self) -> list[dict[str, Any]]:
        done = self._smi(f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits")
        if done.returncode != 0 and not self.unknown_fields:
            # One field this nvidia-smi does not know fails the whole query: find which, once.
            self.unknown_fields = [name for name in self.fields if name != "uuid" and self._smi(
                f"--query-gpu=uuid,{name}", "--format=csv,noheader,nounits").returncode != 0]
            self.fields = [name for name in self.fields if name not in self.unknown_fields]
            done = self._smi(f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits")
        return parse_query(done.stdout, self.fields) if done.returncode == 0 else []

    def smi_apps(self) -> dict[int, float] | str:
        done = self._smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        return parse_apps(done.stdout)

    def dmon_start(self) -> None:
        self._dmon = subprocess.Popen(["nvidia-smi", "dmon", "--gpm-metrics", DMON_GPM_IDS, "-c", str(DMON_SECONDS)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def dmon_result(self) -> dict[int, tuple[float, float]] | str:
        if self._dmon is None:
            return "not started"
        try:
            stdout, stderr = self._dmon.communicate(timeout=DMON_SECONDS + 20)
        except subprocess.TimeoutExpired:
            self._dmon.kill()
            return "no answer"
        self.dmon_text = stdout + stderr
        if self._dmon.returncode != 0:
            lines = (stderr or stdout).strip().splitlines()
            return lines[-1] if lines else f"exit status {self._dmon.returncode}"
        parsed = parse_dmon(stdout)
        return parsed if parsed else f"no GPM rows in: {stdout.strip()[-300:]!r}"

    def torch_reserved(self) -> float | None:
        return float(self.torch.cuda.memory_reserved(0))

    @contextlib.contextmanager
    def load(self, kind: str) -> Iterator[LoadFigures]:
        """A matmul loop on its own thread (bf16, or float32 with TF32 off), timed with CUDA events."""
        torch = self.torch
        figures = LoadFigures()
        stop = threading.Event()
        timed: list[tuple[float, float]] = []
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        with contextlib.ExitStack() as stack:
            if kind == "fp32":
                figures.tf32 = stack.enter_context(tf32_off())
            operands = [torch.randn(LOAD_N, LOAD_N, device="cuda", dtype=dtype) for _ in range(3)]
            per_chunk = 20 if kind == "bf16" else 3

            def loop() -> None:
                a, b, c = operands
                while not stop.is_set():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(per_chunk):
                        torch.mm(a, b, out=c)
                    end.record()
                    end.synchronize()
                    timed.append((2.0 * LOAD_N**3 * per_chunk, start.elapsed_time(end) / 1e3))

            worker = threading.Thread(target=loop, name="gpu-check-load", daemon=True)
            worker.start()
            try:
                yield figures
            finally:
                stop.set()
                worker.join(timeout=30)
                torch.cuda.synchronize()
            steady = timed[3:] or timed
            if steady:
                figures.flops_per_s = sum(f for f, _ in steady) / sum(s for _, s in steady)
            operands.clear()
            torch.cuda.empty_cache()

    def workload(self, name: str) -> tuple[Any, float | None, float | None, float | None]:
        import gpuwidget

        torch = self.torch
        build, changed = _gpu_workloads.BUILDERS[name]
        with contextlib.ExitStack() as stack:
            if name == "fp32_math":
                stack.enter_context(tf32_off())
            loop = build()
            _gpu_workloads.warm(loop)
            loop.reset()
            with gpuwidget.watch(quiet=True, interval=0.1, label=name) as run:
                before = _gpu_workloads.run_for(loop, _gpu_workloads.WATCH_S)
            flops = loop.flops_per_step
            del loop
            after = None
            if changed is not None:
                change = next((f.change for f in run.findings if EXPECTED[name].fires & {f.rule}), None) or {}
                better = changed(dict(change))
                _gpu_workloads.warm(better)
                better.reset()
                after = _gpu_workloads.run_for(better, _gpu_workloads.WATCH_S)
                del better
        torch.cuda.empty_cache()
        return run, before, after, flops


@contextlib.contextmanager
def tf32_off() -> Iterator[str | None]:  # pragma: no cover - needs torch with CUDA
    """Float32 matmuls and convolutions in IEEE FP32 (TF32 off) by whichever API this torch has;
    yields the matmul precision as read back; the previous settings return afterwards."""
    import torch

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    conv_node: Any = getattr(conv, "conv", None)
    if hasattr(matmul, "fp32_precision"):
        saved = (matmul.fp32_precision, conv_node.fp32_precision)
        matmul.fp32_precision, conv_node.fp32_precision = "ieee", "ieee"
        try:
            yield matmul.fp32_precision
        finally:
            matmul.fp32_precision, conv_node.fp32_precision = saved
    else:
        saved_legacy = (torch.get_float32_matmul_precision(), conv.allow_tf32)
        torch.set_float32_matmul_precision("highest")
        conv.allow_tf32 = False
        try:
            yield torch.get_float32_matmul_precision()
        finally:
            torch.set_float32_matmul_precision(saved_legacy[0])
            conv.allow_tf32 = saved_legacy[1]


# ------------------------------------------------------------------ the fake: tests/fakenvml.py and a fake nvidia-smi


# What the fake GPU shows in each phase of the check: a bf16 matmul, a float32 one (TF32 off), idle.
FAKE_PHASES: dict[str, dict[str, Any]] = {
    "bf16": {"util": 100, "mem_util": 45, "sm_active": 96.0, "tensor_active": 71.0, "sm_occupancy": 24.0,
             "dram_active": 38.0, "power_mw": 655_000, "temperature": 62, "sm_clock_mhz": 1755, "pcie_gen": 5},
    "fp32": {"util": 100, "mem_util": 20, "sm_active": 97.0, "tensor_active": 0.0, "sm_occupancy": 12.0,
             "dram_active": 9.0, "power_mw": 480_000, "temperature": 60, "sm_clock_mhz": 1980, "pcie_gen": 5},
    "idle": {"util": 0, "mem_util": 0, "sm_active": 0.0, "tensor_active": 0.0, "sm_occupancy": 0.0,
             "dram_active": 0.0, "power_mw": 118_000, "temperature": 41, "sm_clock_mhz": 345, "pcie_gen": 1},
}
FAKE_RATES = {"bf16": 790e12, "fp32": 51e12}
# The H200's facts as nvidia-smi prints them (MiB, W, MHz).
FAKE_H200: dict[str, Any] = {"name": "NVIDIA H200", "memory_total_mib": 143771, "reserved_mib": 503, "used_mib": 1570,
             "power_limit_w": 700.0, "power_min_w": 200.0, "power_max_w": 700.0, "mem_clock_mhz": 3201,
             "sm_clock_max_mhz": 1980}
# What the load's allocations add to the GPU's memory, and the driver's own share of this process.
FAKE_LOAD_BYTES = 3 * 2**28 + 2**26
FAKE_CONTEXT_BYTES = 522 * 2**20


def _reading_corruption(item: Field, value: float) -> float:
    """A wrong reading of ``item``: beyond its tolerance by a wide margin whatever the value."""
    allowed = tolerance(item, value, FAKE_H200["reserved_mib"] * MIB)
    return value + 5 * allowed + item.scale


@dataclass(frozen=True)
class Flip:
    """One reading or fact of the dry run made wrong, and the checks that must FAIL for it."""

    must: frozenset[str]
    may: frozenset[str] = frozenset()  # checks the same wrong value can fail too


def _flips() -> dict[str, Flip]:
    flips: dict[str, Flip] = {}
    for item in FIELDS:
        phases = frozenset({f"busy gpu0 {item.metric}", f"idle gpu0 {item.metric}"})
        may = {"power": {"energy gpu0 counter vs power x time"},
               "util": {"busy gpu0 utilisation", "idle gpu0 utilisation"}}.get(item.metric, set())
        flips[f"wrong {item.metric}"] = Flip(phases, frozenset(may))
        flips[f"no {item.metric}"] = Flip(phases, frozenset(may) | ({"busy gpu0 utilisation", "idle gpu0 utilisation"}
                                                                   if item.metric == "util" else set()))
    flips.update({
        "idle utilisation frozen": Flip(frozenset({"idle gpu0 utilisation"}), frozenset({"idle gpu0 util"})),
        "busy utilisation low": Flip(frozenset({"busy gpu0 utilisation"}), frozenset({"busy gpu0 util"})),
        "energy counter slow": Flip(frozenset({"energy gpu0 counter vs power x time"})),
        "no gpm": Flip(frozenset({"gpm gpu0 supported", "gpm gpu0 tensor_active under bf16",
                                  "gpm gpu0 sm_active under bf16", "gpm gpu0 sm_occupancy under bf16",
                                  "gpm gpu0 dram_active under bf16", "gpm gpu0 sm_active under fp32",
                                  "gpm gpu0 tensor_active under fp32 with TF32 off", "gpm gpu0 sm_active vs dmon",
                                  "gpm gpu0 tensor_active vs dmon"})),
        "tensor idle under bf16": Flip(frozenset({"gpm gpu0 tensor_active under bf16"}),
                                       frozenset({"gpm gpu0 tensor_active vs dmon"})),
        "tensor busy under fp32": Flip(frozenset({"gpm gpu0 tensor_active under fp32 with TF32 off"})),
        "sm idle under fp32": Flip(frozenset({"gpm gpu0 sm_active under fp32"})),
        "sm idle under bf16": Flip(frozenset({"gpm gpu0 sm_active under bf16"}),
                                   frozenset({"gpm gpu0 sm_active vs dmon"})),
        "no sm_occupancy": Flip(frozenset({"gpm gpu0 sm_occupancy under bf16"})),
        "no dram_active": Flip(frozenset({"gpm gpu0 dram_active under bf16"})),
        "dmon disagrees": Flip(frozenset({"gpm gpu0 sm_active vs dmon", "gpm gpu0 tensor_active vs dmon"})),
        "dmon fails": Flip(frozenset({"gpm gpu0 sm_active vs dmon", "gpm gpu0 tensor_active vs dmon"})),
        "tf32 left on": Flip(frozenset({"fp32 gpu0 TF32 off"})),
        "fp32 ran as tf32": Flip(frozenset({"fp32 gpu0 ran on the FP32 units"})),
        "proc_mem off": Flip(frozenset({"own gpu0 proc_mem vs torch memory_reserved",
                                        "own gpu0 proc_mem vs nvidia-smi compute-apps"})),
        "no proc_mem": Flip(frozenset({"own gpu0 proc_mem vs torch memory_reserved",
                                       "own gpu0 proc_mem vs nvidia-smi compute-apps"})),
        "pid not in compute-apps": Flip(frozenset({"own gpu0 proc_mem vs nvidia-smi compute-apps"})),
        "gpu missing from nvidia-smi": Flip(frozenset({"busy gpu0 uuid", "idle gpu0 uuid"}),
                                            frozenset(f"{phase} gpu0 {item.metric}" for phase in ("busy", "idle")
                                                      for item in FIELDS)),
    })
    for name, expectation in EXPECTED.items():
        flips[f"{name} misjudged"] = Flip(frozenset({f"{name} rules"}), frozenset({f"{name} fixture"}))
        flips[f"{name} without sm activity"] = Flip(frozenset({f"{name} busy figure"}),
                                                    frozenset({f"{name} rules", f"{name} fixture"}))
        flips[f"{name} fixture too large"] = Flip(frozenset({f"{name} fixture"}))
        if expectation.change is not None:
            flips[f"{name} change does not pay"] = Flip(frozenset({f"{name} change pays"}))
    flips["bf16_matmul flops miscounted"] = Flip(frozenset({"bf16_matmul flops_per_step"}),
                                                 frozenset({"bf16_matmul achieved FLOP/s near the measured peak",
                                                            "bf16_matmul mfu"}))
    flips["bf16_matmul slow"] = Flip(frozenset({"bf16_matmul achieved FLOP/s near the measured peak"}),
                                     frozenset({"bf16_matmul mfu"}))
    # A chip without a peak in gpuwidget's table: no MFU to give.
    flips["bf16_matmul on an unknown chip"] = Flip(frozenset({"bf16_matmul mfu"}))
    return flips


FLIPS = _flips()


@dataclass(frozen=True)
class FakeWorkload:
    """The figures a GPU run of one workload gives (from its design), for the dry run's Run."""

    util: float
    sm_active: float
    tensor_active: float
    process_cpu: float
    param_dtype: str = "bfloat16"
    autocast: str | None = None
    loader: dict[str, Any] | None = None  # batch_size, wait_fraction, wait_cpu_ratio, batch_device
    step_s: float = 0.01
    samples_per_step: int = 64
    mem_fraction: float = 0.02
    flops_per_step: float = 1e9
    rates: tuple[float, float | None] = (1000.0, None)
    chip: str = FAKE_H200["name"]


FAKE_WORKLOADS = {
    "launch_bound": FakeWorkload(util=93, sm_active=5.0, tensor_active=0.0, process_cpu=100.0, step_s=0.012,
                                 flops_per_step=0.0, rates=(5300.0, 61000.0)),
    # As the first H200 ran it: the host pegged launching a batch-8 step, the data already on the GPU.
    "small_batch": FakeWorkload(util=14, sm_active=3.3, tensor_active=0.1, process_cpu=98.0, autocast="bfloat16",
                                param_dtype="float32",
                                loader={"batch_size": 8, "wait_fraction": 0.03, "batch_device": "cuda"},
                                step_s=0.004, samples_per_step=8, flops_per_step=3.2e8, rates=(2000.0, 390000.0)),
    "fp32_math": FakeWorkload(util=100, sm_active=97.0, tensor_active=0.0, process_cpu=100.0, param_dtype="float32",
                              step_s=0.0102, samples_per_step=1024, mem_fraction=0.03, flops_per_step=4.8e11,
                              rates=(100000.0, 610000.0)),
    "dataloader_starved": FakeWorkload(util=4, sm_active=0.6, tensor_active=0.1, process_cpu=100.0,
                                       loader={"batch_size": 32, "wait_fraction": 0.97, "wait_cpu_ratio": 1.0},
                                       step_s=0.033, samples_per_step=32, flops_per_step=1.1e9,
                                       rates=(960.0, 7400.0)),
    "bf16_matmul": FakeWorkload(util=100, sm_active=98.0, tensor_active=83.0, process_cpu=100.0, step_s=0.0161,
                                samples_per_step=_gpu_workloads.BF16_BATCH, mem_fraction=0.02,
                                flops_per_step=_gpu_workloads.bf16_matmul_flops(), rates=(508000.0, None)),
}
FAKE_TICKS = 30  # per workload, 0.1 s each


class FakeMachine:
    """The check's whole path against tests/fakenvml.py: gpuwidget's real NVML source reads a fake H200
    whose figures follow the phase (bf16 load, fp32 load, idle), nvidia-smi's text is written from the
    same fake state (and parsed by the same parsers), and each workload's Run is built by gpuwidget's
    own summary and advisor from a Trace the NVML source read and the facts such a run records.
    ``flip`` names one entry of :data:`FLIPS` to make wrong."""

    def __init__(self, flip: str | None = None) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from gpuwidget.sources.nvml import NvmlSource

        from fakenvml import FakeNvml, make_gpu

        if flip is not None and flip not in FLIPS:
            raise ValueError(f"unknown flip {flip!r}")
        self.flip = flip
        self.name, self.hopper = FAKE_H200["name"], True
        self.phase = "idle"
        self.gpu = make_gpu(0, name=FAKE_H200["name"], memory_total=FAKE_H200["memory_total_mib"] * 2**20,
                            memory_reserved=FAKE_H200["reserved_mib"] * 2**20, power_limit_mw=700_000,
                            power_limit_default_mw=700_000, sm_clock_max_mhz=FAKE_H200["sm_clock_max_mhz"],
                            power_limit_min_mw=int(FAKE_H200["power_min_w"] * 1000),
                            power_limit_max_mw=int(FAKE_H200["power_max_w"] * 1000),
                            mem_clock_mhz=FAKE_H200["mem_clock_mhz"], gpm=flip != "no gpm")
        self.fake = FakeNvml([self.gpu])
        self._set_phase("idle")
        self._patch = self.fake.patched()
        self._patch.__enter__()
        self.fake.processes(0, compute=[(os.getpid(), FAKE_CONTEXT_BYTES)])
        self.source = NvmlSource()
        self.devices = list(self.source.describe())
        self.foreign_namespace = False
        self.unknown_fields: list[str] = []
        self.fields = [*AUX_FIELDS, *(item.smi for item in FIELDS)]
        self._reserved = 0.0
        self.dmon_text = ""
        self.about = {"fake": "tests/fakenvml.py"}

    def close(self) -> None:
        self.source.close()
        self._patch.__exit__(None, None, None)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        values = dict(FAKE_PHASES[phase])
        if self.flip == "tensor idle under bf16" and phase == "bf16":
            values["tensor_active"] = 0.0
        if self.flip == "tensor busy under fp32" and phase == "fp32":
            values["tensor_active"] = 35.0
        if self.flip == "sm idle under fp32" and phase == "fp32":
            values["sm_active"] = 8.0
        if self.flip == "sm idle under bf16" and phase == "bf16":
            values["sm_active"] = 30.0
        if self.flip == "idle utilisation frozen" and phase == "idle":
            values["util"] = FAKE_PHASES["bf16"]["util"]
            self.gpu.samples_while_idle = True
        if self.flip == "busy utilisation low" and phase == "bf16":
            values["util"] = 40
        used = FAKE_H200["used_mib"] * 2**20 + (FAKE_LOAD_BYTES if phase != "idle" else 0)
        self.fake.set(0, memory_used=used, **values)

    # -- gpuwidget's side

    def read(self) -> dict[str, float]:
        values = self.source.read()
        flip = self.flip or ""
        for item in FIELDS:
            key = f"gpu0.{item.metric}"
            if flip == f"wrong {item.metric}" and key in values:
                values[key] = _reading_corruption(item, values[key])
            if flip == f"no {item.metric}":
                values.pop(key, None)
        if flip == "energy counter slow" and "gpu0.energy_j" in values:
            values["gpu0.energy_j"] = self.gpu.energy_base_mj / 1e3 + (values["gpu0.energy_j"]
                                                                        - self.gpu.energy_base_mj / 1e3) * 0.5
        if flip == "no sm_occupancy":
            values.pop("gpu0.sm_occupancy", None)
        if flip == "no dram_active":
            values.pop("gpu0.dram_active", None)
        if flip == "proc_mem off" and "gpu0.proc_mem" in values:
            values["gpu0.proc_mem"] += 4 * GIB
        if flip == "no proc_mem":
            values.pop("gpu0.proc_mem", None)
        return values

    def now(self) -> float:
        return self.fake.now()

    def wait(self, seconds: float) -> None:
        self.fake.step(max(1, round(seconds / self.fake.tick_s)))

    # -- nvidia-smi's side, from the fake's true state

    def smi(self) -> list[dict[str, Any]]:
        from fakenvml import _at

        gpu, tick, facts = self.gpu, self.fake.tick, FAKE_H200
        truth = {
            "uuid": gpu.uuid if self.flip != "gpu missing from nvidia-smi" else "GPU-ffffffff-0000",
            "memory.reserved": facts["reserved_mib"],
            "memory.used": round(int(_at(gpu.memory_used, tick)) / 2**20),
            "memory.total": facts["memory_total_mib"],
            "power.draw": f"{_at(gpu.power_mw, tick) / 1000:.2f}",
            "enforced.power.limit": f"{_at(gpu.power_limit_mw, tick) / 1000:.2f}",
            "power.default_limit": f"{gpu.power_limit_default_mw / 1000:.2f}",
            "power.min_limit": f"{facts['power_min_w']:.2f}", "power.max_limit": f"{facts['power_max_w']:.2f}",
            "clocks.sm": _at(gpu.sm_clock_mhz, tick), "clocks.max.sm": gpu.sm_clock_max_mhz,
            "clocks.mem": facts["mem_clock_mhz"], "temperature.gpu": _at(gpu.temperature, tick),
            "utilization.gpu": int(_at(gpu.util, tick)), "utilization.memory": int(_at(gpu.mem_util, tick)),
            "pcie.link.gen.current": _at(gpu.pcie_gen, tick), "pcie.link.gen.max": gpu.pcie_gen_max,
            "pcie.link.width.current": _at(gpu.pcie_width, tick), "pcie.link.width.max": gpu.pcie_width_max,
        }
        if self.flip == "idle utilisation frozen" and self.phase == "idle":
            truth["utilization.gpu"] = 0  # the GPU really is idle; only gpuwidget's reading froze
        if self.flip == "busy utilisation low" and self.phase == "bf16":
            truth["utilization.gpu"] = 100
        line = ", ".join(str(truth[name]) for name in self.fields)
        return parse_query(line, self.fields)

    def smi_apps(self) -> dict[int, float] | str:
        pid = os.getpid() if self.flip != "pid not in compute-apps" else 4_000_001
        used = FAKE_CONTEXT_BYTES + (self._reserved if self.phase != "idle" else 0)
        return parse_apps(f"{pid}, {round(used / 2**20)}")

    def dmon_start(self) -> None:
        pass

    def dmon_result(self) -> dict[int, tuple[float, float]] | str:
        if self.flip == "dmon fails":
            return "Failed to process command line for GPM metrics"
        values = FAKE_PHASES["bf16"]
        sm, tensor = values["sm_active"], values["tensor_active"]
        if self.flip == "dmon disagrees":
            sm, tensor = sm - 40, tensor - 40
        # dmon's default columns first (one it cannot fill: "-"), the GPM metrics asked for last
        text = ["# gpu    pwr  gtemp  mtemp     sm    mem   mclk   pclk  gpm:2  gpm:5",
                "# Idx      W      C      C      %      %    MHz    MHz      %      %"]
        text += [f"    {self.gpu.index}    655     62      -    100     45   3201   1755  {sm:5.0f}  {tensor:5.0f}"
                 for _ in range(DMON_SECONDS)]
        self.dmon_text = "\n".join(text)
        return parse_dmon(self.dmon_text)

    # -- torch's side

    @contextlib.contextmanager
    def load(self, kind: str) -> Iterator[LoadFigures]:
        figures = LoadFigures(tf32="tf32" if self.flip == "tf32 left on" and kind == "fp32"
                              else ("ieee" if kind == "fp32" else None))
        self._reserved = float(FAKE_LOAD_BYTES)
        # the driver's figure for this process: its context plus what torch's allocator reserved
        self.fake.processes(0, compute=[(os.getpid(), FAKE_CONTEXT_BYTES + FAKE_LOAD_BYTES)])
        self._set_phase(kind)
        try:
            yield figures
        finally:
            rate = FAKE_RATES[kind]
            if self.flip == "fp32 ran as tf32" and kind == "fp32":
                rate = FAKE_RATES["bf16"] / 2
            figures.flops_per_s = rate
            self._reserved = 0.0
            self.fake.processes(0, compute=[(os.getpid(), FAKE_CONTEXT_BYTES)])
            self._set_phase("idle")

    def torch_reserved(self) -> float | None:
        return self._reserved

    def workload(self, name: str) -> tuple[Any, float | None, float | None, float | None]:
        spec = FAKE_WORKLOADS[name]
        flip = self.flip or ""
        if flip == f"{name} misjudged":
            spec = _misjudged(name, spec)
        if flip == "bf16_matmul slow" and name == "bf16_matmul":
            spec = FakeWorkload(**{**asdict(spec), "step_s": spec.step_s * 2})
        if flip == "bf16_matmul flops miscounted" and name == "bf16_matmul":
            spec = FakeWorkload(**{**asdict(spec), "flops_per_step": spec.flops_per_step * 2})
        if flip == "bf16_matmul on an unknown chip" and name == "bf16_matmul":
            spec = FakeWorkload(**{**asdict(spec), "chip": "NVIDIA Prototype"})
        # The workload's fake GPU replaces this one while its Run is recorded (fakes do not nest).
        self._patch.__exit__(None, None, None)
        try:
            run = fake_run(name, spec, gpm=flip != f"{name} without sm activity")
        finally:
            self._patch = self.fake.patched()
            self._patch.__enter__()
        before, after = spec.rates
        if flip == f"{name} change does not pay":
            after = before
        flops = _gpu_workloads.bf16_matmul_flops() if name == "bf16_matmul" else None
        return run, before, after, flops


def _misjudged(name: str, spec: FakeWorkload) -> FakeWorkload:
    """The workload's figures changed so that its rule is silent or a rival rule speaks."""
    changes: dict[str, dict[str, Any]] = {
        "launch_bound": {"process_cpu": 50.0},  # not pegged: small-batch's case, not launch-bound's
        "small_batch": {"loader": {"batch_size": 8, "wait_fraction": 0.3}},  # starved, not small
        "fp32_math": {"tensor_active": 40.0},  # Tensor Cores busy: fp32-math has nothing to say
        "dataloader_starved": {"param_dtype": "float32"},  # fp32-math claims the idle GPU
        "bf16_matmul": {"mem_fraction": 0.97},  # memory-pressure speaks up
    }
    return FakeWorkload(**{**asdict(spec), **changes[name]})


def fake_run(name: str, spec: FakeWorkload, gpm: bool = True) -> Any:
    """A Run of one workload as a GPU run leaves it: gpuwidget's NVML source reads a fake H200 showing
    the workload's figures into a Trace beside host readings, with the loader, model, CUDA and training
    facts the probes record for such a loop; then gpuwidget's own summary and advisor judge it."""
    from gpuwidget.advice.advisor import advise
    from gpuwidget.figures.summary import summarize
    from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
    from gpuwidget.run import Run
    from gpuwidget.sources.nvml import NvmlSource
    from gpuwidget.trace import Trace

    from fakenvml import FakeNvml, make_gpu

    total = FAKE_H200["memory_total_mib"] * 2**20
    used = int(spec.mem_fraction * total)
    gpu = make_gpu(0, name=spec.chip, memory_total=total, memory_used=used, util=spec.util,
                   sm_active=spec.sm_active, tensor_active=spec.tensor_active, gpm=gpm, power_mw=300_000,
                   samples_while_idle=True, sm_clock_max_mhz=FAKE_H200["sm_clock_max_mhz"], sm_clock_mhz=1900)
    fake = FakeNvml([gpu])
    trace = Trace()
    duration = FAKE_TICKS * fake.tick_s
    with fake.patched():
        fake.processes(0, compute=[(os.getpid(), used)])
        source = NvmlSource()
        try:
            for tick in range(FAKE_TICKS + 1):
                values = source.read()
                values.update({"cpu.util": spec.process_cpu / 16 + 2.0, "proc.cpu": spec.process_cpu})
                trace.append(tick * fake.tick_s, values)
                fake.step()
            machine: Any = {"gpus": source.describe(), "usable_cpus": 16, "cpu_count": 16,
                            "mem_total": 2 * 2**40, "gpu_message": None, "pid": os.getpid()}
        finally:
            source.close()
    steps = int(duration / spec.step_s)
    step_ends = [round((i + 1) * spec.step_s, 6) for i in range(steps)]
    workload: Any = {
        "torch": "2.11.0+cu130",
        "model": {"name": "model", "class": "Sequential", "parameters": 10**7,
                  "param_dtypes": {spec.param_dtype: 10**7}, "param_devices": ["cuda"], "input_dtype": spec.param_dtype,
                  "input_device": "cuda", "training": True, "calls": 16, "compiled": False,
                  "autocast": {"enabled": spec.autocast is not None, "dtype": spec.autocast, "device_type": "cuda"},
                  "tf32_api": "fp32_precision", "matmul_fp32_precision": "ieee", "float32_matmul_precision": "highest",
                  "cuda_matmul_allow_tf32": False, "conv_fp32_precision": "ieee", "cudnn_allow_tf32": False,
                  "data_parallel": False},
        "cuda": {"devices": [{"index": 0, "name": spec.chip, "capability": [9, 0], "total_memory": total,
                              "peak_allocated": int(used * 0.8), "peak_reserved": int(used * 0.9),
                              "uuid": gpu.uuid.removeprefix("GPU-")}], "peak_since_cell_start": True},
        "loaders": [],
        # TrainingFacts (the optimizer-step probe's figures, probes.torch_steps)
        "training": {"device_type": "cuda", "model_class": "Sequential",
                     "optimizer_steps": steps, "step_times": [spec.step_s] * steps, "step_ends": step_ends,
                     "forward_calls": steps, "autocast_share": 1.0 if spec.autocast else 0.0,
                     "autocast_dtype": spec.autocast, "flops_per_step": spec.flops_per_step,
                     "flops_counted_at_step": 3,
                     "flops_dtype": "bf16" if spec.param_dtype == "bfloat16" or spec.autocast else "fp32",
                     "samples_per_step": spec.samples_per_step, "between_s": 0.0, "step_source": "optimizer"},
    }
    if spec.loader is not None:
        wait_fraction = spec.loader["wait_fraction"]
        wait = spec.step_s * wait_fraction
        for i in range(steps):
            start = i * spec.step_s
            trace.add_span(DATA_WAIT_SPAN, start, start + wait)
            trace.add_span(STEP_SPAN, start, start + spec.step_s)
        batch = spec.loader["batch_size"]
        workload["loaders"] = [{
            "name": "loader", "dataset_name": "data", "epochs": 1, "steps": steps, "samples": steps * batch,
            "wait_total_s": steps * wait, "compute_total_s": steps * (spec.step_s - wait),
            "loop_time_s": steps * spec.step_s, "wait_cpu_ratio": spec.loader.get("wait_cpu_ratio", 0.0),
            "wait_delay_ratio": 0.0, "step_times": [spec.step_s] * steps, "wait_times": [wait] * steps,
            "owner": None, "built_at": None, "batch_device": spec.loader.get("batch_device", "cpu"),
            "settings": {"batch_size": batch, "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
                         "persistent_workers": False, "drop_last": True, "timeout": 0.0, "shuffle": False,
                         "sampler": "SequentialSampler", "custom_sampler": False, "custom_batch_sampler": False,
                         "collate_fn": "default_collate", "default_collate": True, "dataset_type": "Dataset",
                         "dataset_len": 1 << 20, "iterable_dataset": False, "worker_init_fn": None,
                         "batch_sampler_given": False, "generator": False, "shards_by_worker": None,
                         "dataset_code": None, "dataset_transforms": [], "multiprocessing_context": None}}]
    summary = summarize(trace, workload, duration, machine)
    findings = advise(summary, workload, machine)
    return Run(trace=trace, summary=summary, findings=findings, workload=workload, machine=machine, label=name,
               finished=True)


# ------------------------------------------------------------------ main


def dry_run(flip: str | None = None, out: Path | None = None, quiet: bool = True,
            fixture_limit: int = FIXTURE_MAX_BYTES) -> Report:
    """The whole check against the fake, ``flip`` made wrong; the report (nothing printed when quiet)."""
    report = Report(out=out, quiet=quiet)
    if flip is not None and flip.endswith(" fixture too large"):
        report.fixture_limits[flip.removesuffix(" fixture too large")] = 1000
    machine = FakeMachine(flip)
    try:
        run_checks(machine, report)
    finally:
        machine.close()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="against tests/fakenvml.py and a fake nvidia-smi")
    parser.add_argument("--out", help="write gpu_check.json, gpu_check.log and fixtures/NAME.json here")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"start no phase that would end after this many seconds (default {DEFAULT_BUDGET_S:g})")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else None
    if args.dry_run:
        report = Report(out=out, budget_s=args.budget_s)
        machine: Machine = FakeMachine()
    else:  # pragma: no cover - needs a GPU
        if shutil.which("nvidia-smi") is None:
            print("gpu_check: no nvidia-smi here; run with --dry-run, or on a machine with an NVIDIA GPU.")
            return 2
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch sees no CUDA device (a CPU build of torch?).")
            return 2
        report = Report(out=out, budget_s=args.budget_s)
        machine = RealMachine()
    try:
        run_checks(machine, report)
    except Exception as exc:  # noqa: BLE001 - what was found so far is still written
        report.fail("gpu_check", f"stopped by {type(exc).__name__}: {exc}")
        raise
    finally:
        machine.close()
        report.write()
        print(report.totals())
    return 1 if any(check.verdict == "FAIL" for check in report.checks) else 0


if __name__ == "__main__":
    sys.exit(main())
