"""Whose GPU memory is ours: this process and its descendants among the processes NVML lists, and
what to do when NVML's pids are another PID namespace's (a container) or misread (early R535 structs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuwidget.sources.pids import OwnProcesses, foreign_pid_namespace, namespace_pids, pid_visible

__all__ = ["OwnProcesses", "foreign_pid_namespace", "namespace_pids", "pid_visible"]


def _plausible(processes: Iterable[Any], memory_total: int | None) -> bool:
    """False for a process list read with the wrong struct size: pid 0, or more memory than the GPU has."""
    for process in processes:
        used = process.usedGpuMemory
        if process.pid <= 0 or (used is not None and memory_total is not None and used > memory_total):
            return False
    return True
