"""The watch's side of the child channel: a thread that accepts child processes and takes in what they send.

The socket lives in a fresh directory only its user can enter (``tempfile.mkdtemp``: mode
0700), so no other user can connect or read it. One thread serves every child with a
selector: it never blocks on one of them, and a child that crashes or is killed just ends
its connection (what it sent so far stays, the process is recorded as not finished). Memory
is bounded: a message is at most :data:`~gpuwidget.children.protocol.MAX_MESSAGE_BYTES`,
at most :data:`MAX_PROCESSES` processes are recorded, each keeps at most
:data:`STEP_HISTORY` step times, and spans go into the watch's Trace, which is bounded itself.
:meth:`ChildChannel.close` reads what finished children left in their sockets, closes every
socket and removes the directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import tempfile
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from gpuwidget.children.protocol import Identity, Progress, decode_frames, open_kind
from gpuwidget.facts import MainThreadFigures, ProcessCpu, WorkloadFacts
from gpuwidget.probes import BETWEEN_STEPS_SPAN, DATA_WAIT_SPAN, STEP_SPAN, TRAIN_STEP_SPAN
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

THREAD_NAME = "gpuwidget-children"
MAX_PROCESSES = 1024
MAX_CONNECTIONS = 1024
STEP_HISTORY = 4096
SPAN_KINDS = (STEP_SPAN, DATA_WAIT_SPAN, TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN)
# At close, keep reading while finished children's data is still arriving, for at most this long.
DRAIN_S = 1.0
READ_BYTES = 1 << 18
# A Unix socket path is limited to 107 bytes; a longer temp dir falls back to /tmp.
MAX_SOCKET_PATH = 100


@dataclass
class ChildRecord:
    """What one child process told the watch."""

    pid: int
    identity: Identity = field(default_factory=lambda: Identity())
    progress: Progress = field(default_factory=lambda: Progress())
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    wait_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    workload: WorkloadFacts | None = None
    host: MainThreadFigures = field(default_factory=lambda: MainThreadFigures())
    finished: bool = False  # its final facts arrived (it exited normally)
    dropped_spans: int = 0
    cpu: ProcessCpu = field(default_factory=lambda: ProcessCpu())  # the latest protocol ``Cpu`` it sent

    @property
    def rank(self) -> int | None:
        rank = self.identity.get("rank")
        return rank if isinstance(rank, int) else None


class ChildChannel:
    """The listening socket and its thread; records per child process, spans into ``trace``."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.records: dict[int, ChildRecord] = {}
        self.errors: list[str] = []
        self.dropped_processes = 0
        self.directory = _private_dir()
        self.path = os.path.join(self.directory, "children.sock")
        self._lock = threading.Lock()  # records, between the thread and readers
        self._selector = selectors.DefaultSelector()
        self._buffers: dict[socket.socket, bytearray] = {}
        self._pids: dict[socket.socket, int] = {}
        self._closing = False
        try:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.path)
            self._listener.listen(128)
            self._listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")
            self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- the thread

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select(timeout=1.0):
                    self._ready(key)
            self._drain()
        except Exception as exc:  # noqa: BLE001 - the watch goes on without children's data
            self.errors.append(f"child channel stopped: {exc!r}")
            log.warning("gpuwidget: child channel stopped: %s", exc)
        finally:
            self._close_sockets()

    def _ready(self, key: selectors.SelectorKey) -> bool:
        """Handle one ready socket; True if it had data."""
        if key.data == "accept":
            self._accept()
            return True
        if key.data == "wake":
            with contextlib.suppress(OSError):
                self._wake_r.recv(64)
            return False
        return self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.errors.append(f"accept failed: {exc!r}")
                return
            if len(self._buffers) >= MAX_CONNECTIONS:
                conn.close()
                self.dropped_processes += 1
                continue
            conn.setblocking(False)
            self._buffers[conn] = bytearray()
            self._selector.register(conn, selectors.EVENT_READ, "child")

    def _read(self, conn: socket.socket) -> bool:
        try:
            data = conn.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return False
        buffer = self._buffers[conn]
        buffer += data
        try:
            messages = decode_frames(buffer)
        except ValueError as exc:
            self.errors.append(f"child {self._pids.get(conn)}: {exc}")
            self._drop(conn)
            return True
        for message in messages:
            try:
                self._handle(conn, message)
            except Exception as exc:  # noqa: BLE001 - one bad message never stops the channel
                self.errors.append(f"child {self._pids.get(conn)}: bad {message.get('kind')!r} message: {exc!r}")
        return True

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(Exception):
            self._selector.unregister(conn)
        conn.close()
        self._buffers.pop(conn, None)
        self._pids.pop(conn, None)

    def _handle(self, conn: socket.socket, message: dict[str, Any]) -> None:
        identity = message.get("id")
        if not isinstance(identity, dict) or not isinstance(identity.get("pid"), int):
            raise ValueError("no pid")
        pid = identity["pid"]
        self._pids[conn] = pid
        with self._lock:
            record = self.records.get(pid)
            if record is None:
                if len(self.records) >= MAX_PROCESSES:
                    self.dropped_processes += 1
                    return
                record = self.records[pid] = ChildRecord(pid)
            record.identity.update(cast(Identity, {k: v for k, v in identity.items() if v is not None}))
            if isinstance(message.get("progress"), dict) and message["progress"]:
                record.progress = message["progress"]
            if isinstance(message.get("cpu"), dict):
                record.cpu = cast(ProcessCpu, {key: float(value) for key, value in message["cpu"].items()
                                               if isinstance(value, (int, float))})
            kind = message.get("kind")
            if kind == "spans":
                record.dropped_spans = int(message.get("dropped_spans") or 0)
                spans = message.get("spans") or {}
            elif kind == "facts":
                spans = {}
                if isinstance(message.get("workload"), dict):
                    record.workload = message["workload"]
                if isinstance(message.get("host"), dict):
                    record.host = message["host"]
                record.finished = record.finished or bool(message.get("final"))
            else:
                raise ValueError("unknown kind")
        self._add_spans(record, spans)

    def _add_spans(self, record: ChildRecord, spans: Mapping[str, object]) -> None:
        origin = self.trace.start_clock
        attrs = {"pid": record.pid, "rank": record.rank}
        for kind in SPAN_KINDS:
            for key, still_open in ((kind, False), (open_kind(kind), True)):
                items = spans.get(key)
                if not isinstance(items, list) or not items:
                    continue
                intervals = [(float(start) - origin, float(end) - origin) for start, end in items]
                # the DataLoader's figures, if the child dies before its facts (an open step was not a whole step)
                if not still_open and kind in (STEP_SPAN, DATA_WAIT_SPAN):
                    history = record.step_times if kind == STEP_SPAN else record.wait_times
                    history.extend(end - start for start, end in intervals)
                self.trace.add_spans(kind, intervals, {**attrs, "open": True} if still_open else attrs)

    def _drain(self) -> None:
        """Read what is already in the sockets (children that exited left their last messages there)."""
        from gpuwidget.clock import now

        deadline = now() + DRAIN_S
        while now() < deadline:
            ready = self._selector.select(timeout=0.05)
            if not any(self._ready(key) for key, _ in ready):
                return

    def _close_sockets(self) -> None:
        for conn in list(self._buffers):
            self._drop(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(Exception):
                self._selector.unregister(sock)
            sock.close()
        self._selector.close()

    # ----------------------------------------------------------------- the watch's side

    def snapshot(self) -> list[ChildRecord]:
        """The records so far (copies of their mutable parts), by pid."""
        with self._lock:
            return [replace(r, identity=r.identity.copy(), progress=r.progress.copy(),
                            step_times=deque(r.step_times, STEP_HISTORY), wait_times=deque(r.wait_times, STEP_HISTORY),
                            host=r.host.copy(), cpu=r.cpu.copy())
                    for _, r in sorted(self.records.items())]

    def close(self) -> None:
        """Take in what finished children left, stop the thread, close every socket, remove the directory."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        try:  # a Ctrl-C here still removes the directory; the thread closes its sockets on its own
            self._thread.join(DRAIN_S + 2.0)
            if self._thread.is_alive():
                self.errors.append("child channel thread did not stop in time")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def close_in_forked_child(self) -> None:
        """A forked child's copies of the sockets (the thread was not copied): close them, touch nothing else."""
        closeable: list[Any] = [*self._buffers, self._listener, self._wake_r, self._wake_w, self._selector]
        for item in closeable:
            with contextlib.suppress(Exception):
                item.close()


def _private_dir() -> str:
    """A new directory only this user can enter, short enough for a socket path inside it."""
    directory = tempfile.mkdtemp(prefix="gpuwidget-")
    if len(directory) + len("/children.sock") <= MAX_SOCKET_PATH:
        return directory
    os.rmdir(directory)
    return tempfile.mkdtemp(prefix="gpuwidget-", dir="/tmp")
