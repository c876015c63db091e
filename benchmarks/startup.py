"""Start-up: ``import gpuwidget`` is cheap, and the first live point arrives <= 1 s after a cell starts.

1. ``import gpuwidget`` wall time in fresh interpreters (``python -c``, timed inside the
   process with ``time.perf_counter()``, so interpreter start-up is not counted): the
   median of 7 runs, and the first run apart (it may find a cold file cache). Each run
   also lists which heavy modules the import pulled in: torch, bokeh and pynvml must not
   be among them (numpy and psutil are expected: the Trace and the host source use them).
2. In a real kernel (``jupyter_client.manager.start_new_kernel(kernel_name="python3")``,
   after ``%load_ext gpuwidget``): the time from sending the execute request of
   ``%%gpuwatch --interval 0.1`` + ``time.sleep(2)`` to the first iopub ``comm_msg`` whose
   ``data.method`` is ``"custom"`` (jupyter_bokeh's Bokeh stream patch that carries the
   first data point), for the first watched cell in a fresh kernel (which imports bokeh
   and sends BokehJS) and for a second cell. This is when the point leaves the kernel; a
   browser adds the websocket hop and BokehJS's render (a few ms to tens of ms more).

Targets: import <= 0.3 s; first live point <= 1 s.

    .venv/bin/python benchmarks/startup.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from _common import ROOT, median, parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

TARGET_IMPORT_S = 0.3
TARGET_FIRST_POINT_S = 1.0
FORBIDDEN = ("torch", "bokeh", "pynvml")
WATCHED = ("torch", "bokeh", "pynvml", "jupyter_bokeh", "ipywidgets", "IPython", "numpy", "psutil")
CELL = "%%gpuwatch --interval 0.1\nimport time\ntime.sleep(2)"

_PROBE = (
    "import time; t = time.perf_counter(); import gpuwidget; elapsed = time.perf_counter() - t\n"
    "import json, sys\n"
    f"print(json.dumps({{'s': elapsed, 'modules': [m for m in {WATCHED!r} if m in sys.modules]}}))"
)


def child_env() -> dict[str, str]:
    """This environment, with the checkout importable (a no-op for an editable install)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def import_times(runs: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              cwd=ROOT, env=child_env(), check=True)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def time_cell(kc: Any, code: str, timeout: float = 60) -> dict[str, Any]:
    """Seconds from sending ``code`` to: the first stream patch, the widget's display, idle;
    and whatever the cell wrote to stderr (warnings a user would see under the cell)."""
    started = time.perf_counter()
    msg_id = kc.execute(code)
    first_custom = widget = bokehjs = None
    stderr: list[str] = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        at = time.perf_counter() - started
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "comm_msg" and first_custom is None and content.get("data", {}).get("method") == "custom":
            first_custom = at
        elif kind == "display_data":
            data = content.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data and widget is None:
                widget = at
            if "application/javascript" in data and bokehjs is None:
                bokehjs = at
        elif kind == "stream" and content.get("name") == "stderr":
            stderr.append(content.get("text", ""))
        elif kind == "error":
            raise RuntimeError(f"the cell failed: {content.get('ename')}: {content.get('evalue')}")
        elif kind == "status" and content["execution_state"] == "idle":
            return {"first_point_s": first_custom, "widget_s": widget, "bokehjs_s": bokehjs, "idle_s": at,
                    "stderr": "".join(stderr)}


def kernel_times(kernels: int) -> list[dict[str, Any]]:
    from jupyter_client.manager import start_new_kernel

    out = []
    for _ in range(kernels):
        started = time.perf_counter()
        km, kc = start_new_kernel(kernel_name="python3", env=child_env(), cwd=str(ROOT))
        try:
            ready = time.perf_counter() - started
            t = time.perf_counter()
            reply = kc.execute_interactive("%load_ext gpuwidget", timeout=60)
            load_ext = time.perf_counter() - t
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"%load_ext gpuwidget failed: {reply['content']}")
            first = time_cell(kc, CELL)
            second = time_cell(kc, CELL)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        out.append({"kernel_start_s": ready, "load_ext_s": load_ext, "first": first, "second": second})
    return out


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    args = parse_args("import gpuwidget time, and time to the first live point in a real kernel.")
    info = print_header("Start-up: import time, and the first live point of a watched cell")
    runs = 3 if args.quick else 7
    kernels = 1 if args.quick else 3

    imports = import_times(runs)
    seconds = [r["s"] for r in imports]
    heavy = sorted({m for r in imports for m in r["modules"] if m in FORBIDDEN})
    loaded = sorted({m for r in imports for m in r["modules"]})
    print()
    print(f"import gpuwidget ({runs} fresh interpreters, {sys.executable})")
    table(["run", *[str(i + 1) for i in range(runs)], "median"],
          [["seconds", *[f"{s:.3f}" for s in seconds], f"{median(seconds):.3f}"]])
    print(f"  modules loaded by the import (of {', '.join(WATCHED)}): {', '.join(loaded) or 'none'}")

    results = kernel_times(kernels)
    print()
    print(f"first live point: send of the execute request -> first Bokeh stream patch ({kernels} fresh kernel(s))")
    rows = []
    for n, r in enumerate(results, 1):
        for which in ("first", "second"):
            c = r[which]
            rows.append([f"kernel {n}, {which} watched cell", fmt(c["first_point_s"]), fmt(c["bokehjs_s"]),
                         fmt(c["widget_s"]), fmt(c["idle_s"])])
    table(["cell", "first point s", "first JS shown s", "widget shown s", "cell idle s"], rows)
    warnings = sorted({line.strip() for r in results for which in ("first", "second")
                       for line in r[which]["stderr"].splitlines() if line.strip()})
    for line in warnings[:5]:
        print(f"  stderr under a watched cell: {line[:200]}")
    starts = [r["kernel_start_s"] for r in results]
    loads = [r["load_ext_s"] for r in results]
    print(f"  kernel start {median(starts):.2f} s, %load_ext gpuwidget {1e3 * median(loads):.0f} ms (medians)")

    def points(which: str) -> list[float]:
        return [r[which]["first_point_s"] if r[which]["first_point_s"] is not None else float("inf")
                for r in results]

    first_point = median(points("first"))
    second_point = median(points("second"))
    print()
    verdicts = [
        verdict("import gpuwidget (median)", median(seconds), TARGET_IMPORT_S, higher_is_better=False,
                shown=f"{median(seconds):.3f} s (first run {seconds[0]:.3f} s)",
                target_shown=f"{TARGET_IMPORT_S} s"),
    ]
    word = "PASS" if not heavy else "MISS"
    print(f"{word}  import gpuwidget loads none of {', '.join(FORBIDDEN)}: "
          f"{'none loaded' if not heavy else 'loaded ' + ', '.join(heavy)}")
    verdicts.append({"target": "no heavy imports", "value": heavy, "result": word})
    verdicts += [
        verdict("first live point, first watched cell in a fresh kernel (median)", first_point,
                TARGET_FIRST_POINT_S, higher_is_better=False, shown=f"{first_point:.3f} s",
                target_shown=f"{TARGET_FIRST_POINT_S} s"),
        verdict("first live point, second watched cell (median)", second_point, TARGET_FIRST_POINT_S,
                higher_is_better=False, shown=f"{second_point:.3f} s", target_shown=f"{TARGET_FIRST_POINT_S} s"),
    ]
    write_json(args.json, {"benchmark": "startup", "machine": info, "quick": args.quick,
                           "imports": imports, "kernels": results, "verdicts": verdicts})


if __name__ == "__main__":
    main()
