"""Static live view: CPU time per redraw of the widget-free chart (``--view static``).

The sampler thread redraws the chart about once a second (gpuwidget.ui.static). Measured as
thread CPU time (``time.thread_time()``), so other processes' load affects it little:

(a) ``StaticView.bundle()`` (the SVG and its text line) in steady state: between two redraws
    the run grows by one second (rows at 4 Hz and the data waits of that second), as it does
    under a running cell. Cases: 1 GPU after 1 minute, and 1 and 8 GPUs after an hour with
    the Trace's 20,000 kept waits. The panel's ``report.chart_svg`` on the same run for
    comparison (it reads every kept wait each time).
(b) ``StaticView.update()`` inside a real kernel (ipykernel): the redraw plus IPython's display
    update (JSON, the message's signing, handing it to the IOPub thread), the same 8-GPU hour.

Target: < 5 ms of CPU per redraw (0.5 % of a core at one redraw a second).

    .venv/bin/python benchmarks/static_view.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import time
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

from gpuwidget.probes import DATA_WAIT_SPAN  # noqa: E402
from gpuwidget.report import chart_svg  # noqa: E402
from gpuwidget.run import Run  # noqa: E402
from gpuwidget.trace import Trace  # noqa: E402
from gpuwidget.ui.static import StaticView  # noqa: E402

TARGET_MS = 5.0
RATE_HZ = 4


def row(t: float, gpus: int) -> dict[str, float]:
    values = {"cpu.util": 40.0 + 20 * ((t * 7) % 1), "proc.cpu": 95.0}
    for i in range(gpus):
        values.update({f"gpu{i}.util": 60.0 + 30 * ((t * 3 + i) % 1), f"gpu{i}.mem_used": 3e9 + i * 1e8,
                       f"gpu{i}.mem_total": 8e10})
    return values


def grow(trace: Trace, t0: float, t1: float, gpus: int, waits_per_s: float) -> None:
    """Samples at RATE_HZ and data waits (a third of each period) from t0 to t1."""
    n0, n1 = int(t0 * RATE_HZ), int(t1 * RATE_HZ)
    for n in range(n0, n1):
        trace.append(n / RATE_HZ, row(n / RATE_HZ, gpus))
    if waits_per_s:
        step = 1 / waits_per_s
        k0, k1 = int(t0 / step), int(t1 / step)
        trace.add_spans(DATA_WAIT_SPAN, [(k * step, k * step + step / 3) for k in range(k0, k1)])


def machine_facts(gpus: int) -> dict[str, Any]:
    return {"gpus": [{"index": i, "name": "fake"} for i in range(gpus)], "gpu_message": None}


def steady_state(gpus: int, seconds: float, waits_per_s: float, redraws: int) -> dict[str, Any]:
    trace = Trace(start_clock=0.0)
    grow(trace, 0.0, seconds, gpus, waits_per_s)
    view = StaticView(trace, machine_facts(gpus), label="In [1]")
    start = time.thread_time()
    view.bundle()
    first_ms = (time.thread_time() - start) * 1000
    costs, size = [], 0
    for k in range(redraws):
        grow(trace, seconds + k, seconds + k + 1, gpus, waits_per_s)
        start = time.thread_time()
        bundle = view.bundle()
        costs.append((time.thread_time() - start) * 1000)
        size = len(bundle["image/svg+xml"])
    run = Run(trace=trace, machine=machine_facts(gpus))
    start = time.thread_time()
    for _ in range(3):
        chart_svg(run)
    panel_ms = (time.thread_time() - start) * 1000 / 3
    return {"gpus": gpus, "seconds": seconds, "waits_kept": len(trace.spans(DATA_WAIT_SPAN)),
            "first_ms": first_ms, "median_ms": median(costs), "max_ms": max(costs), "svg_bytes": size,
            "panel_chart_ms": panel_ms}


KERNEL_CODE = """
import json, time
from gpuwidget.trace import Trace
from gpuwidget.ui.static import StaticView
import sys; sys.path.insert(0, {bench!r})
from static_view import grow, machine_facts
trace = Trace(start_clock=0.0)
grow(trace, 0.0, {seconds}, 8, 20)
view = StaticView(trace, machine_facts(8), label="In [1]")
view.show()
view.update()
costs = []
for k in range({redraws}):
    grow(trace, {seconds} + k, {seconds} + k + 1, 8, 20)
    start = time.thread_time()
    view.update()
    costs.append((time.thread_time() - start) * 1000)
print("RESULT " + json.dumps(costs))
"""


def in_kernel(seconds: float, redraws: int) -> list[float]:
    from pathlib import Path

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    out: list[str] = []
    try:
        code = KERNEL_CODE.format(bench=str(Path(__file__).parent), seconds=seconds, redraws=redraws)
        kc.execute_interactive(code, timeout=300, output_hook=lambda msg: out.append(
            msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    for text in "".join(out).splitlines():
        if text.startswith("RESULT "):
            return json.loads(text[len("RESULT "):])
    raise RuntimeError("the kernel printed no result:\n" + "".join(out))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    header = print_header("Static live view: CPU per redraw")
    redraws = 10 if args.quick else 60
    hour = 300.0 if args.quick else 3600.0
    cases = [steady_state(1, 60.0, 5, redraws), steady_state(1, hour, 20, redraws), steady_state(8, hour, 20, redraws)]
    print("(a) StaticView.bundle(), ms of thread CPU per redraw (the run grows 1 s between redraws)")
    table(["GPUs", "run", "waits kept", "first redraw", "median", "max", "SVG bytes", "panel chart_svg"],
          [[c["gpus"], f"{c['seconds']:.0f} s", c["waits_kept"], f"{c['first_ms']:.1f}", f"{c['median_ms']:.2f}",
            f"{c['max_ms']:.2f}", c["svg_bytes"], f"{c['panel_chart_ms']:.1f}"] for c in cases])
    kernel = in_kernel(hour, redraws)
    print(f"(b) StaticView.update() in a kernel, 8 GPUs, {hour:.0f} s run: median {median(kernel):.2f} ms, "
          f"max {max(kernel):.2f} ms of thread CPU")
    results = [verdict("redraw, 8 GPUs, an hour, in a kernel", median(kernel), TARGET_MS, higher_is_better=False,
                       shown=f"{median(kernel):.2f} ms", target_shown=f"{TARGET_MS:g} ms")]
    write_json(args.json, {**header, "steady_state": cases, "kernel_update_ms": kernel, "verdicts": results})


if __name__ == "__main__":
    main()
