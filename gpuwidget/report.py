"""How a run reads: a Run and its Findings as HTML (with an inline SVG chart) and as plain text.

Every rendering lives here (the model objects render themselves through it, as Rich objects
do with ``__rich_console__``): the run's text and HTML, its chart, the standalone HTML
document ``Run.save('x.html')`` writes, and the small result tables of the tuner and the
batch probe. It imports nothing from ``gpuwidget.ui``: ``run.py`` and ``advice/finding.py``
import it at module top. Same content both ways: a headline (throughput, GPU busy, the main cause in one line),
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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from gpuwidget.advice.summary import gpu_scope_notes
from gpuwidget.chart import CPU_COLOR, PALETTE, WAIT_COLOR, merge_bands, percent_data, plot_columns
from gpuwidget.probes import DATA_WAIT_SPAN
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
    return "n/a" if _unknown(value) else f"{value:.0f}%"


def fmt_fraction(value: float | None) -> str:
    return "n/a" if value is None or _unknown(value) else f"{100 * value:.0f}%"


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


def fmt_energy(joules: float | None) -> str:
    """Joules in the unit that keeps three figures: 850 mJ, 12.3 J, 4.1 kJ, 2.75 MJ."""
    if joules is None or _unknown(joules):
        return "n/a"
    for scale, unit in ((1e6, "MJ"), (1e3, "kJ"), (1.0, "J")):
        if abs(joules) >= scale:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules * 1e3:.3g} mJ"


def headline(run: Run) -> list[tuple[str, str]]:
    """The figures shown first, as (label, value) pairs, in order."""
    s = run.summary
    items: list[tuple[str, str]] = [("duration", fmt_seconds(s.get("duration_s")))]
    if s.get("samples_per_s") is not None:
        items.append(("samples/s", fmt_rate(s["samples_per_s"])))
    if s.get("energy_j") is not None:  # NVML's energy counter: per sample (or step) where counted
        per_sample, per_step = s.get("energy_per_sample_j"), s.get("energy_per_step_j")
        per = f"{fmt_energy(per_sample)}/sample, " if per_sample is not None else \
            f"{fmt_energy(per_step)}/step, " if per_step is not None else ""
        items.append(("GPU energy", f"{per}{fmt_energy(s['energy_j'])} total"))
    if s.get("steps") is not None:
        items.append(("steps", f"{s['steps']:,}"))
    if s.get("data_wait_fraction") is not None:
        items.append(("waiting for data", fmt_fraction(s["data_wait_fraction"])))
    if run.gpu_found:
        items.append(("GPU busy", fmt_percent(s.get("gpu_busy_mean"))))
        items.append(("peak GPU memory", fmt_fraction(s.get("peak_gpu_mem_fraction"))))
    items.append(("CPU (all cores)", fmt_percent(s.get("cpu_util_mean"))))
    if s.get("process_cpu_mean") is not None:
        items.append(("this process", f"{s['process_cpu_mean']:.0f}% of a core"))
    return items


def main_cause(run: Run) -> str:
    """The panel's one-line answer: the top finding, or why there is none."""
    if not run.finished:
        return "running"
    if not run.options.advice:
        return "advice off (--no-advice)"
    if run.findings:
        top = run.findings[0]
        gain = f" (up to {top.expected_speedup:.2f}x faster)" if top.expected_speedup else ""
        return f"{top.title}{gain}"
    if run.summary.get("steps") is None:
        return "no training loop seen (no DataLoader was iterated)"
    return "no cause of idle time found"


BREAKDOWN: tuple[tuple[Literal["data_wait_s", "compute_s", "other_s"], str, str], ...] = (
    ("data_wait_s", "waiting for data", WAIT_COLOR), ("compute_s", "computing", "#4c78a8"),
    ("other_s", "other", "#bab0ac"))


def breakdown(run: Run) -> list[tuple[str, float, float, str]]:
    """(label, seconds, share, colour) of the cell's time, or [] without loop figures."""
    parts = run.summary.get("time_breakdown")
    if not parts:
        return []
    total = sum(parts.get(key) or 0.0 for key, _, _ in BREAKDOWN)
    if total <= 0:
        return []
    return [(label, parts.get(key) or 0.0, (parts.get(key) or 0.0) / total, color) for key, label, color in BREAKDOWN]


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


def gpu_lines(run: Run) -> list[str]:
    """One line per watched GPU, or the reason there is none; then each source that stopped answering."""
    # "GPU 1 stopped answering at 12.4 s; its readings end there" (the sampler dropped it).
    stalled = [str(entry.get("message")) for entry in run.sampler.get("stalled") or []]
    if not run.gpu_found:
        message = run.machine.get("gpu_message") or "no NVIDIA GPU found"
        return [f"{message}: host metrics only", *stalled]
    busy = run.summary.get("gpu_busy_by_gpu") or {}
    mem = run.summary.get("peak_gpu_mem_fraction_by_gpu") or {}
    lines = []
    for device in run.machine["gpus"]:
        index = device["index"]
        text = f"GPU{index} {device.get('name', '')}".rstrip()
        details = []
        if str(index) in busy:
            details.append(f"busy {fmt_percent(busy[str(index)])}")
        if str(index) in mem:
            details.append(f"peak memory {fmt_fraction(mem[str(index)])}")
        lines.append(text + (": " + ", ".join(details) if details else ": no utilisation reported"))
    return lines + gpu_scope_notes(run.summary) + stalled


# ----------------------------------------------------------------- plain text


def finding_text(finding: Finding) -> str:
    lines = [f"[{finding.severity}] {finding.title} ({finding.rule})"]
    if finding.evidence:
        lines.append("  evidence: " + ", ".join(f"{k}={_short(v)}" for k, v in finding.evidence.items()))
    if finding.suggestion:
        lines.append("  " + finding.suggestion)
    if finding.code:
        lines += ["  change:"] + ["    " + line for line in finding.code.splitlines()]
    if finding.expected_speedup is not None:
        lines.append(f"  expected gain: {_gain(finding)}")
    return "\n".join(lines)


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


def _gain(finding: Finding) -> str:
    """The gain of the finding's change, with the bound if no waiting remained where it differs."""
    upper = finding.evidence.get("upper_bound_speedup")
    if isinstance(upper, (int, float)) and upper > (finding.expected_speedup or 0) + 0.005:
        return f"about {finding.expected_speedup:.2f}x (at most {upper:.2f}x if no waiting remained)"
    return f"up to {finding.expected_speedup:.2f}x"


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
        lines.append("  time: " + " · ".join(f"{label} {fmt_seconds(sec)} ({100 * share:.0f}%)"
                                             for label, sec, share, _ in parts))
    lines += ["  " + line for line in gpu_lines(run)]
    if run.options.advice and run.finished:
        if run.findings:
            lines.append("Findings (largest expected gain first):")
            lines += [finding_text(f) for f in run.findings]
        else:
            lines.append("No findings: nothing in this run points at a cause of idle time.")
    return "\n".join(lines)


# ----------------------------------------------------------------- HTML

_STYLE = (
    "font-family:var(--jp-ui-font-family,-apple-system,Segoe UI,sans-serif);font-size:13px;"
    "color:var(--jp-ui-font-color1,#222);border:1px solid var(--jp-border-color2,#ddd);"
    "border-radius:6px;padding:10px 12px;max-width:900px"
)


def finding_html(finding: Finding) -> str:
    color = SEVERITY_COLOR.get(finding.severity, "#555")
    parts = [
        f"<div class='gpuwidget-finding' data-rule='{html.escape(finding.rule)}' "
        f"style='border-left:4px solid {color};padding:4px 10px;margin:8px 0'>",
        f"<div><b>{html.escape(finding.title)}</b> <code style='font-size:11px;opacity:.7'>"
        f"{html.escape(finding.rule)}</code>",
    ]
    if finding.expected_speedup is not None:
        parts.append(f" <span style='color:{color}'>{html.escape(_gain(finding))}</span>")
    parts.append("</div>")
    if finding.suggestion:
        parts.append(f"<div style='margin:4px 0'>{html.escape(finding.suggestion)}</div>")
    if finding.evidence:
        parts.append("<div style='font-size:12px;opacity:.8'>evidence: " + ", ".join(
            f"{html.escape(str(k))} = {html.escape(_short(v))}" for k, v in finding.evidence.items()) + "</div>")
    if finding.code:
        parts.append(
            "<div style='position:relative'><button title='copy' style='position:absolute;right:4px;top:4px;"
            "font-size:11px' onclick='navigator.clipboard.writeText(this.nextElementSibling.innerText)'>copy"
            "</button><pre style='background:var(--jp-layout-color2,#f5f5f5);padding:6px;margin:4px 0;"
            f"white-space:pre-wrap'><code>{html.escape(finding.code)}</code></pre></div>")
    parts.append("</div>")
    return "".join(parts)


def run_html(run: Run) -> str:
    cards = "".join(
        "<div style='display:inline-block;margin:0 18px 6px 0;vertical-align:top'>"
        f"<div style='font-size:11px;opacity:.7'>{html.escape(label)}</div>"
        f"<div style='font-size:17px;font-weight:600'>{html.escape(value)}</div></div>"
        for label, value in headline(run)
    )
    gpu_html = "".join(f"<div>{html.escape(line)}</div>" for line in gpu_lines(run))
    body = [
        f"<div class='gpuwidget-run' data-outcome='{run.outcome}' style='{_STYLE}'>",
        f"<div style='margin-bottom:6px'><b>gpuwidget</b> · {html.escape(status_line(run))}</div>",
        (f"<div class='gpuwidget-cause' style='font-size:14px;margin-bottom:8px'>"
         f"{html.escape(main_cause(run))}</div>" if run.finished else ""),
        f"<div>{cards}</div>",
        (f"<div class='gpuwidget-comparison' style='margin-bottom:6px'>{html.escape(compared)}</div>"
         if (compared := comparison_line(run)) else ""),
        breakdown_html(run),
        f"<div style='font-size:12px;margin-bottom:6px'>{gpu_html}</div>",
        chart_svg(run),
    ]
    if run.options.advice and run.finished:
        if run.findings:
            body.append("<div style='margin-top:8px;font-weight:600'>Findings, largest expected gain first</div>")
            body += [finding_html(f) for f in run.findings]
        else:
            body.append("<div style='margin-top:8px'>No findings: nothing in this run points at a cause "
                        "of idle time.</div>")
    body.append("</div>")
    return "".join(body)


def breakdown_html(run: Run) -> str:
    """A bar of the cell's time: waiting for data / computing / other."""
    parts = breakdown(run)
    if not parts:
        return ""
    bar = "".join(
        f"<div title='{html.escape(label)}: {fmt_seconds(sec)}' style='width:{100 * share:.2f}%;background:{color}'>"
        "</div>" for label, sec, share, color in parts if share > 0)
    legend = " &nbsp; ".join(
        f"<span style='color:{color}'>&#9632;</span> {html.escape(label)} {fmt_seconds(sec)} ({100 * share:.0f}%)"
        for label, sec, share, color in parts)
    return ("<div class='gpuwidget-breakdown' style='margin:2px 0 8px 0'>"
            f"<div style='display:flex;height:10px;max-width:640px;border-radius:3px;overflow:hidden'>{bar}</div>"
            f"<div style='font-size:11px;margin-top:3px'>{legend}</div></div>")


def html_document(run: Run) -> str:
    """A standalone HTML page of the run (for ``Run.save('report.html')``)."""
    title = html.escape(f"gpuwidget run {run.label}".strip())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='margin:24px'>{run_html(run)}</body></html>\n")


def chart_svg(run: Run, width: int = CHART_WIDTH, height: int = CHART_HEIGHT) -> str:
    """GPU util, GPU memory and CPU over the run on a 0-100 % axis, with data-wait bands."""
    trace = run.trace
    series: list[tuple[str, str, str, np.ndarray]] = []
    gpus = gpu_indices(trace)
    frame = trace.plot_view(plot_columns(gpus, process=False), CHART_POINTS)
    if len(frame) < 2:
        return ""
    t = frame.t
    data = percent_data(frame, gpus, process=False)
    for n, index in enumerate(gpus):
        color = PALETTE[n % len(PALETTE)]
        series.append((f"GPU{index} util", color, "", data[f"gpu{index}_util"]))
        series.append((f"GPU{index} memory", color, "4 3", data[f"gpu{index}_mem"]))
    series.append(("CPU", CPU_COLOR, "", data["cpu_util"]))
    t0, t1 = float(t[0]), float(t[-1])
    span = (t1 - t0) or 1.0
    left, top, plot_w, plot_h = 34, 6, width - 34 - 8, height - 6 - 18

    def x(v: float) -> float:
        return left + (v - t0) / span * plot_w

    def y(v: float) -> float:
        return top + (1 - min(max(v, 0.0), 100.0) / 100) * plot_h

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' style='display:block;font-size:10px' role='img' "
             "aria-label='utilisation over the run'>"]
    for start, end in merge_bands(trace.spans(DATA_WAIT_SPAN), gap=span / plot_w):
        parts.append(f"<rect x='{x(start):.1f}' y='{top}' width='{max(x(end) - x(start), 0.5):.1f}' "
                     f"height='{plot_h}' fill='{WAIT_COLOR}' fill-opacity='0.3'/>")
    for level in (0, 50, 100):
        parts.append(f"<line x1='{left}' x2='{left + plot_w}' y1='{y(level):.1f}' y2='{y(level):.1f}' "
                     "stroke='#999' stroke-opacity='0.3'/>")
        parts.append(f"<text x='{left - 4}' y='{y(level) + 3:.1f}' text-anchor='end' fill='#888'>{level}%</text>")
    parts.append(f"<text x='{left}' y='{height - 3}' fill='#888'>{t0:.0f} s</text>")
    parts.append(f"<text x='{left + plot_w}' y='{height - 3}' text-anchor='end' fill='#888'>{t1:.1f} s</text>")
    legend_x = left + 60.0
    for name, color, dash, values in series:
        path = _polyline(t, values, x, y)
        if path:
            dash_attr = f" stroke-dasharray='{dash}'" if dash else ""
            parts.append(f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='1.4'{dash_attr}/>")
            parts.append(f"<text x='{legend_x:.0f}' y='{height - 3}' fill='{color}'>{html.escape(name)}</text>")
            legend_x += 7 * len(name) + 14
    parts.append("</svg>")
    return "".join(parts)


# ----------------------------------------------------------------- result tables


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns as wide as their widest cell."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [headers, *rows]]


def html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], bold: Sequence[bool] = ()) -> str:
    """An HTML table; rows whose ``bold`` flag is set are emphasised."""
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr" + (" style='font-weight:600'" if i < len(bold) and bold[i] else "") + ">"
        + "".join(f"<td style='padding:2px 10px'>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for i, row in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


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
