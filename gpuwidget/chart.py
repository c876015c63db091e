"""What every chart of a run draws, and in which colours: the live plot (ui/live.py) and the
report's static chart (report.py) both read their series and colours here.

It sits beside report.py, not in ui/, because the report is imported by the model (``Run``
renders itself) and the model never imports ``gpuwidget.ui``.

Both put everything on one 0-100 % axis: host CPU, optionally this process's CPU (percent
of one core), and per GPU its utilisation and its memory in use as a share of its total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# One colour per GPU, in order (GPU memory uses its GPU's colour, dashed).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
CPU_COLOR = "#7f7f7f"
PROCESS_COLOR = "#bcbd22"
WAIT_COLOR = "#f4a261"


def plot_columns(gpus: Iterable[int], process: bool = True) -> list[str]:
    """The Trace columns :func:`percent_data` reads."""
    columns = ["cpu.util"] + (["proc.cpu"] if process else [])
    for index in gpus:
        columns += [f"gpu{index}.util", f"gpu{index}.mem_used", f"gpu{index}.mem_total"]
    return columns


def percent_data(frame: Any, gpus: Sequence[int], process: bool = True) -> dict[str, np.ndarray]:
    """The plotted series of a Frame, keyed ``cpu_util``, ``proc_cpu``, ``gpu0_util``, ``gpu0_mem``."""
    data = {"cpu_util": frame.mean["cpu.util"]}
    if process:
        data["proc_cpu"] = frame.mean["proc.cpu"]
    with np.errstate(invalid="ignore", divide="ignore"):
        for index in gpus:
            data[f"gpu{index}_util"] = frame.mean[f"gpu{index}.util"]
            data[f"gpu{index}_mem"] = 100.0 * frame.mean[f"gpu{index}.mem_used"] / frame.mean[f"gpu{index}.mem_total"]
    return data


def merge_bands(spans: Iterable[Any], gap: float, after: float = -np.inf) -> list[tuple[float, float]]:
    """Spans as (start, end) bands: neighbours closer than ``gap`` merged, all before ``after`` cut."""
    bands: list[tuple[float, float]] = []
    for span in spans:
        if span.end <= after:
            continue
        start = max(span.start, after)
        if bands and start - bands[-1][1] <= gap:
            bands[-1] = (bands[-1][0], max(bands[-1][1], span.end))
        else:
            bands.append((start, span.end))
    return bands
