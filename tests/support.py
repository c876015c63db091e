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

from gpuwidget.sampler import THREAD_NAME


def sampler_threads() -> list[threading.Thread]:
    """Sampler threads alive now (a finished watch must leave none)."""
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def burn_cpu(seconds: float) -> None:
    """Use ``seconds`` of CPU whatever else runs (a wall-clock burn would depend on the machine's load)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


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
