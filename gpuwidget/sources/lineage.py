"""A process's ancestry: the one place that walks parent pids (the GPU sources and the server share it).

A GPU source asks "is this GPU process ours or a DataLoader worker's?" and the server asks
"which kernel started this GPU process?"; both answer by walking up from the few pids the driver
lists, which is far cheaper than listing descendants (that scans the whole process table).
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil


def ancestors(pid: int, limit: int) -> Iterator[int]:
    """``pid``, then its parent, grandparent... at most ``limit`` pids in all.

    Stops early at init (pid 1 is not yielded as a parent) or where a process is gone or out
    of reach (another pid namespace, no permission): an ancestry is a best effort, never an error.
    """
    for _ in range(limit):
        yield pid
        try:
            pid = psutil.Process(pid).ppid()
        except (psutil.Error, ValueError):  # ValueError: a negative pid
            return
        if pid <= 1:
            return
