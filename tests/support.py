"""Small helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from gpuwidget import WARM_UP_THREAD
from gpuwidget.sampler import THREAD_NAME


def sampler_threads() -> list[threading.Thread]:
    """Sampler threads alive now (a finished watch must leave none)."""
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def burn_cpu(seconds: float) -> None:
    """Use ``seconds`` of CPU whatever else runs (a wall-clock burn would depend on the machine's load)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


# spare_core(): the CPU seconds each process burns, and the ratios of two processes' wall time to
# one's that say a second core is free (two burns side by side take as long as one) or taken (they
# share one core: twice as long). Between them the machine is neither, as far as this can tell.
CALIBRATION_BURN_S = 0.25
SPARE_CORE_RATIO = 1.3
NO_SPARE_CORE_RATIO = 1.6


def _burn_processes(count: int) -> float:
    """Wall seconds for ``count`` forked processes each to burn CALIBRATION_BURN_S of CPU at once."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=burn_cpu, args=(CALIBRATION_BURN_S,)) for _ in range(count)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def spare_core() -> bool | None:
    """Whether a second process of this one gets a core of its own now, measured: a CPU burn in
    one process, then in two at once (the kernel shares the cores between sessions, so another
    user's busy process takes the second core from both). True or False when the ratio of their
    wall times says so clearly; None when it is between (the load changing, or part of a core)."""
    alone = _burn_processes(1)
    together = _burn_processes(2)
    ratio = together / ((alone + _burn_processes(1)) / 2)  # alone before and after: a drifting load averages out
    if ratio <= SPARE_CORE_RATIO:
        return True
    return False if ratio >= NO_SPARE_CORE_RATIO else None


@contextlib.contextmanager
def hogs(count: int, lifetime_s: float) -> Iterator[list[int]]:
    """``count`` ``while True: pass`` processes as another user's jobs are: not in this process
    tree (a shell starts each and exits) and in a session of their own (``setsid``: the kernel's
    autogroup then shares the cores between the sessions, as between two users' logins).
    Killed by pid when the block ends; each ends by itself after ``lifetime_s`` regardless."""
    hog = f"import time\nend = time.monotonic() + {lifetime_s}\nwhile time.monotonic() < end: pass"
    pids: list[int] = []
    try:
        for _ in range(count):
            started = subprocess.run(["sh", "-c", 'setsid "$0" -c "$1" </dev/null >/dev/null 2>&1 & echo $!',
                                      sys.executable, hog], capture_output=True, text=True, check=True, timeout=10)
            pids.append(int(started.stdout))
        time.sleep(0.3)  # let them reach the cores
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def gpuwidget_kernel(env: Mapping[str, str] | None = None) -> Iterator[Any]:
    """A real IPython kernel (jupyter_client) with ``%load_ext gpuwidget`` run; its client, shut down after."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", **({"env": dict(env)} if env is not None else {}))
    try:
        reply = kc.execute_interactive("%load_ext gpuwidget", timeout=60)
        assert reply["content"]["status"] == "ok"
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def warmed_up(kc: Any, timeout: float = 60) -> None:
    """Wait until the kernel's ``%load_ext gpuwidget`` warm-up (the live view's imports, on a thread
    of its own: gpuwidget._warm_up) has ended, as it has by the time a user runs a watched cell
    after loading the extension; a cell run at once waits for the imports instead (about a second
    of CPU: bokeh's and jupyter_bokeh's)."""
    reply = kc.execute_interactive("import threading as _t\n[thread.join() for thread in _t.enumerate() "
                                   f"if thread.name == {WARM_UP_THREAD!r}]\ndel _t", timeout=timeout)
    assert reply["content"]["status"] == "ok"


def cell_messages(kc: Any, code: str, timeout: float = 60, **execute: Any) -> list[tuple[float, dict]]:
    """Execute ``code`` (``execute``: more arguments for ``kc.execute``, e.g. ``silent=True``); this
    cell's iopub messages with their arrival times (s after sending it), up to its idle."""
    started = time.perf_counter()
    msg_id = kc.execute(code, **execute)
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append((time.perf_counter() - started, msg))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
