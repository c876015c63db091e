"""The host and GPU sources read in a process of their own, so that their work does not hold the watched
loop's GIL.

A watch's sampler thread reads its sources with the GIL held for all their Python: the host source's
``/proc`` reads and parsing are a few hundred microseconds a tick here and grow with the process table,
and a GPU source makes tens of driver calls a tick through ctypes. With ``GPUWIDGET_READER=process`` a
watch reads them through :class:`ReaderProcess` instead: a small Python process (``_reader_main.py``,
started once per kernel, on the first such watch) that builds the same
:class:`~gpuwidget.sources.host.HostSource` for the watched process, opens the same GPUs as the watch
(``open_gpu_sources``, the watched process's GPU memory counted as its own), and answers one reading per
tick and source over a pipe. The sampler thread then only writes a request and reads the answer, waiting
without the GIL, and the Trace gets the same columns from the same counters.

Nothing is lost when the reader cannot serve: a reader that cannot start, dies or does not answer within
:data:`REPLY_DEADLINE_S` is stopped, the watch reads in this process from then on, and the run's source
errors say so. GPUs the reader does not open as this process did (a test's fake driver answers in this
process only) are read here. The reader never outlives this process (it ends with its stdin, or within a
second of its parent's end, SIGKILL included), a forked child (a DataLoader worker) never talks to it, and
it is never counted among the watched process's workers (``host.HIDDEN_PIDS``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import marshal
import os
import select
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from gpuwidget.clock import now
from gpuwidget.sources import host
from gpuwidget.sources._reader_main import HEADER
from gpuwidget.sources.base import ErrorLog, SourceError
from gpuwidget.sources.gpu import GpuSource
from gpuwidget.sources.host import HostSource

# Where a watch's sampler reads the host: "thread" (its own thread, the default) or "process".
READER_ENV = "GPUWIDGET_READER"
READERS = ("thread", "process")
# The reader's first answer (it imports the host source: ~0.1 s) is awaited this long; a watch that
# starts meanwhile reads in this process.
START_DEADLINE_S = 3.0
# A reading takes milliseconds; an answer this late means the reader is stuck or starved: it is stopped
# and the watch reads in this process, well before the sampler's watchdog would drop the host source.
REPLY_DEADLINE_S = 1.0
# Opening the GPUs in the reader: each vendor's driver gets the watch's deadline to start, and a little more.
GPU_OPEN_DEADLINE_S = 6.0
SCRIPT = Path(__file__).with_name("_reader_main.py")


class ReaderGone(Exception):
    """The reader process cannot answer (it never started, ended, or stopped answering)."""


def reader_choice(value: str | None = None) -> str:
    """The reader asked for (``value``, else :data:`READER_ENV`, else "thread"); ValueError if unknown."""
    chosen = (value if value is not None else os.environ.get(READER_ENV, "")).strip().lower() or "thread"
    if chosen not in READERS:
        raise ValueError(f"{READER_ENV}: expected one of {', '.join(READERS)}, got {chosen!r}")
    return chosen


class ReaderProcess:
    """One reader process and its pipes; requests are served one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._keys = itertools.count(1)
        self._open: list[int] = []  # the sources open in the reader, in the order they were opened
        self._tick: dict[int, tuple[Any, list[str], bool]] = {}  # answers of the last read_many not yet taken
        self._owner = os.getpid()
        self.pid: int | None = None
        self.failure: str | None = None  # why it stopped serving, once it has

    def start(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Start it and wait for its first answer; raises :class:`ReaderGone` if it does not come."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWIDGET_CHILDREN")}
        env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)  # where gpuwidget and psutil are
        try:
            self._process = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True, bufsize=0)
        except OSError as exc:
            self._fail(f"could not start: {exc}")
        hello = self._receive(deadline_s)
        if not (isinstance(hello, tuple) and hello[:1] == ("hello",)):
            self._fail(f"answered {hello!r} instead of its greeting")
        self.pid = int(hello[1])
        host.HIDDEN_PIDS.add(self.pid)

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.poll() is None and self.failure is None
                and os.getpid() == self._owner)

    def open(self, pid: int) -> int:
        """A host source in the reader for ``pid``'s process tree; its key."""
        key = next(self._keys)
        self.call(("open", key, pid))
        self._open.append(key)
        return key

    def open_gpus(self, gpus: Sequence[int] | None) -> list[tuple[int, list[dict[str, Any]]]]:
        """The GPUs ``gpus`` opened in the reader as a watch opens them: (key, ``describe()``) per source."""
        first = next(self._keys)
        devices, _, _ = self.call(("open_gpus", first, None if gpus is None else list(gpus)), GPU_OPEN_DEADLINE_S)
        for _ in devices[1:]:
            next(self._keys)
        keys = [first + offset for offset in range(len(devices))]
        self._open.extend(keys)
        return list(zip(keys, devices))

    def read(self, key: int) -> tuple[dict[str, float], list[str], bool]:
        """A source's reading this tick: (values, errors, closed). The first source read in a tick asks for
        every open source's reading in one exchange; the others' are then taken from its answer."""
        with self._lock:
            answer = self._tick.pop(key, None)
        if answer is None:
            keys = [key, *(other for other in self._open if other != key)]
            answers, _, _ = self.call(("read_many", 0, keys))
            with self._lock:
                self._tick = {each: (values, errors, closed) for each, values, errors, closed in answers}
                answer = self._tick.pop(key, None)
        if answer is None or answer[0] is None:
            raise ReaderGone(f"could not read: {'; '.join(answer[1]) if answer else 'no answer'}")
        return answer

    def close_source(self, key: int) -> None:
        """Close one source in the reader."""
        with self._lock:
            if key in self._open:
                self._open.remove(key)
            self._tick.pop(key, None)
        self.call(("close", key))

    def call(self, request: tuple[Any, ...], deadline_s: float = REPLY_DEADLINE_S) -> tuple[Any, list[str], bool]:
        """Send ``request``, wait for its answer: (payload, errors, closed). Raises :class:`ReaderGone`."""
        with self._lock:
            process = self._process
            if self.failure is not None or process is None or os.getpid() != self._owner:
                raise ReaderGone(self.failure or "the reader process is not running")
            code = process.poll()
            if code is not None:
                self._fail(f"ended ({f'signal {-code}' if code < 0 else f'exit code {code}'})")
            assert process.stdin is not None
            payload = marshal.dumps(request)
            try:
                process.stdin.write(HEADER.pack(len(payload)) + payload)
            except (OSError, ValueError) as exc:
                self._fail(f"could not be asked: {exc}")
            answer = self._receive(deadline_s)
            if not (isinstance(answer, tuple) and len(answer) == 5 and answer[1] == request[1]):
                self._fail(f"answered {answer!r} to {request[0]!r}")
            if answer[0] != "ok":
                raise ReaderGone(f"could not {request[0]}: {answer[2]}")  # the reader itself goes on
            return answer[2], list(answer[3]), bool(answer[4])

    def stop(self) -> None:
        """End the reader (closing its stdin ends it; killed if it does not end at once)."""
        process, self._process = self._process, None
        if self.pid is not None:
            host.HIDDEN_PIDS.discard(self.pid)
        if process is None or os.getpid() != self._owner:
            return
        with contextlib.suppress(OSError, ValueError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            process.wait(0.5)
        except subprocess.TimeoutExpired:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(1.0)
        if process.stdout is not None:
            process.stdout.close()

    def _receive(self, deadline_s: float) -> Any:
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        until = now() + deadline_s
        header = self._read(fd, HEADER.size, until, deadline_s)
        return marshal.loads(self._read(fd, HEADER.unpack(header)[0], until, deadline_s))

    def _read(self, fd: int, count: int, until: float, deadline_s: float) -> bytes:
        chunks: list[bytes] = []
        while count:
            left = until - now()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._fail(f"did not answer within {deadline_s:g} s")
            chunk = os.read(fd, count)
            if not chunk:
                self._fail("ended")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def _fail(self, why: str) -> Any:
        self.failure = f"the reader process {why}"
        process = self._process
        if process is not None and os.getpid() == self._owner:
            with contextlib.suppress(OSError):
                process.kill()
        raise ReaderGone(self.failure)


_shared: ReaderProcess | None = None
_shared_lock = threading.Lock()


def shared_reader() -> ReaderProcess | None:
    """This process's reader, started on first use (and again after one that failed); None if it cannot run."""
    global _shared
    with _shared_lock:
        reader = _shared
        if reader is not None and reader.alive:
            return reader
        if reader is not None:
            reader.stop()
        reader = ReaderProcess()
        try:
            reader.start()
        except ReaderGone:
            reader.stop()
            _shared = None
            return None
        _shared = reader
        return reader


def stop_shared_reader() -> None:
    """End this process's reader, if one runs (a later watch starts another)."""
    global _shared
    with _shared_lock:
        reader, _shared = _shared, None
    if reader is not None:
        reader.stop()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has the parent's pipes but not its reader: never use them."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(stop_shared_reader)


class _RemoteSource:
    """What a source read by a :class:`ReaderProcess` does: its reading comes from the reader, and from
    ``local`` (the same source in this process) once the reader cannot answer."""

    def __init__(self, local: Any, reader: ReaderProcess, key: int, name: str, what: str,
                 busy: str | None = None) -> None:
        self._local = local
        self.name = name
        self._log = ErrorLog(name)
        self.errors: list[SourceError] = self._log.errors
        self._reader: ReaderProcess | None = reader
        self._key = key
        self._what = what  # what it reads, for the message when this process takes over ("the host")
        self._busy = busy  # what a hung read names (the sampler's watchdog): "GPU 1"
        self._closed = False
        self.busy_with: str | None = None

    @property
    def remote(self) -> bool:
        """Read by the reader process (False once it failed and this process reads)."""
        return self._reader is not None

    def read(self) -> dict[str, float]:
        reader = self._reader
        if reader is not None:
            self.busy_with = self._busy
            try:
                values, errors, self._closed = reader.read(self._key)
            except ReaderGone as exc:
                self._reader = None
                self._log.record(f"{exc}; {self._what} is read in this process from here")
            else:
                for message in errors:
                    self._log.record(message)
                return dict(values)
            finally:
                self.busy_with = None
        read: dict[str, float] = self._local.read()
        self.errors.extend(error for error in self._local.errors if error not in self.errors)
        return read

    def describe(self) -> Any:
        return self._local.describe()

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(ReaderGone):
                reader.close_source(self._key)
        self._local.close()


class RemoteHostSource(_RemoteSource):
    """The host source read by a :class:`ReaderProcess`: the readings of ``HostSource(pid)``, and that
    source in this process as the fallback (and for the machine facts, read once at the start)."""

    def __init__(self, local: HostSource, reader: ReaderProcess) -> None:
        super().__init__(local, reader, reader.open(local.machine_facts()["pid"]), local.name, "the host")

    def machine_facts(self) -> Any:
        return self._local.machine_facts()


def host_source(reader: str | None = None) -> HostSource | RemoteHostSource:
    """The host source of a watch: read on the sampler's thread, or by the reader process where
    ``reader`` (default :data:`READER_ENV`) says "process" and one can run."""
    local = HostSource()
    if reader_choice(reader) != "process":
        return local
    shared = shared_reader()
    if shared is None:
        return local
    try:
        return RemoteHostSource(local, shared)
    except ReaderGone:
        return local


# The facts that say two GPU sources read the same devices (the others, such as ``lost``, may change).
SAME_DEVICE = ("id", "index", "vendor", "uuid", "name", "is_mig", "gpu_instance_id", "partition_id")


class RemoteGpuSource(_RemoteSource):
    """A GPU source read by a :class:`ReaderProcess`: the reader's twin of ``local`` (the same devices,
    opened there as here), with ``local`` as the fallback and for the facts."""

    def __init__(self, local: GpuSource, reader: ReaderProcess, key: int) -> None:
        label = ", ".join(f"GPU {device.get('index')}" for device in local.describe())
        super().__init__(local, reader, key, local.name, label, busy=label)

    @property
    def closed(self) -> bool:
        return self._closed if self._reader is not None else bool(self._local.closed)

    def processes(self) -> dict[str, list[tuple[int, int | None]]]:
        result: dict[str, list[tuple[int, int | None]]] = self._local.processes()
        return result


def gpu_sources(local: list[GpuSource], gpus: Sequence[int] | None, reader: str | None = None) -> list[GpuSource]:
    """A watch's GPU sources: ``local`` (opened in this process for ``gpus``), each read by the reader
    process where ``reader`` (default :data:`READER_ENV`) says "process" and the reader opens the same
    devices. It does not where this process's driver bindings are not the library's own (a test's fake
    driver, answering here only): then, or if the reader cannot open them, this process reads them."""
    if not local or reader_choice(reader) != "process":
        return local
    shared = shared_reader()
    if shared is None:
        return local
    try:
        opened = shared.open_gpus(gpus)
    except ReaderGone:
        return local

    def same(devices: list[dict[str, Any]], source: GpuSource) -> bool:
        mine = source.describe()
        return len(mine) == len(devices) and all(
            all(theirs.get(name) == ours.get(name) for name in SAME_DEVICE) for theirs, ours in zip(devices, mine))

    if len(opened) != len(local) or not all(same(devices, source) for (_, devices), source in zip(opened, local)):
        for key, _ in opened:
            with contextlib.suppress(ReaderGone):
                shared.close_source(key)
        return local
    return [cast(GpuSource, RemoteGpuSource(source, shared, key)) for source, (key, _) in zip(local, opened)]
