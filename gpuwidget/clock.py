"""The clocks every part of gpuwidget agrees on.

``now()`` is monotonic and high-resolution (sampler ticks, probe spans and the
Trace's time axis all use it, so they line up); ``wall_time()`` is only used to
anchor a Trace to the calendar.
"""

from __future__ import annotations

import time

now = time.perf_counter
wall_time = time.time
