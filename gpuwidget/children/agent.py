"""The child side: gpuwidget's probes in a process the watched code started, streaming to the watch.

A process gets an agent in one of two ways: a fresh interpreter (``subprocess``, ``spawn``,
``forkserver``, torchrun's workers) through the start-up hook (``gpuwidget_children.pth``,
then ``_boot``) right after it imports torch; a process forked by ``multiprocessing`` from
one that has a watch or an agent, through multiprocessing's after-fork registry (see
:func:`register_after_fork`). Either way the agent installs the same
:class:`~gpuwidget.probes.Probes` as a watch, on a :class:`SpanBuffer` of its own, and a
daemon thread sends what they queued every :data:`~gpuwidget.children.protocol.FLUSH_INTERVAL_S`
(``spans``); its workload facts go at exit and when the process group is destroyed
(``facts``). It connects only once it has something to say: a process that never iterates a
DataLoader nor joins a process group sends nothing.

The same thread samples the process's main thread's stack (:class:`~gpuwidget.probes.stack.StackSampler`,
at the watch's interval, :data:`~gpuwidget.children.protocol.INTERVAL_VAR`) against a Trace of its
own that receives the process's spans as they are sent: its ``loop_waits`` and ``stack_samples``
go with its facts, as a watch's own do.

DataLoader worker processes are not training processes: an agent that finds itself in one
(multiprocessing's current process runs torch's ``_worker_loop``, or torch's worker info is
set) removes its probes and stops without sending anything.

If the watch is gone (its socket closed), the agent removes its probes and stops: a process
that outlives the watched cell keeps nothing of gpuwidget's running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any, cast

from gpuwidget.children.protocol import (
    ENV_VAR,
    FLUSH_INTERVAL_S,
    INTERVAL_VAR,
    Identity,
    Progress,
    encode,
    open_kind,
    stack_interval,
)
from gpuwidget.clock import now
from gpuwidget.facts import MainThreadFigures
from gpuwidget.probes import BETWEEN_STEPS_SPAN, DATA_WAIT_SPAN, STEP_SPAN, TRAIN_STEP_SPAN, Probes
from gpuwidget.probes.stack import StackSampler
from gpuwidget.sampler import PromptGil, dithered, set_tick_due
from gpuwidget.sources.schedstat import read_schedstat, schedstat_path
from gpuwidget.trace import Trace

# A send that cannot complete in this long means the watch is stuck: the agent gives up.
SEND_TIMEOUT_S = 10.0
# Spans kept per kind while they wait for the next send (a stalled socket loses the oldest).
MAX_PENDING_SPANS = 100_000
# multiprocessing finalizers run from the highest priority down; any value >= 0 runs at exit.
EXIT_PRIORITY = 50
# The span kinds the stack sampler attributes its samples to (probes.stack).
STACK_SPAN_KINDS = (STEP_SPAN, DATA_WAIT_SPAN, TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN)

_agent: ChildAgent | None = None


class SpanBuffer:
    """The Trace-like sink the probes write into in a child: spans on the shared clock, until sent."""

    start_clock = 0.0  # spans keep absolute clock readings; the watch makes them relative

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple[float, float]]] = {}
        self.dropped = 0

    def add_spans(self, kind: str, intervals: list[tuple[float, float]],
                  attrs: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            pending = self._pending.setdefault(kind, [])
            pending.extend(intervals)
            if len(pending) > MAX_PENDING_SPANS:
                self.dropped += len(pending) - MAX_PENDING_SPANS
                del pending[:len(pending) - MAX_PENDING_SPANS]

    def add_span(self, kind: str, start: float, end: float, attrs: Mapping[str, Any] | None = None) -> None:
        # A step still open when the probes were removed (a loop left early, an iterator left
        # unfinished) travels apart: the watch marks it open, as its own trace does.
        self.add_spans(open_kind(kind) if (attrs or {}).get("open") else kind, [(start, end)])

    def take(self) -> dict[str, list[tuple[float, float]]]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return {kind: spans for kind, spans in pending.items() if spans}


def is_loader_worker() -> bool:
    """This process is one of a DataLoader's worker processes."""
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        target = getattr(mp_process.current_process(), "_target", None)
        if getattr(target, "__module__", "") == "torch.utils.data._utils.worker":
            return True
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and getattr(worker, "_worker_info", None) is not None


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None  # type: ignore[arg-type]
    except ValueError:
        return None


def physical_gpu(cuda_index: int, visible: str | None) -> int | None:
    """The host's GPU number behind CUDA device ``cuda_index`` (CUDA_VISIBLE_DEVICES renumbers them);
    None where CUDA_VISIBLE_DEVICES names GPUs by UUID (the watch matches the device's UUID then)."""
    if not visible:
        return cuda_index
    listed = [item.strip() for item in visible.split(",") if item.strip()]
    if cuda_index < len(listed) and listed[cuda_index].isdigit():
        return int(listed[cuda_index])
    return None


def update_identity(ident: Identity) -> Identity:
    """Fill in rank, world size and GPU as torch.distributed and CUDA know them now (else the launcher's env).

    Known values are kept: after ``destroy_process_group`` the rank is still the one it had.
    """
    env = os.environ
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            ident["rank"], ident["world_size"], ident["distributed"] = dist.get_rank(), dist.get_world_size(), True
    for key, name in (("rank", "RANK"), ("world_size", "WORLD_SIZE"), ("local_rank", "LOCAL_RANK")):
        if ident.get(key) is None:
            ident[key] = _int(env.get(name))  # type: ignore[literal-required]
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
            ident["gpu"] = physical_gpu(index, env.get("CUDA_VISIBLE_DEVICES"))
            ident["gpu_uuid"] = str(torch.cuda.get_device_properties(index).uuid)
    ident.setdefault("gpu", None)
    return ident


def cpu_seconds(live_children: bool) -> dict[str, float]:
    """CPU seconds this process used since it started, all its threads (``process_s``), and its
    child processes' (``workers_s``: its DataLoader workers): those that ended and were waited for
    (the kernel adds them to ours), and with ``live_children`` those still running (one read each)."""
    times = os.times()
    workers = times.children_user + times.children_system
    if live_children:
        with contextlib.suppress(Exception):  # psutil missing or a child gone: the ended ones still count
            import psutil

            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    used = child.cpu_times()
                    workers += used.user + used.system
    return {"process_s": times.user + times.system, "workers_s": workers}


class ChildAgent:
    """The probes of one child process and the connection that carries their data to the watch."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.pid = os.getpid()
        self.buffer = SpanBuffer()
        self.probes = Probes(cast(Trace, self.buffer))
        # The stack sampler reads spans from a Trace: this one gets the spans as they are sent, on the
        # shared clock (start 0), so samples and spans compare as in the watch's own process.
        self.stack_trace = Trace(start_clock=0.0)
        self.stack = StackSampler(self.stack_trace, threading.main_thread().ident)
        self.stack_interval = stack_interval(os.environ.get(INTERVAL_VAR))
        self.identity: Identity = {"pid": self.pid, "ppid": os.getppid(), "rank": None, "local_rank": None,
                                         "world_size": None, "gpu": None, "distributed": False,
                                         "argv": [str(arg)[:200] for arg in sys.argv[:8]]}
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._retired = False
        self._last_progress: tuple[Any, ...] | None = None
        self._started = now()
        self._schedstat = read_schedstat(schedstat_path(self.pid))
        self._destroy: tuple[Any, Any] | None = None  # (torch.distributed, its own destroy_process_group)
        self._held_groups: list[Any] = []  # process groups destroy_process_group() let go of (see _wrap_destroy)

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        self.probes.poll()  # installs at once when torch is imported (always, from the hook)
        self._wrap_destroy()
        self.arm_exit()
        atexit.register(self.finish)
        register_after_fork(self, _after_fork_in_agent)
        self._thread = threading.Thread(target=self._loop, name="gpuwidget-child", daemon=True)
        self._thread.start()

    def arm_exit(self) -> None:
        """Send the facts when a multiprocessing child ends (it leaves by ``os._exit``: no atexit there)."""
        from multiprocessing import util

        util.Finalize(None, self.finish, exitpriority=EXIT_PRIORITY)

    def _loop(self) -> None:
        due = now() + self.stack_interval
        next_flush = now() + FLUSH_INTERVAL_S
        prompt = PromptGil()  # the stack read within a millisecond of its due time (gpuwidget.sampler)
        draw = random.Random()
        following = due + dithered(self.stack_interval, draw)  # never in step with a periodic loop
        while not prompt.wait(self._stop, due):
            try:
                self._sample_stack(due, following)
            finally:
                prompt.restore()
            due = following
            if due < now():  # far behind (the process was stopped, the host overloaded): start again
                due = now() + self.stack_interval
            following = due + dithered(self.stack_interval, draw)
            if now() < next_flush:
                continue
            next_flush = now() + FLUSH_INTERVAL_S
            # A DataLoader's worker; or the watch has ended (its socket is gone): a forkserver or a
            # pool started during the watch outlives it, and so do the processes it starts later.
            if is_loader_worker() or not os.path.exists(self.address):
                self.retire()
                return
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the watch is gone or broken: stop quietly
                self.retire()
                return

    def _sample_stack(self, due: float, following: float) -> None:
        set_tick_due(due, following)
        try:
            self.probes.arm()  # never raises
            self.stack.tick()  # never raises
        finally:
            set_tick_due(None, None)

    def finish(self) -> None:
        """At exit: the last spans and the process's facts (once; nothing from a DataLoader worker)."""
        if self._finished or os.getpid() != self.pid:
            return
        self._finished = True
        try:
            self._finish()
        finally:
            self._held_groups.clear()  # from Python, which lets go of the GIL as a group joins its threads

    def _finish(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(SEND_TIMEOUT_S)
        if self._retired:
            return
        if is_loader_worker():
            self.retire()
            return
        try:
            self.probes.uninstall()  # closes a step still open, queues its span
            self.flush()
            self.send_facts(final=True)
        except Exception:  # noqa: BLE001, S110 - nothing may fail at a process's exit
            pass
        finally:
            self.retire()

    def retire(self) -> None:
        """Remove the probes and the patches, close the connection; the process goes on unwatched."""
        self._retired = True
        self._stop.set()
        with contextlib.suppress(Exception):
            self.probes.uninstall()
        self.stack.close()
        self._unwrap_destroy()
        with self._send_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None

    def forget_after_fork(self) -> None:
        """In a forked child: this copy of the parent's agent records and sends nothing more."""
        self._finished = self._retired = True
        self.probes.detach_after_fork()
        if self._destroy is not None:
            dist, original = self._destroy
            if getattr(dist.destroy_process_group, "__wrapped__", None) is original:
                dist.destroy_process_group = original
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()  # our copy of the descriptor; the parent's connection stays

    # ----------------------------------------------------------------- data

    def identify(self) -> Identity:
        return update_identity(self.identity)

    def progress(self) -> Progress:
        figures = self.probes.progress()
        if figures is None:
            return {}
        steps, samples, wait_s, loop_s = figures
        return {"steps": steps, "samples": samples, "wait_s": wait_s, "loop_s": loop_s}

    def trains(self, progress: Progress) -> bool:
        """Worth reporting: it iterated a DataLoader, or it is a rank of a process group."""
        return bool(progress.get("steps")) or bool(self.identity.get("distributed"))

    def flush(self) -> None:
        """Send the spans queued since the last flush, with the running figures."""
        self.probes.poll()
        spans = self.buffer.take()
        for kind in STACK_SPAN_KINDS:  # open steps (``open_kind``) decide no sample
            if spans.get(kind):
                self.stack_trace.add_spans(kind, spans[kind])
        progress = self.progress()
        identity = self.identify()
        key = (tuple(sorted(progress.items())), identity["rank"], identity["gpu"])
        if not spans and (key == self._last_progress or not self.trains(progress)):
            return
        self._last_progress = key
        self.send({"kind": "spans", "id": identity, "spans": spans, "progress": progress,
                   "dropped_spans": self.buffer.dropped, "cpu": cpu_seconds(live_children=False)})

    def send_facts(self, final: bool) -> None:
        progress = self.progress()
        identity = self.identify()
        if not self.trains(progress):
            return
        main = sys.modules.get("__main__")
        namespace = vars(main) if main is not None else None
        workload = cast(dict[str, Any], self.probes.facts(namespace))
        try:  # (the sampler takes no more samples after: the loop has ended)
            workload["loop_waits"], workload["stack_samples"] = self.stack.facts(namespace)
        except Exception as exc:  # noqa: BLE001 - the facts go without them
            workload.setdefault("probe_errors", []).append(f"loop_waits unavailable (StackSampler): {exc!r}")
        self.send({"kind": "facts", "id": identity, "progress": progress, "final": final,
                   "workload": workload, "host": self.host(),
                   "cpu": cpu_seconds(live_children=True)})

    def host(self) -> MainThreadFigures:
        """The process's main thread over the agent's life: share of wall time on a core and waiting for one."""
        start, end = self._schedstat, read_schedstat(schedstat_path(self.pid))
        wall = now() - self._started
        if start is None or end is None or wall <= 0:
            return {}
        return {"cpu_fraction": (end[0] - start[0]) / wall, "run_delay_fraction": (end[1] - start[1]) / wall,
                "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}

    def send(self, message: Mapping[str, object]) -> None:
        data = encode(message)
        with self._send_lock:
            if self._retired:
                return
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(SEND_TIMEOUT_S)
                try:
                    sock.connect(self.address)
                except OSError:
                    sock.close()
                    raise
                self._sock = sock
            self._sock.sendall(data)

    # ----------------------------------------------------------------- torch.distributed

    def _wrap_destroy(self) -> None:
        """Send the facts just before the process group goes: DDP's model and its logging data live until then.

        The groups it destroys are also held until the process's exit hook (:meth:`finish`). With torch
        2.13, a DDP model freed after ``destroy_process_group()`` holds the group's last reference, and
        freeing it joins gloo's worker threads with the GIL held, while such a thread, freeing an
        all-reduce whose thread state holds a Python object (each ``backward()`` leaves one), waits
        for the GIL: the rank hangs at its exit, now and then (1 run in 4 beside a busy core here,
        gpuwidget or not). Let go of from Python instead, at exit, a group releases the GIL first.
        """
        dist = sys.modules.get("torch.distributed")
        original = getattr(dist, "destroy_process_group", None)
        if dist is None or original is None or self._destroy is not None:
            return
        agent = self

        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if os.getpid() != agent.pid or agent._retired:
                return original(*args, **kwargs)
            with contextlib.suppress(Exception):
                agent.identify()
                agent.flush()
                agent.send_facts(final=False)
            groups = live_groups(dist)
            result = original(*args, **kwargs)
            agent._held_groups.extend(groups)
            return result

        destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        dist.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
        self._destroy = (dist, original)

    def _unwrap_destroy(self) -> None:
        if self._destroy is None:
            return
        dist, original = self._destroy
        if getattr(dist.destroy_process_group, "__wrapped__", None) is original:
            dist.destroy_process_group = original
        self._destroy = None


def live_groups(dist: Any) -> list[Any]:
    """The process groups torch.distributed holds now (its Python objects; [] where it holds none or its
    private registry has moved)."""
    try:
        return list(dist.distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - a torch without that registry: nothing held, as before
        return []


def register_after_fork(owner: Any, hook: Any) -> None:
    """Run ``hook(owner)`` in every child multiprocessing forks from this process, for as long as ``owner`` lives.

    multiprocessing runs these after it has cleared the child's inherited finalizers, so an exit
    hook registered from there stays; its registry holds ``owner`` weakly (nothing outlives it).
    """
    from multiprocessing import util

    util.register_after_fork(owner, hook)


def unregister_after_fork(owner: Any) -> None:
    from multiprocessing import util

    registry = util._afterfork_registry  # type: ignore[attr-defined]
    for key in [key for key, value in list(registry.items()) if value is owner]:
        registry.pop(key, None)


def start_from_env() -> ChildAgent | None:
    """Start this process's agent if a watch's address is in the environment (once per process)."""
    global _agent
    address = os.environ.get(ENV_VAR)
    if not address or (_agent is not None and _agent.pid == os.getpid()):
        return _agent
    agent = ChildAgent(address)
    _agent = agent
    if is_loader_worker():
        return agent  # never started: a worker records nothing
    agent.start()
    return agent


def _after_fork_in_agent(agent: ChildAgent) -> None:
    """multiprocessing's after-fork hook of an agent's process, in the child (or the agent's own
    process, for a spawned one: multiprocessing runs the hooks when its child starts)."""
    if agent.pid == os.getpid():
        if is_loader_worker():
            agent.retire()
        elif not agent._finished:
            agent.arm_exit()  # multiprocessing cleared the finalizers registered before it started
        return
    agent.forget_after_fork()
    start_in_forked_child()


def start_in_forked_child() -> None:
    """A multiprocessing child forked from a watched process: its own agent, unless it is a DataLoader worker."""
    global _agent
    if _agent is not None and _agent.pid != os.getpid():
        _agent.forget_after_fork()
        _agent = None
    if is_loader_worker():
        return
    with contextlib.suppress(Exception):  # never break the user's child
        start_from_env()
