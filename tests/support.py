"""Small helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import threading

from gpuwidget.sampler import THREAD_NAME


def sampler_threads() -> list[threading.Thread]:
    """Sampler threads alive now (a finished watch must leave none)."""
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]
