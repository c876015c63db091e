"""How a run reads: a Run and its Findings as HTML (with an inline SVG chart) and as plain text.

Every rendering lives here (the model objects render themselves through it, as Rich objects
do with ``__rich_console__``): the run's text and HTML, its chart, the standalone HTML
document ``Run.save('x.html')`` writes, and the small result tables of the tuner and the
batch probe. It imports nothing from ``gpuwidget.ui``: ``run.py`` and ``advice/finding.py``
import it at module top. Same content both ways: a headline (throughput, SM active and kernel running, the main
cause in one line),
where the loop's time went (waiting for data / computing / other), the findings ranked by
expected gain with their evidence, a copyable change and the gain bound, and a chart of
the run. It is what the notebook shows when a watched cell ends, and what a saved
notebook, nbconvert, GitHub and terminal IPython show later: it needs no widget state,
no JavaScript (a copy button is a nicety) and no network.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import quote

import numpy as np

from gpuwidget.chart import (
    CPU_COLOR,
    SVG_DASH,
    WAIT_COLOR,
    gpu_series,
    merge_bands,
    percent_data,
    plot_columns,
    sm_active_gpus,
)
from gpuwidget.facts import Summary
from gpuwidget.figures.summary import gpu_scope_notes
from gpuwidget.probes import DATA_WAIT_SPAN
from gpuwidget.sources.gpu import NO_GPU
from gpuwidget.trace import gpu_indices

if TYPE_CHECKING:
    from gpuwidget.advice.finding import Finding
    from gpuwidget.run import Run

CHART_WIDTH = 640
CHART_HEIGHT = 120
CHART_POINTS = 400
SEVERITY_COLOR = {"critical": "#c0392b", "warn": "#d68910", "info": "#2e86c1"}


# ----------------------------------------------------------------- formatting


def _unknown(value: float | None) -> bool:
    """No figure to show: missing, or NaN/infinite (a run built in memory may hold them)."""
    return value is None or not math.isfinite(value)


def fmt_percent(value: float | None) -> str:
    """A percentage given as 0-100: "41%". Every percentage a user reads goes through this or
    :func:`fmt_fraction`, so one figure never shows as two roundings."""
    return "n/a" if value is None or _unknown(value) else f"{value:.0f}%"


def fmt_fraction(value: float | None) -> str:
    """A share given as 0-1, as a percentage: 0.406 -> "41%"."""
    return "n/a" if value is None or _unknown(value) else fmt_percent(100 * value)


def fmt_mfu(value: float) -> str:
    """Model FLOPs utilisation as a percentage, two significant digits below 1% (a batch-8 MLP on an
    H200 reached 0.019%: "0%" would hide how far from the peak it is): 0.711 -> "71%"."""
    percent = 100 * value
    if percent <= 0 or percent >= 1 or _unknown(value):
        return fmt_fraction(value)
    return f"{percent:.2g}%"


def fmt_count(count: int, noun: str, plural: str | None = None) -> str:
    """A count with its noun agreeing: "1 worker", "0 workers", "4 cores"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def fmt_speedup(value: float | None) -> str:
    """A speed-up factor: "1.68x"."""
    return "n/a" if value is None or _unknown(value) else f"{value:.2f}x"


def fmt_gain(expected: float, bound: float | None = None, remained: str = "no waiting") -> str:
    """The gain of a change, the one way the headline, the findings and Measure say it: "up to 1.68x
    faster", or with the bound if no waiting remained where it is larger: "about 1.12x faster (at most
    1.23x if no waiting remained)"."""
    if bound is not None and not _unknown(bound) and round(bound, 2) > round(expected, 2):
        return f"about {fmt_speedup(expected)} faster (at most {fmt_speedup(bound)} if {remained} remained)"
    return f"up to {fmt_speedup(expected)} faster"


def fmt_seconds(value: float | None) -> str:
    if value is None or _unknown(value):
        return "n/a"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{int(value // 60)} min {value % 60:.0f} s"


def fmt_rate(value: float | None) -> str:
    if value is None or _unknown(value):
        return "n/a"
    return f"{value:,.0f}/s" if value >= 100 else f"{value:.1f}/s"


def fmt_flops(flops_per_s: float | None) -> str:
    """FLOP/s with the prefix that keeps three figures: 312 TFLOP/s on a GPU, 41.2 GFLOP/s on a CPU."""
    if flops_per_s is None or _unknown(flops_per_s):
        return "n/a"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G")):
        if abs(flops_per_s) >= scale:
            return f"{flops_per_s / scale:.3g} {prefix}FLOP/s"
    return f"{flops_per_s / 1e6:.3g} MFLOP/s"


def fmt_energy(joules: float | None) -> str:
    """Joules in the unit that keeps three figures: 850 mJ, 12.3 J, 4.1 kJ, 2.75 MJ."""
    if joules is None or _unknown(joules):
        return "n/a"
    for scale, unit in ((1e6, "MJ"), (1e3, "kJ"), (1.0, "J")):
        if abs(joules) >= scale:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules * 1e3:.3g} mJ"


def fmt_money(value: float | None) -> str:
    """An amount in the price's own currency (the user's): 1,234.50, 2.35, 0.0042."""
    if value is None or _unknown(value):
        return "n/a"
    return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.2g}"


# How the busy figures are named where users read them (dcgm-exporter's names; nvidia-smi's utilisation
# as what it is: the share of time any kernel ran).
SM_ACTIVE_LABEL = "SM active"
KERNEL_RUNNING_LABEL = "kernel running (nvidia-smi)"


def busy_items(summary: Summary) -> list[tuple[str, str]]:
    """The headline's busy figures: "SM active" where GPM measured it, "kernel running (nvidia-smi)"
    (NVML's utilisation) beside it or alone, or "not measured" where neither exists (a MIG instance
    without GPM: the GPU lines say why). A run saved before ``gpu_busy_metric`` held utilisation."""
    metric = summary.get("gpu_busy_metric")
    busy = summary.get("gpu_busy_mean")
    if summary.get("gpu_busy_missing") and busy is None:
        return [(SM_ACTIVE_LABEL, "not measured")]
    if metric == "sm_active":
        items = [(SM_ACTIVE_LABEL, fmt_percent(busy))]
        if summary.get("gpu_kernel_running_mean") is not None:
            items.append((KERNEL_RUNNING_LABEL, fmt_percent(summary["gpu_kernel_running_mean"])))
        return items
    return [(KERNEL_RUNNING_LABEL, fmt_percent(busy))]


def cost_item(summary: Summary) -> tuple[str, str] | None:
    """("cost at 2.5/GPU-h", "0.42 (0.31 idle)") where a price was given, else None."""
    if summary.get("cost") is None:
        return None
    idle = summary.get("idle_cost")
    text = fmt_money(summary["cost"]) + (f" ({fmt_money(idle)} idle)" if idle is not None else "")
    return f"cost at {summary.get('gpu_hour_price', 0):g}/GPU-h", text


def throughput(summary: Summary) -> list[tuple[str, str]]:
    """The headline's first figures: samples/s, achieved FLOP/s, and MFU where a GPU trained and its
    peak is known (a model on the CPU shows GFLOP/s and no MFU claim)."""
    items: list[tuple[str, str]] = []
    if summary.get("samples_per_s") is not None:
        items.append(("samples/s", fmt_rate(summary["samples_per_s"])))
    if summary.get("achieved_flops_per_s") is not None:
        items.append(("achieved", fmt_flops(summary["achieved_flops_per_s"])))
    if summary.get("mfu") is not None:
        items.append(("MFU", fmt_mfu(summary["mfu"])))
    return items


def headline(run: Run) -> list[tuple[str, str]]:
    """The figures shown first, as (label, value) pairs, in order."""
    s = run.summary
    items: list[tuple[str, str]] = [*throughput(s), ("duration", fmt_seconds(s.get("duration_s")))]
    if s.get("energy_j") is not None:  # NVML's energy counter: per sample (or step) where counted
        per_sample, per_step = s.get("energy_per_sample_j"), s.get("energy_per_step_j")
        per = f"{fmt_energy(per_sample)}/sample, " if per_sample is not None else \
            f"{fmt_energy(per_step)}/step, " if per_step is not None else ""
        items.append(("GPU energy", f"{per}{fmt_energy(s['energy_j'])} total"))
    if s.get("steps") is not None:
        items.append(("steps", f"{s['steps']:,}"))
    if (waited := wait_share(run)) is not None:
        items.append(("waiting for data", fmt_fraction(waited)))
    if run.gpu_found:
        items += busy_items(s)
        items.append(("peak GPU memory", fmt_fraction(s.get("peak_gpu_mem_fraction"))))
    if (cost := cost_item(s)) is not None:
        items.append(cost)
    items.append(("CPU (all cores)", fmt_percent(s.get("cpu_util_mean"))))
    if s.get("process_cpu_mean") is not None:
        items.append(process_cpu_item(s))
    return items


def process_cpu_item(s: Summary) -> tuple[str, str]:
    """The CPU of the process that trained: the watch's own, or, where only child processes trained
    (``gpuwatch``, a launcher), theirs summed, with their loader workers'."""
    value = f"{s['process_cpu_mean']:.0f}% of a core"
    count = s.get("process_cpu_processes")
    if not count:
        return ("this process", value)
    if s.get("workers_cpu_mean"):
        value += f" (loader workers {s['workers_cpu_mean']:.0f}%)"
    return ("training process" if count == 1 else f"{count} training processes", value)


# How a finding whose cause lies in the machine (Finding.machine_level) is marked, wherever it shows.
MACHINE_LABEL = "the machine, not your code"
# The headline when every finding has nothing to gain (Finding.nothing_to_gain).
NOTHING_TO_GAIN_CAUSE = "nothing found that would make this loop faster (each finding below gains under 1%)"


def cause_line(finding: Finding) -> str:
    """A finding's cause and gain in one line, as the headline shows it and its card repeats it:
    "Building batches saturates the CPU (train_loader) → up to 1.68x faster"."""
    gain = gain_text(finding)
    line = finding.title + (f" \u2192 {gain}" if gain else "")
    return line + (f" ({MACHINE_LABEL})" if finding.machine_level else "")


def main_cause(run: Run) -> str:
    """The panel's one-line answer: the first finding's cause and gain (advice.advisor.rank puts the
    largest gain first), or why there is none. A cause with nothing to gain is no answer."""
    if not run.finished:
        return "running"
    if not run.options.advice:
        return "advice off (--no-advice)"
    if run.findings:
        top = run.findings[0]
        return NOTHING_TO_GAIN_CAUSE if top.nothing_to_gain else cause_line(top)
    if run.summary.get("steps") is None:
        return "no training loop seen (no DataLoader was iterated and no optimizer stepped)"
    return "no cause of idle time found"


BREAKDOWN: tuple[tuple[Literal["data_wait_s", "compute_s", "before_loop_s", "after_loop_s", "other_s"], str, str],
                 ...] = (
    ("data_wait_s", "waiting for data", WAIT_COLOR), ("compute_s", "computing", "#4c78a8"),
    ("before_loop_s", "before the first step", "#d8d2cc"), ("after_loop_s", "after the last step", "#e6e1dc"),
    ("other_s", "other", "#bab0ac"))
# Parts shown only where the summary has them (the first and last steps' times are known only while
# the trace holds every step).
OPTIONAL_PARTS = frozenset({"before_loop_s", "after_loop_s"})


# The parts of the loop itself: their shares are of the loop, as the summary's data_wait_fraction is.
LOOP_PARTS = frozenset({"data_wait_s", "compute_s"})


def breakdown(run: Run) -> list[tuple[str, float, float | None, str]]:
    """(label, seconds, share, colour) of the cell's time, or [] without loop figures.

    The share of waiting for data and of computing is of the loop (their sum), the figure the
    headline's "waiting for data" and the loader's findings speak of; the parts outside the loop
    (before the first step, after the last, between steps) have seconds and no share (None).
    """
    parts = cast(Mapping[str, float], run.summary.get("time_breakdown") or {})
    if not parts:
        return []
    shown = [(key, label, color) for key, label, color in BREAKDOWN if key in parts or key not in OPTIONAL_PARTS]
    if sum(parts.get(key) or 0.0 for key, _, _ in shown) <= 0:
        return []
    loop = sum(parts.get(key) or 0.0 for key in LOOP_PARTS)
    return [(label, parts.get(key) or 0.0,
             ((parts.get(key) or 0.0) / loop if loop > 0 else None) if key in LOOP_PARTS else None, color)
            for key, label, color in shown]


def wait_share(run: Run) -> float | None:
    """The loop's share of time waiting for data, the one figure the headline and the breakdown show:
    the breakdown's (every loader's waits over the loop's time) where it has one, else the summary's."""
    parts = cast(Mapping[str, float], run.summary.get("time_breakdown") or {})
    loop = sum(parts.get(key) or 0.0 for key in LOOP_PARTS)
    if loop > 0:
        return (parts.get("data_wait_s") or 0.0) / loop
    return run.summary.get("data_wait_fraction")


def breakdown_part(label: str, seconds: float, share: float | None) -> str:
    """One part of the breakdown as text: "waiting for data 2.0 s (41% of the loop)"; "computing 3.0 s
    (59%)"; "before the first step 122 ms"."""
    if share is None:
        return f"{label} {fmt_seconds(seconds)}"
    return f"{label} {fmt_seconds(seconds)} ({fmt_fraction(share)}{' of the loop' if label == BREAKDOWN[0][1] else ''})"


def breakdown_owner(run: Run) -> str | None:
    """Whose time the breakdown is when the watch's own process did not train: "rank 1", "pid 4242"."""
    trained_in = run.workload.get("trained_in")
    if not trained_in:
        return None
    return f"rank {trained_in['rank']}" if trained_in.get("rank") is not None else f"pid {trained_in.get('pid')}"


def warmup_sentence(steps: int, seconds: float, cause: str | None = None, all_warmup: bool = False) -> str:
    """The warm-up in words: "the first 6 steps took 2.1 s: compilation" (the cause only where
    the facts name it, else "warm-up"); for a run that never reached a steady state, says so."""
    what = cause or "warm-up"
    if all_warmup:
        return (f"all {steps} step{'s' if steps != 1 else ''} {'were' if steps != 1 else 'was'} warm-up "
                f"({fmt_seconds(seconds)}{': ' + cause if cause else ''}): the loop never reached a steady state")
    first = "the first step" if steps == 1 else f"the first {steps} steps"
    return f"{first} took {fmt_seconds(seconds)}: {what}"


def warmup_line(run: Run) -> str | None:
    """The panel's warm-up line, or None when the loop had none."""
    s = run.summary
    steps = s.get("warmup_steps") or 0
    if not steps:
        return None
    line = warmup_sentence(steps, s.get("warmup_s") or 0.0, s.get("warmup_cause"), bool(s.get("all_warmup")))
    return f"warm-up: {line}" + ("" if s.get("all_warmup") else " (left out of the step times and the advice)")


def status_line(run: Run) -> str:
    outcome = run.outcome
    label = f"{run.label} " if run.label else ""
    if outcome == "ok":
        return f"{label}finished"
    if outcome == "interrupted":
        return f"{label}interrupted"
    if outcome == "error":
        return f"{label}ended with {run.error}"
    return f"{label}running"


# The sampler thread's own share of a core above which the run says what watching cost and where
# (measured over at least WATCH_COST_MIN_TICKS ticks, so a short cell's one-off first ticks do not
# count): ~0.3 % on a 2-core VM, ~5 % on an H200 machine (BENCHMARKS.md, section 8a).
WATCH_COST_NOTE_SHARE = 0.02
WATCH_COST_MIN_TICKS = 20
# How the parts of a sampler tick (Run.sampler["part_cpu_s"]) are named in that note.
TICK_PART_NAMES = {"nvml": "the NVML reads", "amdsmi": "the amdsmi reads", "host": "the host's /proc reads",
                   "stack sample": "the stack sample", "trace row": "the Trace's row",
                   "listeners": "the probes and the live view"}


def watch_cost_notes(run: Run) -> list[str]:
    """"watching took 5.1% of a core here (12.0 ms a tick, most of it the NVML reads, 9.0 ms): ..."
    where the sampler's own CPU passed WATCH_COST_NOTE_SHARE of the watch; else nothing."""
    sampler = run.sampler or {}
    cpu, ticks = sampler.get("cpu_time_s") or 0.0, sampler.get("ticks") or 0
    duration = (run.summary or {}).get("duration_s") or 0.0
    if ticks < WATCH_COST_MIN_TICKS or duration <= 0 or cpu / duration < WATCH_COST_NOTE_SHARE:
        return []
    where = ""
    parts = sampler.get("part_cpu_s") or {}
    if parts:
        part, spent = max(parts.items(), key=lambda item: item[1])
        where = f", most of it {TICK_PART_NAMES.get(part, part)}, {1e3 * spent / ticks:.1f} ms"
    return [f"watching took {100 * cpu / duration:.1f}% of a core here ({1e3 * cpu / ticks:.1f} ms a tick{where}): "
            "a longer --interval costs less"]


def gpu_lines(run: Run) -> list[str]:
    """One line per watched GPU, or the reason there is none; then each source that stopped answering,
    and what watching cost where it cost more than it should."""
    # "GPU 1 stopped answering at 12.4 s; its readings end there" (the sampler dropped it).
    stalled = [str(entry.get("message")) for entry in run.sampler.get("stalled") or []]
    stalled += watch_cost_notes(run)
    if not run.gpu_found:
        message = run.machine.get("gpu_message") or NO_GPU
        return [f"{message}: host metrics only", *stalled]
    busy = run.summary.get("gpu_busy_by_gpu") or {}
    running = run.summary.get("gpu_kernel_running_by_gpu") or {}
    sm_active = run.summary.get("gpu_busy_metric") == "sm_active"
    mem = run.summary.get("peak_gpu_mem_fraction_by_gpu") or {}
    lines = []
    for device in run.machine["gpus"]:
        index = device["index"]
        text = f"GPU{index} {device.get('name', '')}".rstrip()
        details = []
        if sm_active and str(index) in busy and device.get("gpm", True):
            details.append(f"{SM_ACTIVE_LABEL} {fmt_percent(busy[str(index)])}")
        if str(index) in running or (not sm_active and str(index) in busy):
            details.append(f"{KERNEL_RUNNING_LABEL} {fmt_percent(running.get(str(index), busy.get(str(index))))}")
        if str(index) in mem:
            details.append(f"peak memory {fmt_fraction(mem[str(index)])}")
        lines.append(text + (": " + ", ".join(details) if details else ": no utilisation reported"))
    return lines + gpu_scope_notes(run.summary) + stalled


# ----------------------------------------------------------------- plain text


def finding_text(finding: Finding) -> str:
    lines = [f"[{finding.severity}] {finding.title} ({finding.rule})"
             + (f" [{MACHINE_LABEL}]" if finding.machine_level else "")]
    if finding.evidence:
        lines.append("  evidence: " + ", ".join(f"{k}={_short(v)}" for k, v in finding.evidence.items()))
    if finding.suggestion:
        lines.append("  " + finding.suggestion)
    if finding.code:
        lines += ["  change:"] + ["    " + line for line in finding.code.splitlines()]
    if (gain := gain_text(finding)) is not None:
        lines.append(f"  expected gain: {gain}")
    if (measured := measured_line(finding)) is not None:
        lines.append(f"  {measured}")
    return "\n".join(lines)


def measured_line(finding: Finding) -> str | None:
    """What measuring the finding's change gave (Finding.measure, --tune), beside its bound; None unmeasured."""
    measured = getattr(finding, "measured", None)
    return None if measured is None else str(measured.headline())


def comparison_line(run: Run) -> str | None:
    """Before -> after against the previous run of the same cell, measured; None without one."""
    compared = run.comparison()
    if compared is None:
        return None
    (rate_before, rate_after), (wait_before, wait_after) = compared["samples_per_s"], compared["data_wait_fraction"]
    line = (f"Since the previous run of this cell: {fmt_rate(rate_before)} -> {fmt_rate(rate_after)} samples/s "
            f"({compared['speedup']:.2f}x)")
    if wait_before is not None and wait_after is not None:
        line += f", data wait {fmt_fraction(wait_before)} -> {fmt_fraction(wait_after)}"
    return line


def gain_text(finding: Finding) -> str | None:
    """The finding's gain as every surface says it (:func:`fmt_gain`), with the bound if no waiting
    remained where its evidence has a larger one; None where the measurement gives none."""
    if finding.expected_speedup is None:
        return None
    upper = finding.evidence.get("upper_bound_speedup")
    remained = "no waiting or warm-up" if finding.evidence.get("warmup_steps") else "no waiting"
    return fmt_gain(finding.expected_speedup, upper if isinstance(upper, (int, float)) else None, remained)


RANK_COLUMNS = ("rank", "pid", "GPU", "steps", "samples/s", "data wait", "step p50", "step p95")


def rank_rows(run: Run) -> list[tuple[str, ...]]:
    """One row per training process (``Run.ranks``), shown only when more than one process trained."""
    ranks = run.ranks
    if len(ranks) < 2:
        return []
    return [("-" if r["rank"] is None else str(r["rank"]), str(r["pid"]), "-" if r["gpu"] is None else str(r["gpu"]),
             str(r["steps"] or 0), fmt_rate(r["samples_per_s"]), fmt_fraction(r["data_wait_fraction"]),
             fmt_seconds(r["step_time_p50_s"]), fmt_seconds(r["step_time_p95_s"])) for r in ranks]


def run_text(run: Run) -> str:
    lines = [f"gpuwidget run: {status_line(run)}"]
    if run.finished:
        lines.append(f"  main cause: {main_cause(run)}")
    lines.append("  " + " · ".join(f"{label} {value}" for label, value in headline(run)))
    compared = comparison_line(run)
    if compared:
        lines.append("  " + compared)
    parts = breakdown(run)
    if parts:
        owner = breakdown_owner(run)
        lines.append(f"  time{f' ({owner})' if owner else ''}: "
                     + " · ".join(breakdown_part(label, sec, share) for label, sec, share, _ in parts))
    if warmup := warmup_line(run):
        lines.append("  " + warmup)
    lines += ["  " + line for line in gpu_lines(run)]
    if rows := rank_rows(run):
        lines.append("  per process: " + " | ".join(RANK_COLUMNS))
        lines += ["    " + " | ".join(row) for row in rows]
    if run.options.advice and run.finished:
        if run.findings:
            lines.append("Findings (largest expected gain first):")
            lines += [finding_text(f) for f in run.findings]
        else:
            lines.append("No findings: nothing in this run points at a cause of idle time.")
    return "\n".join(lines)


# ----------------------------------------------------------------- HTML
#
# The HTML is read in three settings, and each must be readable:
# - trusted in JupyterLab/Notebook 7 (the cell just ran): the <style> block applies (theme colours
#   from JupyterLab's CSS variables, focus rings, the copy button) and the copy button works;
# - sanitized (an untrusted notebook, GitHub, a colleague's copy): no <style>, no <svg>, no
#   scripts, no aria/role attributes, and inline styles only with literal values. So the chart
#   is an <img> (an SVG data URI, which the sanitizer keeps), every label is its own element with
#   spacing, colours are never the only carrier of meaning, and the copy button stays hidden
#   rather than showing a button that does nothing: it is shown by the <style> block only while
#   it keeps its data-copy attribute, which sanitizers strip (so another, trusted output's
#   stylesheet on the same page cannot show it either);
# - other front-ends (VS Code, nbconvert) without JupyterLab's variables: every var() has a
#   fallback that works on light and dark backgrounds (inherited text colour, translucent greys).

SEVERITY_LABEL = {"critical": "critical", "warn": "warning", "info": "info"}
SEVERITY_ICON = {"critical": "\u2716", "warn": "\u25b2", "info": "\u2139"}  # heavy x, triangle, info sign


def _themed(prop: str, variable: str, fallback: str, template: str = "{}") -> str:
    """``prop`` following a JupyterLab variable, after a literal copy of it: a sanitizer drops
    declarations with var() and keeps the literal one, and front-ends without the variable
    use the fallback. ``template`` places the colour in a longer value ("1px solid {}")."""
    return f"{prop}:{template.format(fallback)};{prop}:{template.format(f'var({variable},{fallback})')}"


_MUTED = _themed("color", "--jp-ui-font-color2", "#808080")
_BORDER = _themed("border", "--jp-border-color2", "rgba(128,128,128,.35)", "1px solid {}")
_RULE_BELOW = _themed("border-bottom", "--jp-border-color2", "rgba(128,128,128,.35)", "1px solid {}")
_CODE_BACKGROUND = _themed("background", "--jp-layout-color2", "rgba(128,128,128,.14)")

# Only in trusted output (a sanitizer drops <style> with its content). Scoped to the run's panel
# and to a finding shown on its own (both carry data-gpuwidget).
_SCOPE = "[data-gpuwidget]"  # not a class name: "gpuwidget-run" in HTML means a run's panel
_PANEL_CSS = "<style>\n" + "\n".join(f"{_SCOPE} {rule}" for rule in (
    ".gpuwidget-copy[data-copy]{display:inline-block!important;font:inherit;font-size:12px;line-height:18px;"
    "padding:1px 10px;border-radius:3px;cursor:pointer;color:var(--jp-ui-font-color1,inherit);"
    "background:var(--jp-layout-color1,transparent);border:1px solid var(--jp-border-color1,rgba(128,128,128,.6))}",
    ".gpuwidget-copy:hover{background:var(--jp-layout-color2,rgba(128,128,128,.15))}",
    ".gpuwidget-copy:active{background:var(--jp-layout-color3,rgba(128,128,128,.3))}",
    ":focus-visible{outline:2px solid var(--jp-brand-color1,#1a73e8);outline-offset:2px}",
    "pre.gpuwidget-code{font-family:var(--jp-code-font-family,ui-monospace,SFMono-Regular,Menlo,Consolas,monospace);"
    "font-size:var(--jp-code-font-size,12px);line-height:var(--jp-code-line-height,1.4)}",
)) + "\n</style>"

# Copies the change's code, then says so in the live region beside the button. The async
# Clipboard API needs a secure context (https or localhost); elsewhere the code is selected and
# copied with execCommand, and if even that is refused the user is told to press Ctrl+C.
_COPY_JS = (
    "(function(button){var box=button.closest('.gpuwidget-change');"
    "var code=box.querySelector('code');var status=box.querySelector('.gpuwidget-copied');"
    "function tell(message){status.textContent=message;clearTimeout(button.gpuwidgetTimer);"
    "button.gpuwidgetTimer=setTimeout(function(){status.textContent='';},4000);}"
    "function select(){var range=document.createRange();range.selectNodeContents(code);"
    "var selection=window.getSelection();selection.removeAllRanges();selection.addRange(range);"
    "var copied=false;try{copied=document.execCommand('copy');}catch(error){}"
    "tell(copied?'Copied':'Selected: press Ctrl+C to copy');}"
    "if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(code.textContent)"
    ".then(function(){tell('Copied');},select);}else{select();}})(this)"
)

_STYLE = (
    "font-family:var(--jp-ui-font-family,-apple-system,Segoe UI,sans-serif);font-size:13px;"
    f"{_BORDER};border-radius:6px;padding:10px 12px;max-width:900px;"
    "box-sizing:border-box"
)


def scoped_css(kind: str) -> tuple[str, str]:
    """The panel's stylesheet and the attribute that scopes it, for an output of its own (Measure's
    result, a finding shown alone): ``(style, "data-gpuwidget='kind'")``."""
    return _PANEL_CSS, f"data-gpuwidget='{html.escape(kind)}'"


def severity_badge(severity: str) -> str:
    """The severity as an icon and a word (colour alone would not tell it apart)."""
    color = SEVERITY_COLOR.get(severity, "#808080")
    label = SEVERITY_LABEL.get(severity, severity)
    return (f"<span class='gpuwidget-severity' style='color:{color};font-size:12px;font-weight:600;"
            f"white-space:nowrap;margin-right:6px'><span aria-hidden='true'>{SEVERITY_ICON.get(severity, '')}"
            f"</span> {html.escape(label)}</span>")


def code_html(code: str, label: str = "Change") -> str:
    """A code block with a copy button above it (never over the code) and a live 'Copied' note: the
    panel's findings and Measure's result share it (the button shows under :func:`scoped_css`)."""
    return (
        "<div class='gpuwidget-change' style='margin:6px 0 2px 0'>"
        "<div style='display:flex;align-items:center;flex-wrap:wrap;margin-bottom:3px'>"
        f"<span style='font-size:12px;{_MUTED};margin-right:10px'>{html.escape(label)}</span>"
        "<button type='button' class='gpuwidget-copy' data-copy='code' style='display:none' "
        f"aria-label='Copy the code of this change' onclick=\"{html.escape(_COPY_JS)}\">Copy</button>"
        "<span class='gpuwidget-copied' role='status' aria-live='polite' "
        "style='font-size:12px;margin-left:8px'></span></div>"
        # Lines as written: a long one scrolls rather than wrapping inside a name or a string.
        f"<pre class='gpuwidget-code' style='{_CODE_BACKGROUND};padding:6px 8px;margin:0;"
        "border-radius:4px;white-space:pre;overflow-x:auto'>"
        # The code element too: JupyterLab's own stylesheet breaks a code element's text anywhere.
        f"<code style='background:transparent;color:inherit;padding:0;white-space:pre;word-break:normal;"
        f"overflow-wrap:normal'>{html.escape(code)}</code></pre></div>")


def finding_html(finding: Finding, standalone: bool = True) -> str:
    """One finding; ``standalone`` adds the panel's stylesheet (a finding shown on its own)."""
    color = SEVERITY_COLOR.get(finding.severity, "#808080")
    parts = [
        _PANEL_CSS + f"<div class='gpuwidget-card' data-gpuwidget='finding' style='{_STYLE}'>" if standalone else "",
        f"<div class='gpuwidget-finding' data-rule='{html.escape(finding.rule)}' "
        f"data-severity='{html.escape(finding.severity)}' role='group' aria-label='{html.escape(finding.title)}' "
        f"style='border-left:4px solid {color};padding:4px 10px;margin:8px 0'>",
        f"<div>{severity_badge(finding.severity)}<b>{html.escape(finding.title)}</b> "
        f"<span class='gpuwidget-rule' style='font-family:monospace;font-size:11px;white-space:nowrap;{_MUTED}'>"
        f"{html.escape(finding.rule)}</span>",
    ]
    if (gain := gain_text(finding)) is not None:
        parts.append(f" <span class='gpuwidget-gain' style='white-space:nowrap'>\u2192 {html.escape(gain)}</span>")
    if finding.machine_level:
        parts.append(f" <span class='gpuwidget-machine' style='font-size:11px;white-space:nowrap;{_BORDER};"
                     f"border-radius:3px;padding:0 4px;margin-left:4px'>{html.escape(MACHINE_LABEL)}</span>")
    parts.append("</div>")
    if (measured := measured_line(finding)) is not None:
        verdict = html.escape(str(getattr(finding.measured, "verdict", "")))
        parts.append(f"<div class='gpuwidget-measured' data-verdict='{verdict}' style='margin:4px 0;font-weight:600'>"
                     f"{html.escape(measured)}</div>")
    if finding.suggestion:
        parts.append(f"<div style='margin:4px 0'>{html.escape(finding.suggestion)}</div>")
    if finding.evidence:
        parts.append(f"<div style='font-size:12px;{_MUTED}'>evidence: " + ", ".join(
            f"{html.escape(str(k))} = {html.escape(_short(v))}" for k, v in finding.evidence.items()) + "</div>")
    if finding.code:
        parts.append(code_html(finding.code))
    parts.append("</div>")
    if standalone:
        parts.append("</div>")
    return "".join(parts)


def run_html(run: Run) -> str:
    cards = "".join(
        "<div style='display:inline-block;margin:0 18px 6px 0;vertical-align:top'>"
        f"<div style='font-size:11px;{_MUTED}'>{html.escape(label)}</div>"
        f"<div style='font-size:17px;font-weight:600'>{html.escape(value)}</div></div>"
        for label, value in headline(run)
    )
    gpu_html = "".join(f"<div>{html.escape(line)}</div>" for line in gpu_lines(run))
    status = status_line(run)
    body = [
        _PANEL_CSS,
        f"<section class='gpuwidget-run' data-gpuwidget='run' data-outcome='{run.outcome}' role='region' "
        f"aria-label='gpuwidget report: {html.escape(status)}' style='{_STYLE}'>",
        f"<div class='gpuwidget-status' style='margin-bottom:6px'><b>gpuwidget</b> \u00b7 {html.escape(status)}</div>",
        (f"<div class='gpuwidget-cause' style='font-size:14px;margin-bottom:8px'>"
         f"{html.escape(main_cause(run))}</div>" if run.finished else ""),
        f"<div class='gpuwidget-figures'>{cards}</div>",
        (f"<div class='gpuwidget-comparison' style='margin-bottom:6px'>{html.escape(compared)}</div>"
         if (compared := comparison_line(run)) else ""),
        breakdown_html(run),
        (f"<div class='gpuwidget-warmup' style='font-size:12px;margin-bottom:6px'>{html.escape(warmup)}</div>"
         if (warmup := warmup_line(run)) else ""),
        ranks_html(run),
        f"<div style='font-size:12px;margin-bottom:6px'>{gpu_html}</div>",
        chart_html(run),
    ]
    if run.options.advice and run.finished:
        if run.findings:
            body.append("<div role='heading' aria-level='3' style='margin-top:8px;font-weight:600'>"
                        "Findings, largest expected gain first</div>")
            body += [finding_html(f, standalone=False) for f in run.findings]
        else:
            body.append("<div style='margin-top:8px'>No findings: nothing in this run points at a cause "
                        "of idle time.</div>")
    body.append("</section>")
    return "".join(body)


def ranks_html(run: Run) -> str:
    """The per-process table (only with more than one training process)."""
    rows = rank_rows(run)
    if not rows:
        return ""
    cell = f"style='padding:1px 10px 1px 0;text-align:right;{_RULE_BELOW}'"
    head = "".join(f"<th scope='col' {cell}>{html.escape(c)}</th>" for c in RANK_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td {cell}>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
    return (f"<table class='gpuwidget-ranks' style='font-size:12px;border-collapse:collapse;margin:2px 0 8px 0'>"
            f"<caption style='text-align:left;{_MUTED}'>Training processes</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def breakdown_html(run: Run) -> str:
    """A bar of the cell's time: waiting for data / computing / other, with a text legend."""
    parts = breakdown(run)
    if not parts:
        return ""
    # The bar is the whole cell, each part as wide as its seconds; the legend's shares are the loop's.
    total = sum(sec for _, sec, _, _ in parts)
    bar = "".join(
        f"<div title='{html.escape(label)}: {fmt_seconds(sec)}' style='width:{100 * sec / total:.2f}%;"
        f"background:{color}'></div>" for label, sec, _, color in parts if sec > 0)
    # Spaces between the parts: the legend wraps between them (each part itself stays on one line).
    legend = " ".join(
        f"<span style='margin-right:10px;white-space:nowrap'><span style='color:{color}' aria-hidden='true'>"
        f"&#9632;</span> {html.escape(breakdown_part(label, sec, share))}</span>"
        for label, sec, share, color in parts)
    return ("<div class='gpuwidget-breakdown' style='margin:2px 0 8px 0'>"
            "<div aria-hidden='true' style='display:flex;height:10px;max-width:640px;border-radius:3px;"
            f"overflow:hidden'>{bar}</div><div style='font-size:11px;margin-top:3px'>{legend}</div></div>")


def html_document(run: Run) -> str:
    """A standalone HTML page of the run (for ``Run.save('report.html')``)."""
    title = html.escape(f"gpuwidget run {run.label}".strip())
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='margin:24px'><main>{run_html(run)}</main></body></html>\n")


def _chart_series(run: Run) -> tuple[np.ndarray, list[tuple[str, str, str, np.ndarray]]] | None:
    """The chart's times and its (name, colour, dash, values) series, or None under two points."""
    gpus = gpu_indices(run.trace)
    columns = run.trace.columns
    sm = sm_active_gpus(columns, gpus)
    frame = run.trace.plot_view(plot_columns(gpus, process=False, sm_active=sm), CHART_POINTS)
    if len(frame) < 2:
        return None
    data = percent_data(frame, gpus, process=False, sm_active=sm)
    running = [index for index in gpus if f"gpu{index}.util" in columns]
    series: list[tuple[str, str, str, np.ndarray]] = [
        (line.label, line.color, SVG_DASH[line.kind], data[line.key]) for line in gpu_series(gpus, sm, running)]
    series.append(("CPU (all cores)", CPU_COLOR, "", data["cpu_util"]))
    return frame.t, series


def chart_svg(run: Run, width: int = CHART_WIDTH, height: int = CHART_HEIGHT) -> str:
    """GPU activity (SM active, kernel running), GPU memory and CPU over the run on a 0-100 % axis, with
    data-wait bands.

    A standalone SVG document (it is shown as an image): colours that read on light and dark
    backgrounds, the axis labels apart from each other, the legend left to the HTML around it.
    """
    found = _chart_series(run)
    if found is None:
        return ""
    t, series = found
    t0, t1 = float(t[0]), float(t[-1])
    span = (t1 - t0) or 1.0
    left, top, plot_w, plot_h = 38, 6, width - 38 - 14, height - 6 - 20

    def x(v: float) -> float:
        return left + (v - t0) / span * plot_w

    def y(v: float) -> float:
        return top + (1 - min(max(v, 0.0), 100.0) / 100) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    for start, end in merge_bands(run.trace.spans(DATA_WAIT_SPAN), gap=span / plot_w):
        parts.append(f'<rect x="{x(start):.1f}" y="{top}" width="{max(x(end) - x(start), 0.5):.1f}" '
                     f'height="{plot_h}" fill="{WAIT_COLOR}" fill-opacity="0.3"/>')
    for level in (0, 50, 100):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(level):.1f}" y2="{y(level):.1f}" '
                     'stroke="#888" stroke-opacity="0.35"/>')
        parts.append(f'<text x="{left - 5}" y="{y(level) + 3.5:.1f}" text-anchor="end" fill="#888">{level}%</text>')
    for tick in _time_ticks(t0, t1):
        anchor = "start" if tick == t0 else "end" if tick == t1 else "middle"
        parts.append(f'<text x="{x(tick):.1f}" y="{height - 5}" text-anchor="{anchor}" fill="#888">'
                     f'{_tick_label(tick, t1)}</text>')
    for _, color, dash, values in series:
        path = _polyline(t, values, x, y)
        if path:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.4"{dash_attr}/>')
    parts.append("</svg>")
    return "".join(parts)


def chart_html(run: Run) -> str:
    """The chart as an <img> (kept by notebook sanitizers, unlike inline SVG) with a text legend."""
    svg = chart_svg(run)
    if not svg:
        return ""
    found = _chart_series(run)
    assert found is not None
    t, series = found
    described = "; ".join(f"{name} mean {fmt_percent(_mean(values))}" for name, _, _, values in series)
    alt = f"Utilisation over the run (0 to {fmt_seconds(float(t[-1] - t[0]))}): {described}"
    legend = " ".join(
        f"<span style='margin-right:10px;white-space:nowrap'><span style='color:{color}' aria-hidden='true'>"
        f"{'&#9476;' if dash else '&#9473;'}</span> {html.escape(name)}</span>" for name, color, dash, _ in series)
    if any(True for _ in run.trace.spans(DATA_WAIT_SPAN)):
        legend += (f"<span style='white-space:nowrap'><span style='color:{WAIT_COLOR}' aria-hidden='true'>&#9632;"
                   "</span> waiting for data</span>")
    source = "data:image/svg+xml," + quote(svg, safe=" =/:;,.-\"")
    return (f"<div class='gpuwidget-chart' style='margin:4px 0'><img src='{source}' alt='{html.escape(alt)}' "
            f"width='{CHART_WIDTH}' height='{CHART_HEIGHT}' style='max-width:100%;height:auto;display:block'>"
            f"<div class='gpuwidget-legend' style='font-size:11px;margin-top:2px'>{legend}</div></div>")


def _mean(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else None


def _time_ticks(t0: float, t1: float) -> list[float]:
    """Start, end and a middle tick: three labels that never run into each other."""
    return [t0, (t0 + t1) / 2, t1] if t1 > t0 else [t0]


def _tick_label(value: float, end: float) -> str:
    return f"{value:.0f} s" if end >= 20 else f"{value:.1f} s"


# ----------------------------------------------------------------- result tables


def _numeric(cells: Sequence[str]) -> bool:
    """A column of figures (``41.2``, ``1.52x``, ``12%``, ``310 MB``, ``0.21 s``): aligned right, as
    figures are read down a column; words and settings stay left."""
    shown = [cell for cell in cells if cell and cell not in ("-", "n/a", "failed")]
    return bool(shown) and all(cell[:1].isdigit() for cell in shown)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell: figures right-aligned, words left."""
    columns = range(len(headers))
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in columns]
    right = [_numeric([str(row[i]) for row in rows]) for i in columns]
    return ["  ".join(str(cell).rjust(width) if align else str(cell).ljust(width)
                      for cell, width, align in zip(row, widths, right)).rstrip()
            for row in [headers, *rows]]


def html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], bold: Sequence[bool] = (),
               caption: str = "") -> str:
    """An HTML table; rows whose ``bold`` flag is set are emphasised. Figures are right-aligned (with
    their header), words left; no cell wraps (a setting is one unit)."""
    right = [_numeric([str(row[i]) for row in rows]) for i in range(len(headers))]
    cell = "padding:2px 10px;white-space:nowrap;text-align:{}"
    head = "".join(f"<th scope='col' style='{cell.format('right' if r else 'left')};{_RULE_BELOW}'>"
                   f"{html.escape(h)}</th>" for h, r in zip(headers, right))
    body = "".join(
        "<tr" + (" style='font-weight:600'" if i < len(bold) and bold[i] else "") + ">"
        + "".join(f"<td style='{cell.format('right' if r else 'left')}'>{html.escape(str(value))}</td>"
                  for value, r in zip(row, right)) + "</tr>"
        for i, row in enumerate(rows))
    title = f"<caption style='text-align:left;{_MUTED}'>{html.escape(caption)}</caption>" if caption else ""
    return (f"<table style='border-collapse:collapse;font-size:12px;margin:4px 0'>{title}"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _polyline(t: np.ndarray, values: np.ndarray, x: Any, y: Any) -> str:
    points = [f"{x(float(a)):.1f},{y(float(b)):.1f}" for a, b in zip(t, values) if not math.isnan(b)]
    return " ".join(points) if len(points) > 1 else ""


def _short(value: Any) -> str:
    if value is None or (isinstance(value, float) and _unknown(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)
