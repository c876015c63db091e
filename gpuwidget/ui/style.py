"""Colours shared by the live plot and the post-run panel, so a series looks the same in both."""

from __future__ import annotations

# One colour per GPU, in order (GPU memory uses its GPU's colour, dashed).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
CPU_COLOR = "#7f7f7f"
PROCESS_COLOR = "#bcbd22"
WAIT_COLOR = "#f4a261"
