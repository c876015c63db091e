"""Small helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import threading
import time

from gpuwidget.sampler import THREAD_NAME


def sampler_threads() -> list[threading.Thread]:
    """Sampler threads alive now (a finished watch must leave none)."""
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def burn_cpu(seconds: float) -> None:
    """Use ``seconds`` of CPU whatever else runs (a wall-clock burn would depend on the machine's load)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
