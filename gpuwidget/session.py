"""One watch from start to finish: sources, sampler, live view, and the Run it leaves behind.

Both ``%%gpuwatch`` and ``gpuwidget.watch()`` go through :class:`Watch`, so they behave
the same: options are checked before anything starts, and whatever the watched code
does (returns, raises, is interrupted), the sampler thread, the probes and the live view
are gone afterwards and the Run is recorded.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuwidget.advice.advisor import advise
from gpuwidget.clock import now
from gpuwidget.facts import MachineFacts
from gpuwidget.figures.summary import summarize
from gpuwidget.kernelstatus import StatusWriter
from gpuwidget.options import OptionError, WatchOptions, make_options
from gpuwidget.probes import Probes, WatchedObjects
from gpuwidget.probes.origin import notebook_cell
from gpuwidget.run import Run, RunError
from gpuwidget.sampler import Sampler
from gpuwidget.sources.base import Source
from gpuwidget.sources.gpu import NO_GPU, GpuSource, open_gpu_sources
from gpuwidget.sources.reader import gpu_sources as reader_gpu_sources
from gpuwidget.sources.reader import host_source, reader_choice
from gpuwidget.trace import Trace

log = logging.getLogger("gpuwidget")

_last_run: Run | None = None
# The last run of each watched cell (cell_key: the notebook cell's id, or the `with` statement's place
# in a file), oldest first: "since the previous run of this cell" compares only runs of one cell.
_runs_by_source: dict[str, Run] = {}
RUNS_BY_SOURCE = 32
_active_lock = threading.Lock()
_active: Watch | None = None

# A source whose read hung is closed on a thread of this name (its close can hang as well).
CLOSER_THREAD_NAME = "gpuwidget-closer"
# Each GPU vendor's driver gets this long to start (init, listing the GPUs): it answers in tens of ms,
# but a driver stuck on a GPU that fell off the bus may never answer, and then the watch goes on with
# host metrics rather than hold the cell (gpuwidget.sources.gpu.open_gpu_sources).
GPU_START_DEADLINE_S = 5.0


def last_run() -> Run:
    """The Run of the most recent watched cell or ``watch()`` block."""
    if _last_run is None:
        raise LookupError("no watched run yet: run a cell with %%gpuwatch or use gpuwidget.watch()")
    return _last_run


def _gpu_source(options: WatchOptions) -> tuple[list[GpuSource], MachineFacts]:
    """One source per chosen GPU (any vendor: gpuwidget.sources.gpu) and the machine facts they report.

    A missing driver is not an error (gpuwidget works on any laptop); asking for a GPU
    that does not exist is, and is raised before anything starts, with or without a driver.
    """
    opened = open_gpu_sources(options.gpus, deadline_s=GPU_START_DEADLINE_S)
    if opened.missing:
        count = opened.visible_count
        visible = f"GPUs 0-{count - 1}" if count > 1 else ("GPU 0" if count == 1 else "none")
        raise OptionError(f"--gpus: there is no GPU {opened.missing[0]} here (visible: {visible})")
    if not opened.found:
        return _no_gpu(options, opened.message or NO_GPU)
    return list(opened.sources), {"gpus": opened.devices(), "gpu_message": None}


def _reader() -> str:
    """Where the sources are read (gpuwidget.sources.reader's ``GPUWIDGET_READER``), checked before anything starts."""
    try:
        return reader_choice()
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def _no_gpu(options: WatchOptions, reason: str) -> tuple[list[GpuSource], MachineFacts]:
    """Host metrics only; but asking for a GPU is an error, as it is when GPUs exist."""
    if options.gpus is not None:
        raise OptionError(f"--gpus: there is no GPU {options.gpus[0]} here ({reason})")
    return [], {"gpus": [], "gpu_message": reason}


def _watch_children(trace: Trace, probes: Probes, machine: MachineFacts) -> Any:
    """The child channel (gpuwidget.children); None if it cannot start: the watch goes on without children."""
    try:
        from gpuwidget.children import ChildWatch

        return ChildWatch(trace, probes, machine)
    except Exception as exc:  # noqa: BLE001
        log.warning("gpuwidget: child processes will not be watched: %s", exc)
        return None


def _in_notebook() -> bool:
    """True when a Jupyter kernel is running us (widgets can be shown)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Watch:
    """Orchestrates one watched block. Use :meth:`start` then :meth:`finish` exactly once."""

    def __init__(self, options: WatchOptions, *, label: str = "", display: bool | None = None,
                 namespace: Any = None, source: str | None = None) -> None:
        self.options = options
        self.label = label
        # What identifies "the same cell" run again (cell_key), for before -> after; None: compared with nothing.
        self.source = source
        # Where the user's names live (to call their loader `train_loader` in suggestions):
        # a mapping, or a callable returning one when the run ends.
        self.namespace = namespace
        self.display = (not options.quiet) if display is None else (display and not options.quiet)
        self.run: Run | None = None
        self._sampler: Sampler | None = None
        self._sources: list[Source] = []
        self._live: Any = None
        self._handle: Any = None
        self._probes: Probes | None = None
        self._children: Any = None  # gpuwidget.children.ChildWatch: processes the watched code starts
        self._objects: WatchedObjects = {}
        self._started = 0.0
        self._status: StatusWriter | None = None
        self._outputs: Any = None  # ui.outputs.CellOutputs: what the cell itself sends, while the live view shows

    def start(self) -> Run:
        global _active
        try:  # from before the kernel is marked busy: an interrupt anywhere after still frees it
            with _active_lock:
                if _active is not None:
                    raise OptionError("another watch is already running in this kernel; nested watches "
                                      "are not supported")
                reader = _reader()
                gpu_sources, gpu_facts = _gpu_source(self.options)
                _active = self
            trace = Trace()
            host = host_source(reader)
            gpu_sources = reader_gpu_sources(gpu_sources, self.options.gpus, reader)
            machine: MachineFacts = {**host.machine_facts(), **gpu_facts}
            trace.meta.update({"label": self.label, "interval": self.options.interval})
            self.run = Run(trace=trace, machine=machine, options=self.options, label=self.label)
            self._sources = [host, *gpu_sources]
            self._probes = Probes(trace)
            listeners: list[Any] = [self._probes.poll]
            # The server's /metrics reads this kernel's watch status from a small private file.
            self._status = StatusWriter.for_kernel(self.label, self._probes.progress)
            if self._status is not None:
                self._status.started()
                listeners.append(self._status.on_tick)
            if self.display and self.options.live and _in_notebook():
                self._show_live(trace, machine)
                if self._live is not None:
                    listeners.append(self._live.on_tick)
                    self._record_outputs()
            self._sampler = Sampler(self._sources, trace, self.options.interval, listeners,
                                    first=[self._probes.sample])
            self._started = now()
            trace.start_clock = self._started
            self._children = _watch_children(trace, self._probes, machine)
            self._probes.poll()
            self._sampler.start()
        except BaseException:
            self._teardown()
            raise
        return self.run

    def _show_live(self, trace: Trace, machine: MachineFacts) -> None:
        try:
            from gpuwidget.ui.views import show_live_view

            self._live = show_live_view(self.options.view, trace, machine, label=self.label)
            self._handle = self._live.handle if self._live is not None else None
        except Exception as exc:  # noqa: BLE001 - no live view is better than a broken cell
            log.warning("gpuwidget: live view unavailable: %s", exc)
            self._live = None

    def _record_outputs(self) -> None:
        try:
            from IPython import get_ipython

            from gpuwidget.ui.outputs import CellOutputs

            outputs = CellOutputs(get_ipython())
            self._outputs = outputs if outputs.install() else None
        except Exception as exc:  # noqa: BLE001 - the panel then goes below an emptied live view
            log.warning("gpuwidget: the cell's outputs are not recorded: %s", exc)
            self._outputs = None

    def finish(self, error: BaseException | None = None) -> Run:
        """Stop everything, summarise, record and show the run. Never raises."""
        global _last_run
        run = self.run
        assert run is not None, "finish() before start()"
        duration = now() - self._started
        interrupt = self._teardown()
        try:
            # As data: the exception's traceback would keep the cell's frames (its tensors,
            # its DataLoader iterators and their workers) alive as long as the Run.
            run.error = None if error is None else RunError.from_exception(error)
            run.finished = True
            run.trace.meta["duration_s"] = duration
            if self._probes is not None:
                namespace = self._user_namespace()
                run.workload = self._probes.facts(namespace)
                self._objects = self._probes.objects()
                run.subjects = _subjects(self._objects, namespace, run.workload)
            if self._children is not None:
                run.workload = self._children.workload(run.workload)
            run.summary = summarize(run.trace, run.workload, duration_s=duration, machine=run.machine,
                                    price=self.options.price)
            if self._children is not None:
                run.summary = self._children.summary(run.summary, run.workload)
            if self.options.advice:
                run.findings = advise(run.summary, run.workload, run.machine)
                run.adopt_findings()
            if self._sampler is not None:
                stats = self._sampler.stats
                run.sampler = {"ticks": stats.ticks, "missed_ticks": stats.missed_ticks,
                               "cpu_time_s": stats.cpu_time_s, "part_cpu_s": dict(stats.part_cpu_s),
                               "errors": stats.errors[-10:],
                               "stalled": list(stats.stalled),
                               "source_errors": [e.to_dict() for s in self._sources for e in s.errors][-20:]}
        except Exception as exc:  # noqa: BLE001
            log.warning("gpuwidget: could not summarise the run: %s", exc)
        _last_run = run
        _remember(self.source, run)
        if self._status is not None:
            self._status.finished(dict(run.summary or {}), run.findings[0].rule if run.findings else None)
        self._save(run)
        self._show_result(run)
        if self.options.tune and error is None and interrupt is None:
            self._tune(run)
        if interrupt is not None and error is None:
            # Ctrl-C while a finished cell wound down: everything is released, now honour it. After
            # the cell's own exception it is not raised: that one goes on to the user, alone.
            raise interrupt
        return run

    def _tune(self, run: Run) -> None:
        """--tune: right after the run, the tuner on the cell's loader and every finding's change measured
        in the cell's own step, then the best set together (gpuwidget.measure.plan)."""
        from gpuwidget.measure.plan import plan_budget

        budget = plan_budget(run)
        if not budget:
            if self.display and _in_ipython():
                _show_text("gpuwidget --tune: no DataLoader fed this cell and no finding has a change a training "
                           "step can try: nothing to measure.")
            return
        try:
            from gpuwidget.measure.plan import measure_findings
            from gpuwidget.ui.progress import tuning_progress

            with tuning_progress(budget, self.display and _in_notebook()) as bar:
                run.measured = measure_findings(run, budget, progress=getattr(bar, "line", None), tuner_progress=bar)
            run.tuning = run.measured.tuning
        except Exception as exc:  # noqa: BLE001 - the run itself is recorded and shown already
            log.warning("gpuwidget --tune: %s", exc)
            if self.display and _in_ipython():
                _show_text(f"gpuwidget --tune: could not measure: {exc}")
            return
        if self.display and _in_ipython():
            from IPython.display import display

            display(run.measured)

    def _user_namespace(self) -> Any:
        namespace = self.namespace() if callable(self.namespace) else self.namespace
        return namespace if namespace is not None else {}

    def _teardown(self) -> BaseException | None:
        """Remove the probes, stop the sampler, close sources and the live view; safe to call twice.

        Every step runs even if one fails or is interrupted (a second Ctrl-C while the cell
        winds down), and the kernel is free for the next watch whatever happens here. An
        interrupt is returned, not raised, so the caller records the run before honouring it.
        """
        interrupt: BaseException | None = None
        try:
            with _interrupts_held() as held:  # a Ctrl-C now is honoured once every step has run
                for step in (self._remove_probes, self._close_children, self._stop_sampler, self._close_sources,
                             self._stop_recording, self._close_live):
                    try:
                        step()
                    except Exception as exc:  # noqa: BLE001 - the user's cell has ended; nothing may raise into it
                        log.warning("gpuwidget: %s failed: %s", step.__name__.strip("_").replace("_", " "), exc)
                    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt: finish the other steps first
                        interrupt = interrupt or exc
        finally:
            _release(self)
        return interrupt or (held[0] if held else None)

    def _remove_probes(self) -> None:
        if self._probes is not None:
            self._probes.uninstall()

    def _close_children(self) -> None:
        if self._children is not None:
            self._children.close()

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()

    def _close_sources(self) -> None:
        """Close the sources; one whose read hung is closed on a thread of its own, as its close may hang too."""
        hung = self._sampler.busy_sources if self._sampler is not None else []
        for source in self._sources:
            if any(source is stuck for stuck in hung):
                threading.Thread(target=_close_quietly, args=(source,), name=CLOSER_THREAD_NAME,
                                 daemon=True).start()
            else:
                _close_quietly(source)

    def _stop_recording(self) -> None:
        if self._outputs is not None:
            self._outputs.remove()

    def _close_live(self) -> None:
        if self._live is not None:
            self._live.close()
            from gpuwidget.ui.live import retire_bokehjs_loader

            retire_bokehjs_loader()

    def _save(self, run: Run) -> None:
        if not self.options.save:
            return
        try:
            run.save(self.options.save)
        except Exception as exc:  # noqa: BLE001 - the run is still in last_run()
            log.warning("gpuwidget: could not save the run to %s: %s", self.options.save, exc)

    def _show_result(self, run: Run) -> None:
        if not self.display:
            return
        try:
            # What the cell printed goes out first: the panel comes after it, as output does.
            _flush_streams()
            from gpuwidget.ui.outputs import end_live_view

            # The live view's output becomes the panel (no widget without saved state stays in the
            # notebook to show an error, and no emptied output either), after what the cell printed.
            if self._outputs is None or not end_live_view(self._outputs, self._handle, run._repr_mimebundle_()):
                if self._handle is not None:
                    self._handle.update({"text/plain": ""}, raw=True)
                if _in_ipython():
                    from IPython.display import display

                    display(run)
            self._offer_measurement(run)
        except Exception as exc:  # noqa: BLE001
            log.warning("gpuwidget: could not show the run: %s", exc)

    def _offer_measurement(self, run: Run) -> None:
        """Under findings whose change a step can try, a button that measures them all (clicks run after
        the cell): a loader finding's settings on the cell's loader, the others in its training step."""
        loaders = self._objects.get("loaders") or []
        wants_workers = bool(loaders) and any("num_workers" in f.change for f in run.findings)
        trainable = run.subjects is not None and run.subjects.batch is not None and any(
            f.trial_changes() for f in run.findings)
        if self.options.tune or not (wants_workers or trainable) or not _in_notebook():
            return
        from IPython.display import display

        from gpuwidget.ui.actions import measure_button

        display(measure_button(run, loaders[0] if loaders else None))


def _subjects(objects: WatchedObjects, namespace: Any, workload: Any) -> Any:
    """What Run.measure will run on (gpuwidget.measure.subjects); None if it cannot be kept."""
    try:
        from gpuwidget.measure.subjects import Subjects

        return Subjects.from_watch(objects, namespace, workload.get("training"))
    except Exception as exc:  # noqa: BLE001 - the run is recorded without it; measure says why
        log.warning("gpuwidget: nothing kept to measure changes on: %s", exc)
        return None


@contextmanager
def _interrupts_held() -> Iterator[list[BaseException]]:
    """Ctrl-C while the watch winds down is held until the end, then honoured (the list gets what it raised).

    An interrupt in the middle of a step (stopping the sampler while a GPU read hangs) would skip
    the rest of it, and closing a source a thread is still reading then waits on that read: the cell
    would never end. Teardown is bounded (:data:`gpuwidget.sampler.STOP_DEADLINE_S`), so holding
    the interrupt costs at most that. With Python's own handler (IPython kernels, scripts) it becomes
    the KeyboardInterrupt, and a second Ctrl-C in the same teardown raises at once; a handler of the
    caller's own (gpuwatch's, which forwards it to the command) is called with it afterwards.
    Only the main thread receives signals; elsewhere nothing is held.
    """
    raised: list[BaseException] = []
    pending: list[tuple[int, Any]] = []
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):  # not the main thread, or a handler Python did not install
        yield raised
        return
    default = previous is signal.default_int_handler

    def hold(signum: int, frame: Any) -> None:
        if pending and default:
            raise KeyboardInterrupt
        pending.append((signum, frame))

    signal.signal(signal.SIGINT, hold)
    try:
        yield raised
    finally:
        signal.signal(signal.SIGINT, previous)
        for signum, frame in pending[:1] if default else pending:
            try:
                previous(signum, frame)
            except BaseException as exc:  # noqa: BLE001 - returned, raised once the run is recorded
                raised.append(exc)


def _release(watch: Watch) -> None:
    """Mark the kernel free for the next watch (if ``watch`` holds it)."""
    global _active
    with _active_lock:
        if _active is watch:
            _active = None


def _close_quietly(source: Source) -> None:
    try:
        source.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("gpuwidget: closing %s failed: %s", getattr(source, "name", source), exc)


def _flush_streams() -> None:
    """Send buffered stdout/stderr (ipykernel buffers them; display messages go out at once)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S112 - a closed or replaced stream has nothing to send
            continue


def _show_text(text: str) -> None:
    from IPython.display import display

    display({"text/plain": text}, raw=True)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def running_cell_id() -> str | None:
    """The id of the notebook cell IPython is running (``ExecutionInfo.cell_id``: the front-end's
    ``cellId``, which JupyterLab and Notebook 7 send), or None (a console, nbclient, a script)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    info = getattr(get_ipython(), "_gpuwidget_cell_info", None)  # magic.record_cell_info keeps it
    cell_id = getattr(info, "cell_id", None)
    return cell_id if isinstance(cell_id, str) and cell_id else None


def cell_key(cell_id: str | None, place: str = "") -> str | None:
    """What makes two watched runs runs of the same cell: the cell's id, with the ``with`` statement's
    place inside it for ``watch()``. None without an id: identical text in two cells (or typed twice in
    a console) is no sign of the same cell, so such a run is compared with nothing."""
    return None if cell_id is None else f"cell {cell_id}" + (f" at {place}" if place else "")


def loader_identity(run: Run) -> tuple[Any, ...] | None:
    """The loop's data: its dataset's name, class and length. A loader rebuilt with other settings over
    the same data (the change a finding suggests, under the same name or another) is the same; a loader
    over another dataset is not. None without a loader."""
    from gpuwidget.figures.summary import primary_loader

    loader = primary_loader(run.workload)
    if loader is None:
        return None
    settings = loader.get("settings") or {}
    return (loader.get("dataset_name"), settings.get("dataset_type"), settings.get("dataset_len"))


def comparable(before: Run, after: Run) -> bool:
    """Two runs of one cell may be compared: they trained on the same data (:func:`loader_identity`)."""
    return loader_identity(before) == loader_identity(after)


def _remember(source: str | None, run: Run) -> None:
    """Link ``run`` to the last finished run of the same cell (:func:`cell_key`) where it trained on the
    same data (:func:`comparable`), and keep it as that cell's last."""
    if source is None or not run.finished:
        return
    previous = _runs_by_source.pop(source, None)
    if previous is not None:
        previous.previous = None  # one step back only: a long session keeps no chain of runs
        if comparable(previous, run):
            run.previous = previous
    _runs_by_source[source] = run
    while len(_runs_by_source) > RUNS_BY_SOURCE:
        _runs_by_source.pop(next(iter(_runs_by_source)))


@contextmanager
def watch(*, label: str = "", display: bool | None = None, **options: Any) -> Iterator[Run]:
    """Watch a block of code; yields its :class:`Run` (summary filled in when the block ends).

    Takes the same options as ``%%gpuwatch``: ``interval``, ``gpus``, ``view``
    (``"auto"``, ``"bokeh"``, ``"static"``, ``"none"``; ``live=False`` is ``view="none"``),
    ``advice``, ``tune``, ``budget`` (seconds for ``tune`` and Measure), ``save``, ``quiet``, ``price``
    (per GPU-hour: the run's cost and idle cost).
    Bad options raise ``ValueError`` before anything starts.
    """
    caller = sys._getframe(2)  # the `with` statement's frame (1 is contextlib's __enter__)
    # The same `with` statement run again is the same cell: its line in a file, or in a notebook
    # cell (whose file IPython names after its text, the same for two cells of the same text) that
    # line in the cell of the same id.
    code = caller.f_code
    place = f"{code.co_filename}:{code.co_firstlineno}:{caller.f_lineno}"
    source = cell_key(running_cell_id(), place) if notebook_cell(code.co_filename) is not None else place
    session = Watch(make_options(**options), label=label, display=display,
                    namespace=lambda: {**caller.f_globals, **caller.f_locals}, source=source)
    run = session.start()
    try:
        yield run
    except BaseException as exc:
        session.finish(exc)
        raise
    session.finish(None)
