"""Exports of a run's Trace to plain formats (CSV) for spreadsheets and pandas."""

from __future__ import annotations

import csv
import io
import math

from gpuwidget.trace import Trace


def trace_csv(trace: Trace) -> str:
    """Every kept row as CSV: ``t`` (seconds since start) then one column per metric.

    Archive rows (older, downsampled) hold their bucket's mean; empty cells are
    readings a source did not have at that time.
    """
    frame = trace.window()
    names = sorted(frame.mean)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["t", *names])
    columns = [frame.mean[name] for name in names]
    for i, t in enumerate(frame.t.tolist()):
        writer.writerow([f"{t:.6f}", *("" if math.isnan(c[i]) else repr(float(c[i])) for c in columns)])
    return out.getvalue()
