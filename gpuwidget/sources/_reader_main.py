"""The reader process's main (gpuwidget.sources.reader): host readings of another process, on request.

Run as a script by path (``python _reader_main.py``), not with ``-m``: importing the ``gpuwidget``
package would import everything a notebook needs (about half a second); the reader needs the host
source alone (about 0.1 s), so the package is put in ``sys.modules`` as a bare namespace first.

It serves one request at a time from stdin and answers on stdout, each message a 4-byte big-endian
length and a :mod:`marshal` payload (plain data only):

* ``("open", key, pid)`` -> ``("ok", key, None, [], False)``: a host source reading ``pid``'s process
  tree (the reader itself left out of it);
* ``("open_gpus", key, gpus)`` -> ``("ok", key, devices, [], False)``: the GPUs ``gpus`` (None: all) as
  :func:`~gpuwidget.sources.gpu.open_gpu_sources` opens them, one source per GPU under keys ``key``,
  ``key + 1``...; ``devices``: each source's ``describe()``, for the parent to match with its own;
* ``("read", key)`` -> ``("ok", key, values, errors, closed)``: one reading, the errors the source
  recorded since the last answer, and whether it is closed (a GPU source that lost its GPUs);
* ``("read_many", 0, keys)`` -> ``("ok", 0, [(key, values, errors, closed), ...], [], False)``: a tick of
  every source the parent reads, in one exchange (``values`` None: that source's read failed, ``errors``
  says how);
* ``("close", key)`` -> ``("ok", key, None, [], True)``.

A request that fails is answered ``("error", key, message, [], False)``, and the reader goes on.

It ends when stdin closes, and within a second of its parent ending (it checks who its parent is): it
never outlives the process it reads for, whatever ended that one (SIGKILL included).
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import signal
import struct
import sys
import types
from typing import Any

HEADER = struct.Struct(">I")
# How often the reader looks whether its parent is still there while no request comes.
PARENT_CHECK_S = 1.0
# Each GPU vendor's driver gets this long to start in the reader (as in a watch: gpuwidget.session).
GPU_START_DEADLINE_S = 5.0


def _bootstrap() -> None:
    """Make ``gpuwidget`` importable without running its ``__init__`` (the notebook-facing imports)."""
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's folder: its modules (host, base, ...) are not top-level ones
    if "gpuwidget" in sys.modules:
        return
    package = types.ModuleType("gpuwidget")
    package.__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    sys.modules["gpuwidget"] = package


def _read_exactly(fd: int, count: int) -> bytes | None:
    chunks = []
    while count:
        chunk = os.read(fd, count)
        if not chunk:
            return None
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _send(fd: int, message: Any) -> None:
    payload = marshal.dumps(message)
    data = HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def _read(source: Any, key: int, reported: dict[int, int]) -> tuple[dict[str, float], list[str], bool]:
    """One reading of ``source``, the errors it recorded since the last, whether it is closed."""
    values = source.read()
    errors = [error.message for error in source.errors[reported[key]:]]
    reported[key] = len(source.errors)
    return values, errors, bool(getattr(source, "closed", False))


def serve(stdin: int, stdout: int, parent: int) -> None:
    _bootstrap()
    from gpuwidget.sources import host, pids
    from gpuwidget.sources.host import HostSource

    host.HIDDEN_PIDS.add(os.getpid())  # a child of the process it reads: not one of that one's workers
    pids.WATCHED_PID = parent  # the GPU memory of the parent's tree is "ours", not the reader's

    sources: dict[int, Any] = {}
    reported: dict[int, int] = {}
    _send(stdout, ("hello", os.getpid()))
    while True:
        ready, _, _ = select.select([stdin], [], [], PARENT_CHECK_S)
        if not ready:
            if os.getppid() != parent:
                return  # the parent ended: whoever adopted us has no use for these readings
            continue
        header = _read_exactly(stdin, HEADER.size)
        if header is None:
            return
        body = _read_exactly(stdin, HEADER.unpack(header)[0])
        if body is None:
            return
        request = marshal.loads(body)
        kind, key = request[0], request[1]
        payload: Any = None
        errors: list[str] = []
        closed = False
        try:
            if kind == "open":
                sources[key] = HostSource(pid=int(request[2]))
                reported[key] = 0
            elif kind == "open_gpus":
                from gpuwidget.sources.gpu import open_gpu_sources

                opened = open_gpu_sources(request[2], deadline_s=GPU_START_DEADLINE_S)
                payload = []
                for offset, source in enumerate(opened.sources):
                    sources[key + offset], reported[key + offset] = source, 0
                    payload.append([dict(device) for device in source.describe()])
            elif kind == "read":
                payload, errors, closed = _read(sources[key], key, reported)
            elif kind == "read_many":
                payload = []
                for each in request[2]:
                    try:
                        payload.append((each, *_read(sources[each], each, reported)))
                    except Exception as exc:  # noqa: BLE001 - that source's answer says so; the others go on
                        payload.append((each, None, [f"{type(exc).__name__}: {exc}"], False))
            elif kind == "close":
                closing = sources.pop(key, None)
                reported.pop(key, None)
                if closing is not None:
                    closing.close()
                closed = True
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # noqa: BLE001 - the answer says what failed; the reader goes on
            _send(stdout, ("error", key, f"{type(exc).__name__}: {exc}", [], False))
            continue
        _send(stdout, ("ok", key, payload, errors, closed))


def main() -> int:
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    if os.getppid() != parent:
        return 0  # the parent is gone already
    # Jupyter interrupts a kernel by signalling its process group: Ctrl-C is the user's cell's, not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        serve(sys.stdin.fileno(), sys.stdout.fileno(), parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
