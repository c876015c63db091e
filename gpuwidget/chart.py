"""What every chart of a run draws, and in which colours: the live plot (ui/live.py) and the
report's static chart (report.py) both read their series and colours here.

It sits beside report.py, not in ui/, because the report is imported by the model (``Run``
renders itself) and the model never imports ``gpuwidget.ui``.

Both put everything on one 0-100 % axis: host CPU, optionally this process's CPU (percent
of one core), and per GPU how busy it was and its memory in use as a share of its total. How
busy is SM activity (GPM) where the GPU has it, with NVML's utilisation beside it as "kernel
running" (a few tiny kernels keep that near 100% while most SMs idle); without GPM, utilisation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

# One colour per GPU, in order (GPU memory uses its GPU's colour, dashed).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
CPU_COLOR = "#7f7f7f"
PROCESS_COLOR = "#bcbd22"
WAIT_COLOR = "#f4a261"


class GpuSeries(NamedTuple):
    """One GPU line of a chart: its key in :func:`percent_data`, its GPU, label, colour and kind."""

    key: str  # "gpu0_sm", "gpu0_util", "gpu0_mem"
    gpu: int
    label: str
    color: str
    kind: str  # "busy" (the busy figure: solid), "kernel" (utilisation beside SM activity), "memory"


def gpu_series(gpus: Sequence[int], sm_active: Collection[int] = (),
               kernel_running: Collection[int] | None = None) -> list[GpuSeries]:
    """Each GPU's lines, in order: the busy figure ("SM active" for the GPUs in ``sm_active``, else
    "kernel running (nvidia-smi)"), "kernel running" beside SM activity, and memory.

    ``kernel_running``: the GPUs that report utilisation (default all; a MIG instance does not).
    """
    series: list[GpuSeries] = []
    for n, index in enumerate(gpus):
        color = PALETTE[n % len(PALETTE)]
        running = kernel_running is None or index in kernel_running
        if index in sm_active:
            series.append(GpuSeries(f"gpu{index}_sm", index, f"GPU{index} SM active", color, "busy"))
            if running:
                series.append(GpuSeries(f"gpu{index}_util", index, f"GPU{index} kernel running", color, "kernel"))
        elif running:
            series.append(GpuSeries(f"gpu{index}_util", index, f"GPU{index} kernel running (nvidia-smi)", color,
                                    "busy"))
        series.append(GpuSeries(f"gpu{index}_mem", index, f"GPU{index} memory", color, "memory"))
    return series


def sm_active_gpus(columns: Iterable[str], gpus: Iterable[int]) -> list[int]:
    """The GPUs of ``gpus`` whose SM activity a Trace holds (``gpu0.sm_active``)."""
    held = set(columns)
    return [index for index in gpus if f"gpu{index}.sm_active" in held]


def plot_columns(gpus: Iterable[int], process: bool = True, sm_active: Collection[int] = ()) -> list[str]:
    """The Trace columns :func:`percent_data` reads."""
    columns = ["cpu.util"] + (["proc.cpu"] if process else [])
    for index in gpus:
        columns += [f"gpu{index}.util", f"gpu{index}.mem_used", f"gpu{index}.mem_total"]
        if index in sm_active:
            columns.append(f"gpu{index}.sm_active")
    return columns


def percent_data(frame: Any, gpus: Sequence[int], process: bool = True,
                 sm_active: Collection[int] = ()) -> dict[str, np.ndarray]:
    """The plotted series of a Frame, keyed ``cpu_util``, ``proc_cpu``, ``gpu0_util``, ``gpu0_sm``, ``gpu0_mem``."""
    data = {"cpu_util": frame.mean["cpu.util"]}
    if process:
        data["proc_cpu"] = frame.mean["proc.cpu"]
    with np.errstate(invalid="ignore", divide="ignore"):
        for index in gpus:
            data[f"gpu{index}_util"] = frame.mean[f"gpu{index}.util"]
            if index in sm_active:
                data[f"gpu{index}_sm"] = frame.mean[f"gpu{index}.sm_active"]
            data[f"gpu{index}_mem"] = 100.0 * frame.mean[f"gpu{index}.mem_used"] / frame.mean[f"gpu{index}.mem_total"]
    return data


def machine_gpu_lines(machine: Any) -> tuple[list[int], list[int], list[int]]:
    """From a run's machine facts: the GPUs watched, those with GPM (SM activity), those with utilisation."""
    devices = [device for device in machine.get("gpus") or [] if device.get("index") is not None]
    gpus = [int(device["index"]) for device in devices]
    sm = [int(device["index"]) for device in devices if device.get("gpm")]
    running = [int(device["index"]) for device in devices if not device.get("is_mig")]
    return gpus, sm, running


# How each kind of GPU line is dashed in an SVG chart (stroke-dasharray; "" solid).
SVG_DASH = {"busy": "", "kernel": "1 2", "memory": "4 3"}


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
