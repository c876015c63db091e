"""The DataLoader tuner: measure candidate settings on the user's own loader and pick the cheapest
one that feeds the training loop with margin.

Each candidate is a new DataLoader over the same dataset, sampler and collate function
(the user's loader is never modified). After a warm-up (worker start-up, first prefetch)
a few batches are timed; the candidate's rate is batches per second. With a finding's
suggestion (``suggestion={"num_workers": 5, ...}``, what the panel's Measure continues) the
tuner times the loader as it is, the suggested count, then its neighbours (5, 4, 6), and says how
the suggestion fared; without one it searches the number of workers upwards until more stops
helping, within a time budget. The choice is the *fewest* workers whose rate reaches the target
(the rate at which the cell's loop consumed batches when data was ready) times :data:`MARGIN`,
not simply the fastest: each worker costs memory and a core. Before the first trial it says how
long the plan will take (:func:`plan_seconds`, from the loader's measured time per batch).
"""

from __future__ import annotations

import contextlib
import html
import math
import multiprocessing
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import psutil

from gpuwidget.advice.code import loader_code
from gpuwidget.advice.loader import diagnose, production_time
from gpuwidget.clock import now
from gpuwidget.facts import LoaderChange, LoaderFacts, WorkloadFacts
from gpuwidget.figures.summary import primary_loader
from gpuwidget.measure.interrupts import keeping_interrupts, raise_if_interrupted
from gpuwidget.measure.rng import preserved_rng
from gpuwidget.probes.constructor import rebuild_loader
from gpuwidget.probes.torch_data import loader_kwargs, loader_settings
from gpuwidget.report import code_html, fmt_count, fmt_seconds, fmt_speedup, html_table, scoped_css, text_table
from gpuwidget.sources.host import usable_cpu_count

# Pick a setting whose rate is at least this multiple of the loop's consumption rate.
MARGIN = 1.2
# Adding workers "stops helping" when the rate improves by less than this.
MIN_GAIN = 0.05
# Batches timed per candidate after its warm-up, and the warm-up per worker.
MEASURE_BATCHES = 12
WARMUP_BATCHES_PER_WORKER = 2
# Workers tried at most (each holds a copy of the dataset object and a process).
MAX_WORKERS = 32
DEFAULT_BUDGET_S = 20.0
# The settings a suggestion is timed with (persistent_workers only matters from the second epoch,
# which a trial never reaches: it is recommended with the choice, untimed).
TIMED_KEYS = ("num_workers", "prefetch_factor", "pin_memory")
# What a trial costs beyond its batches: building the loader and reading the process tree (TRIAL_S),
# and, with workers, their pool and queues (POOL_S) and each worker started, fed its first indices
# and joined at the end (TRIAL_WORKER_S). Fitted to trials of a sleeping dataset on the 2-vCPU test VM
# beside other busy processes: 0.04-0.05 s without workers, 0.16-0.26 s with 1-2, 0.27 s with 4,
# 0.44-0.51 s with 6, 0.55-0.66 s with 8 (the advice's start-up figure, advice.loader.WORKER_START_S,
# is an idle host's iter() to the first batch alone).
TRIAL_S = 0.04
POOL_S = 0.08
TRIAL_WORKER_S = 0.06
# What the announced time may be off by: a trial's batches come at the measured rate on a host
# whose other processes come and go (the test holds the tuner to it).
ESTIMATE_MARGIN = 0.5


class TuneError(RuntimeError):
    """The tuner cannot measure this loader; the message says why."""


class DatasetItemError(RuntimeError):
    """Raised in place of an exception from the dataset, naming the item that failed."""


class _IndexedDataset:
    """Wraps a map-style dataset so an exception names the item index (picklable for workers)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            raise DatasetItemError(f"the dataset raised at item {index!r}: {type(exc).__name__}: {exc}") from exc

    def __getitems__(self, indices: list[Any]) -> Any:
        return [self[i] for i in indices]


@dataclass
class Trial:
    """One candidate setting and what it measured."""

    change: LoaderChange
    batches_per_s: float = 0.0
    first_batch_s: float = 0.0
    cpu_percent: float = 0.0  # process tree, percent of one core, while timed
    memory_bytes: float = 0.0  # process tree resident memory at the end of the timing
    error: str | None = None
    suggested: bool = False  # the finding's own suggestion (TunePlan.suggested)
    seconds: float = 0.0  # the whole trial: workers started and stopped, every batch taken

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.change.items()) or "as it is"

    @property
    def workers(self) -> int | None:
        return self.change.get("num_workers")


@dataclass
class TuneResult:
    """What the tuner measured and chose; renders as a table, builds the chosen loader."""

    original: Any
    name: str
    trials: list[Trial]
    chosen: Trial
    target_rate: float | None
    budget_s: float
    elapsed_s: float
    facts: LoaderFacts = field(default_factory=LoaderFacts)  # the loader as the code line names it
    # Settings recommended without being timed (they do not change the steady rate).
    extra: LoaderChange = field(default_factory=lambda: LoaderChange())
    # The watched run's workload, for the code's framework names (trainer, accelerator).
    workload: WorkloadFacts = field(default_factory=WorkloadFacts)
    # The seconds announced before the first trial (TunePlan.estimate_s; None: a search within the budget).
    announced_s: float | None = None
    # The suggested worker count where the budget ended before it was timed (None: timed, or none suggested).
    untimed_suggestion: int | None = None

    @property
    def change(self) -> LoaderChange:
        return {**self.chosen.change, **self.extra}

    @property
    def code(self) -> str:
        if not self.change:
            return f"# {self.name} as it is was the fastest of the settings timed: nothing to change."
        return loader_code(self.facts, self.change, self.workload)

    @property
    def baseline(self) -> Trial | None:
        return next((t for t in self.trials if not t.change), None)

    @property
    def suggested(self) -> Trial | None:
        """The trial of the finding's own suggestion, where one was given."""
        return next((t for t in self.trials if t.suggested), None)

    def speedup_of(self, trial: Trial) -> float | None:
        """``trial``'s rate over the loader's own as it was (if both were measured)."""
        base = self.baseline
        if base is None or not base.batches_per_s or trial.error:
            return None
        return trial.batches_per_s / base.batches_per_s

    @property
    def speedup(self) -> float | None:
        """Chosen rate over the loader's own rate as it was (if it was measured)."""
        return self.speedup_of(self.chosen)

    def loader(self) -> Any:
        """A new loader of the original's own class with the chosen settings over the same data (the
        original is untouched); ``TypeError`` when that class's constructor cannot take them (the
        ``.code`` then says what to add where the loader is built)."""
        return rebuild_loader(self.original, self.change, self.facts.get("built_at"))

    def _rows(self) -> list[list[str]]:
        """A row per trial, the loader as it is first, then by worker count (the order read, whatever the
        order timed: the suggestion is timed before its neighbours)."""
        rows = []
        for trial in sorted(self.trials, key=lambda t: (bool(t.change), t.change.get("num_workers", -1),
                                                        t.change.get("prefetch_factor", 0))):
            notes = [note for note, on in (("suggested", trial.suggested), ("chosen", trial is self.chosen)) if on]
            rate = "failed" if trial.error else f"{trial.batches_per_s:.1f}"
            gain = self.speedup_of(trial)
            rows.append([trial.label, rate, "-" if gain is None else fmt_speedup(gain), f"{trial.cpu_percent:.0f}%",
                         f"{trial.memory_bytes / 2**20:,.0f} MB", fmt_seconds(trial.first_batch_s), ", ".join(notes)])
        return rows

    def verdict(self) -> str:
        """The result in one line, against the suggestion where there was one: "num_workers=5: 57.7 batches/s,
        1.52x the loader as it is; the suggested 5 confirmed", "num_workers=4 was faster than the suggested 5
        (57.7 against 38.0 batches/s)". The setting it names is a row of the table, as labelled there."""
        chosen = self.chosen
        measured = f"{chosen.label}: {chosen.batches_per_s:.1f} batches/s" + (
            f", {fmt_speedup(self.speedup)} the loader as it is" if self.speedup and chosen.change else "")
        suggested = self.suggested
        if suggested is None and self.untimed_suggestion is not None:
            return (f"Chosen for {self.name}: {measured}; the suggested {self.untimed_suggestion} was not timed "
                    f"within the budget of {fmt_seconds(self.budget_s)}")
        if suggested is None or suggested.workers is None:
            return f"Chosen for {self.name}: {measured}"
        told = f"the suggested {suggested.workers}"
        if chosen is suggested:
            return f"{measured}; {told} confirmed"
        if suggested.error:
            return f"{measured}; {told} failed ({suggested.error})"
        against = f"{chosen.batches_per_s:.1f} against {suggested.batches_per_s:.1f} batches/s"
        if not chosen.change:
            return (f"The loader as it is was the fastest: none of the settings timed beat it ({told}: "
                    f"{suggested.batches_per_s:.1f} batches/s against {chosen.batches_per_s:.1f})")
        fewer = suggested.workers - (chosen.workers or 0)
        if (self.target_rate and fewer > 0 and suggested.batches_per_s >= MARGIN * self.target_rate
                and chosen.batches_per_s >= MARGIN * self.target_rate):
            return (f"{measured}; {chosen.workers} feed the loop as well as {told} (the loop takes "
                    f"{self.target_rate:.1f} batches/s), with {fmt_count(fewer, 'worker')} fewer")
        return f"{measured}; {chosen.workers} was faster than {told} ({against})"

    def _summary(self) -> str:
        target = f"The loop consumed {self.target_rate:.1f} batches/s" if self.target_rate else "No target rate"
        extra = "".join(f", {k}={v!r}" for k, v in self.extra.items())
        also = f"; with it {extra[2:]} (kept between epochs, not timed)" if extra else ""
        announced = (f" (announced: about {fmt_seconds(self.announced_s)})" if self.announced_s is not None
                     else f" (within the budget of {fmt_seconds(self.budget_s)})")
        return (f"{self.verdict()}{also}. {target}; {fmt_count(len(self.trials), 'setting')} timed in "
                f"{fmt_seconds(self.elapsed_s)}{announced}.")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        headers = ["setting", "batches/s", "vs as it is", "CPU", "memory", "first batch", ""]
        rows = self._rows()
        lines = [self._summary(), "", *text_table(headers, rows), "", self.code]
        style, scope = scoped_css("measure")
        page = (f"{style}<div class='gpuwidget-tune' {scope} style='font-size:13px'>"
                f"<div class='gpuwidget-verdict' style='margin-bottom:4px'>{html.escape(self._summary())}</div>"
                f"{html_table(headers, rows, [row[-1].endswith('chosen') for row in rows])}"
                f"{code_html(self.code, 'Chosen setting')}</div>")
        return {"text/plain": "\n".join(lines), "text/html": page}


@dataclass(frozen=True)
class TunePlan:
    """The settings a tuning times, in order (the loader as it is first), and how long they take."""

    changes: list[LoaderChange]
    suggested: LoaderChange | None = None  # the one of ``changes`` a finding suggested
    estimate_s: float | None = None  # None: a search, bounded only by the budget


def suggestion_plan(workers_now: int, suggestion: LoaderChange, cap: int) -> TunePlan:
    """The loader as it is, the suggested worker count, then its neighbours (5 -> 5, 4, 6), each with the
    suggestion's other timed settings; a count equal to the loader's own is the loader as it is. The
    suggestion comes right after the loader as it is: where the budget ends before the plan does (a busy
    host), what is left out is a neighbour, never the setting the panel suggested."""
    given: dict[str, object] = dict(suggestion)
    timed = {key: given[key] for key in TIMED_KEYS if key in given and key != "num_workers"}
    count = int(suggestion["num_workers"])

    def change_for(workers: int) -> LoaderChange:
        # prefetch_factor needs worker processes (DataLoader refuses it with none).
        change = cast(LoaderChange, {"num_workers": workers,
                                     **({k: v for k, v in timed.items() if k != "prefetch_factor"}
                                        if workers == 0 else timed)})
        return LoaderChange() if workers == workers_now and len(change) == 1 else change  # as it is: timed already

    suggested = change_for(count)
    changes: list[LoaderChange] = [{}]
    for change in [suggested, *(change_for(workers) for workers in sorted({max(0, count - 1),
                                                                           min(max(cap, count), count + 1)}))]:
        if change not in changes:
            changes.append(change)
    return TunePlan(changes, suggested)


def plan_seconds(changes: list[LoaderChange], workers_now: int, batch_s: float, cores: int, io_bound: bool | None,
                 batches: int | None = None) -> float:
    """How long timing ``changes`` takes, from ``batch_s``, the seconds one builder needs for a batch (the
    run's measured production time, advice.loader.production_time): each trial starts its workers, builds
    its first batch, a warm-up and :data:`MEASURE_BATCHES` at the rate its builders reach (all of them for
    storage waits, at most the cores for CPU work), then stops them. ``batches``: the loader's length."""
    total = 0.0
    for change in changes:
        workers = int(change.get("num_workers", workers_now))
        parallel = 1 if workers == 0 else workers if io_bound else min(workers, cores)
        count = 1 + max(1, WARMUP_BATCHES_PER_WORKER * workers) + timed_batches(workers)
        if batches:
            count = min(count, batches)
        overhead = TRIAL_S + (POOL_S + TRIAL_WORKER_S * workers if workers else 0.0)
        total += overhead + batch_s + (count - 1) * batch_s / parallel
    return total


# --------------------------------------------------------------------------- measuring


def _tree(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return [process]


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def _rss(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


@contextlib.contextmanager
def _iterating(loader: Any) -> Iterator[Any]:
    """An iterator whose worker processes are gone however the block ends.

    A Ctrl-C can land inside ``iter()`` after the workers started. torch then leaves the half-built
    iterator's workers to its ``__del__``, which never runs while the traceback holds the iterator
    (IPython keeps the last one in ``sys.last_traceback``): they would stay until the kernel exits.
    (One inside the shutdown is torch's own: its ``finally`` ends the workers still alive.) A Ctrl-C
    inside a worker's ``Process.start()`` (a fork and a pipe: slow on a busy host) leaves that worker
    out of the iterator's list, waiting for work until the kernel exits: it is ended too.
    """
    running = set(multiprocessing.active_children())
    iterator: Any = None
    try:
        try:
            iterator = iter(loader)
        except BaseException as error:
            from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

            for frame, _ in traceback.walk_tb(error.__traceback__):
                half_built = frame.f_locals.get("self")
                if isinstance(half_built, _MultiProcessingDataLoaderIter):
                    with contextlib.suppress(Exception):  # the interrupt is what the caller gets
                        _shut_down_half_built(half_built)
            raise
        yield iterator
    finally:
        try:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        finally:
            # Whatever was interrupted, and where (between iter() and the loop, or inside torch's own
            # shutdown, which sets its "shut down" flag before the try whose finally ends the workers):
            # no worker this block started outlives it. Joined workers are not listed: a trial that
            # ended normally has nothing left here.
            _forget_worker_pids(iterator)
            iterator = None
            _end_started_since(running)


def _forget_worker_pids(iterator: Any) -> None:
    """Take an iterator's workers out of torch's SIGCHLD watch, as its own shutdown does: ending them
    otherwise raises "DataLoader worker ... is killed by signal" in place of what stopped the block."""
    if getattr(iterator, "_worker_pids_set", False):
        with contextlib.suppress(Exception):
            from torch.utils.data._utils.signal_handling import _remove_worker_pids

            _remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False


def _end_started_since(running: set[Any]) -> None:
    """End the processes started since ``running`` and not yet shut down: workers an interrupted
    ``iter()`` started but had not listed (never in torch's SIGCHLD watch, which starts after them), or
    those an interrupted shutdown left. Each on its own: one that cannot be ended leaves the others."""
    try:
        started = set(multiprocessing.active_children()) - running
    except Exception:  # noqa: BLE001 - nothing to end that can be found
        return
    for process in started:
        with contextlib.suppress(Exception):
            process.terminate()
            process.join(timeout=5)


def _shut_down_half_built(iterator: Any) -> None:
    """torch's own shutdown (``_shutdown_workers``: each worker told to stop, joined, its pid out of
    torch's SIGCHLD watch, terminated if still alive) for an iterator whose ``__init__`` was interrupted."""
    if getattr(iterator, "_shutdown", True) or not isinstance(getattr(iterator, "_workers", None), list):
        return  # shut down already, or interrupted before any worker started
    if not hasattr(iterator, "_workers_status"):  # set by its first _reset(): every worker started is waiting
        iterator._workers_status = [True] * len(iterator._workers)
    iterator._shutdown_workers()


def _measure(loader: Any, batches: int, warmup: int, deadline: float) -> tuple[float, float, float, float]:
    """(batches/s, seconds to the first batch, CPU percent of one core, resident bytes)."""
    me = psutil.Process()
    started = now()
    with _iterating(loader) as iterator:
        raise_if_interrupted()  # a Ctrl-C as the workers forked (gpuwidget.measure.interrupts)
        try:
            next(iterator)
        except StopIteration:
            raise TuneError("the loader produced no batches (an empty or exhausted dataset?)") from None
        first = now() - started
        for _ in range(warmup):
            raise_if_interrupted()
            if next(iterator, None) is None or now() > deadline:
                break
        tree = _tree(me)
        cpu_before = _cpu_seconds(tree)
        timed_start = now()
        count = 0
        for _ in range(batches):
            raise_if_interrupted()
            if next(iterator, None) is None:
                break
            count += 1
            if now() > deadline and count >= 2:
                break
        elapsed = now() - timed_start
        cpu = _cpu_seconds(tree) - cpu_before
        memory = _rss(tree)
    if count == 0:
        raise TuneError("the loader ran out of batches during the warm-up; measure a longer dataset")
    return count / elapsed, first, 100.0 * cpu / elapsed, memory


def _check(loader: Any) -> None:
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise TypeError(f"tune_loader needs a torch.utils.data.DataLoader, not {type(loader).__name__}")


def _candidate(original: Any, change: LoaderChange) -> Any:
    from torch.utils.data import DataLoader, IterableDataset

    kwargs = loader_kwargs(original, change)
    if not isinstance(original.dataset, IterableDataset):
        kwargs["dataset"] = _IndexedDataset(original.dataset)
    return DataLoader(**kwargs)


def _worker_counts(start: int, cap: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: dense where it matters, from ``start`` up to ``cap``."""
    counts = [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n <= cap]
    return [n for n in counts if n >= start] or counts[-1:]


# Told after each trial: the trial and the seconds since the search began (ui.progress shows it).
TrialCallback = Callable[[Trial, float], None]


def trial_line(trial: Trial) -> str:
    """One trial as the progress displays show it: ``num_workers=2: 41.2 batches/s``."""
    return f"{trial.label}: {'failed' if trial.error else f'{trial.batches_per_s:.1f} batches/s'}"


class PrintedProgress:
    """``progress=True``: one line per trial on standard output, where a script's or a cell's output
    goes (the notebook's own bars are ui.progress's, which the watch and the Measure button pass)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s

    def planned(self, estimate_s: float, settings: int) -> None:
        """Told once the plan is known: how many settings and how long they take."""
        self.budget_s = estimate_s
        print(f"tuning {fmt_count(settings, 'setting')}, about {fmt_seconds(estimate_s)}" if settings
              else f"tuning for at most {fmt_seconds(estimate_s)}", flush=True)

    def __call__(self, trial: Trial, elapsed_s: float) -> None:
        print(f"tuning {elapsed_s:.1f}/{self.budget_s:.1f} s: {trial_line(trial)}", flush=True)


def progress_callback(progress: bool | TrialCallback | None, budget_s: float) -> TrialCallback | None:
    """The callback ``progress`` asks for: none (False, None), printed lines (True) or its own."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return PrintedProgress(budget_s)
    if callable(progress):
        return progress
    raise TypeError("progress must be True, False or a callable progress(trial, elapsed_s), "
                    f"not {type(progress).__name__} {progress!r}")


def tune_loader(loader: Any, target_rate: float | None = None, budget_s: float = DEFAULT_BUDGET_S,
                name: str | None = None, progress: bool | TrialCallback | None = None,
                io_bound: bool | None = None,
                dataset_name: str | None = None, run_facts: LoaderFacts | None = None,
                workload: WorkloadFacts | None = None, suggestion: LoaderChange | None = None,
                batch_s: float | None = None) -> TuneResult:
    """Measure DataLoader settings for ``loader`` and choose the cheapest that feeds the loop.

    ``target_rate`` is the batches per second the training loop consumes when data is
    ready (``%%gpuwatch`` measures it); without it the fastest setting found is chosen.
    ``suggestion`` (a finding's ``.change`` with ``num_workers``): time the loader as it is, the
    suggested count and its neighbours, and say how the suggestion fared (``TuneResult.verdict``);
    without one, worker counts are searched upwards. ``batch_s``: the seconds one builder takes per
    batch, as a watch measured it, for the time announced before the first trial (without it, the
    loader as it is is timed first and the rest estimated from it).
    ``budget_s`` bounds the whole search; ``name`` and ``dataset_name`` are used in the code
    line (``train_loader = DataLoader(train_ds, ...)``); without a name, the code says where the
    loader is built (``run_facts``: what a watch saw of it, its owner and call site; ``workload``:
    the run's, for a Trainer's or Accelerator's name). ``progress``: True prints a line per
    trial, a callable ``progress(trial, elapsed_s)`` is told of each (and, where it has a
    ``planned(estimate_s, settings)`` method, of the plan first), False or None shows nothing.
    Returns a :class:`TuneResult`; ``.loader()`` builds the chosen DataLoader. Raises
    ``TypeError`` for anything but a DataLoader or a ``progress`` of another kind (before any trial)
    and :class:`TuneError` when the loader cannot be measured (empty, or its dataset raises: the
    message names the item).
    """
    _check(loader)
    told = progress_callback(progress, budget_s)
    if not (budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds, not {budget_s!r}")
    if target_rate is not None and not target_rate > 0:
        raise ValueError(f"target_rate must be positive batches per second, not {target_rate!r}")
    started = now()
    deadline = started + budget_s
    # Storage waits overlap, CPU work does not: search beyond the cores only for the former.
    per_core = {True: 4, False: 1, None: 2}[io_bound]
    cores = usable_cpu_count()
    cap = min(MAX_WORKERS, per_core * cores)

    def measure(change: LoaderChange, suggested: bool = False) -> Trial:
        trial = _trial(loader, change, deadline)
        trial.suggested = suggested
        if told is not None:
            told(trial, now() - started)
        return trial

    plan = suggestion_plan(loader.num_workers, suggestion, cap) if suggestion and "num_workers" in suggestion else None
    announced: float | None = None
    # Each trial iterates a loader (drawing its sampler's and workers' seeds): the user's RNG stays as it was.
    # A Ctrl-C as a trial's workers fork is raised, not dropped.
    with preserved_rng(), keeping_interrupts():
        if plan is None:  # a search: it announces its budget, the most it takes
            _announce(told, budget_s, 0)
            trials, fastest = search_workers(measure, loader.num_workers, cap, target_rate, lambda: now() > deadline)
        else:
            length = _length(loader)
            if batch_s:
                announced = min(budget_s, plan_seconds(plan.changes, loader.num_workers, batch_s, cores, io_bound,
                                                       length))
                _announce(told, announced, len(plan.changes))
            trials = []
            for change in plan.changes:
                if trials and now() > deadline:
                    break
                trials.append(measure(change, change == plan.suggested))
                if len(trials) == 1:
                    if trials[0].error:
                        raise TuneError(f"the loader could not be measured as it is: {trials[0].error}")
                    if announced is None:  # from the loader as it is: its rate and its builders
                        per_batch = _builders(loader.num_workers, cores, io_bound) / trials[0].batches_per_s
                        announced = min(budget_s, (now() - started) + plan_seconds(
                            plan.changes[1:], loader.num_workers, per_batch, cores, io_bound, length))
                        _announce(told, announced, len(plan.changes))
            fastest = max((t for t in trials if not t.error), key=lambda t: t.batches_per_s)
    chosen = _choose(trials, target_rate, fastest, next((t for t in trials if t.suggested), None))
    extra = LoaderChange()
    workers = chosen.change.get("num_workers", loader.num_workers)
    if chosen.change and workers and not loader.persistent_workers:
        # Workers otherwise restart (and re-import, re-open files) at every epoch.
        extra["persistent_workers"] = True
    facts: LoaderFacts = {**(run_facts or LoaderFacts()), "name": name, "dataset_name": dataset_name,
                          "settings": loader_settings(loader)}
    untimed = (plan.suggested.get("num_workers") if plan is not None and plan.suggested is not None
               and not any(t.suggested for t in trials) else None)
    return TuneResult(loader, name or "the loader", trials, chosen, target_rate, budget_s, now() - started, facts,
                      extra, workload or WorkloadFacts(), announced, untimed)


def _announce(told: TrialCallback | None, estimate_s: float, settings: int) -> None:
    planned = getattr(told, "planned", None)
    if callable(planned):
        planned(estimate_s, settings)


def _builders(workers: int, cores: int, io_bound: bool | None) -> int:
    """How many batches a loader with ``workers`` builds at once (plan_seconds' rule)."""
    return 1 if workers == 0 else workers if io_bound else min(workers, cores)


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None


def _trial(loader: Any, change: LoaderChange, deadline: float) -> Trial:
    """Time one setting on a new loader built like ``loader``; a setting that fails is a Trial with
    its error, a dataset that raises or a loader with nothing to time a :class:`TuneError`."""
    trial = Trial(change)
    workers = int(change.get("num_workers", loader.num_workers))
    warmup = max(1, WARMUP_BATCHES_PER_WORKER * workers)
    started = now()
    try:
        rate, first, cpu, memory = _measure(_candidate(loader, change), timed_batches(workers), warmup, deadline)
    except TuneError:
        raise
    except Exception as exc:  # a setting can fail (e.g. too many open files): note it, go on
        trial.error = f"{type(exc).__name__}: {exc}"
        # A worker's DatasetItemError comes back wrapped in its traceback's text.
        if isinstance(exc, DatasetItemError) or "the dataset raised at item" in trial.error:
            raise TuneError(_dataset_message(trial.error)) from exc
    else:
        # Batches every worker repeats are not throughput: only one copy in `copies` is new data.
        copies = copies_per_batch(loader, workers)
        trial.batches_per_s, trial.first_batch_s, trial.cpu_percent, trial.memory_bytes = (
            rate / copies, first, cpu, memory)
    trial.seconds = now() - started
    return trial


def timed_batches(workers: int) -> int:
    """Batches timed per trial: :data:`MEASURE_BATCHES`, rounded up to whole rounds of the workers. Workers
    deliver in rounds (each builds its next batch at the same time), so a count that ends mid-round would
    take a round's burst of ready batches for speed: 12 batches from 7 workers measured 1.7x their rate."""
    return MEASURE_BATCHES if workers < 2 else workers * math.ceil(MEASURE_BATCHES / workers)


def copies_per_batch(loader: Any, workers: int) -> int:
    """How many workers yield each batch: all of them for an IterableDataset that does not
    split its items with get_worker_info() (torch gives each worker a full copy), else one."""
    from torch.utils.data import IterableDataset

    from gpuwidget.probes.origin import shards_by_worker

    if workers < 2 or not isinstance(loader.dataset, IterableDataset):
        return 1
    return workers if shards_by_worker(loader.dataset, loader.worker_init_fn) is False else 1


def search_workers(measure: Callable[[LoaderChange], Trial], workers_now: int, cap: int,
                   target_rate: float | None, expired: Callable[[], bool]) -> tuple[list[Trial], Trial]:
    """The search over ``measure(change) -> Trial``: (every trial in order, the fastest).

    The loader as it is first, then worker counts upwards from one more than it has, until
    one reaches the target with :data:`MARGIN`, more workers stop gaining :data:`MIN_GAIN`,
    a setting fails or time is up (``expired()``); last, a deeper prefetch for the fastest.
    """
    trials: list[Trial] = []

    def run(change: LoaderChange) -> Trial:
        trials.append(measure(change))
        return trials[-1]

    baseline = run({})
    if baseline.error:
        raise TuneError(f"the loader could not be measured as it is: {baseline.error}")
    best = baseline
    previous_rate = baseline.batches_per_s
    for workers in _worker_counts(max(1, workers_now + (1 if workers_now else 0)), cap):
        if expired():
            break
        trial = run({"num_workers": workers})
        if trial.error:
            break
        if trial.batches_per_s > best.batches_per_s:
            best = trial
        enough = target_rate is not None and trial.batches_per_s >= MARGIN * target_rate
        if enough or (previous_rate and trial.batches_per_s < (1 + MIN_GAIN) * previous_rate
                      and workers > max(2, workers_now)):
            break
        previous_rate = max(previous_rate, trial.batches_per_s)
    fastest_workers = int(best.change.get("num_workers", workers_now))
    if fastest_workers > 0 and not expired():
        prefetch = run({"num_workers": fastest_workers, "prefetch_factor": 4})
        if not prefetch.error and prefetch.batches_per_s > (1 + MIN_GAIN) * best.batches_per_s:
            best = prefetch
    return trials, best


def _dataset_message(error: str) -> str:
    marker = "the dataset raised at item"
    # The last mention: a worker's traceback text also quotes the source line that raised.
    return error[error.rindex(marker):].splitlines()[0] if marker in error else error


def _choose(trials: list[Trial], target_rate: float | None, fastest: Trial, suggested: Trial | None = None) -> Trial:
    """The cheapest trial that reaches the target with margin, else the fastest; the suggestion where
    it is as fast as the fastest within :data:`MIN_GAIN` (timing noise cannot tell them apart)."""
    if target_rate is not None:
        good = [t for t in trials if not t.error and t.batches_per_s >= MARGIN * target_rate]
        if good:
            return min(good, key=lambda t: (t.change.get("num_workers", 0), t.change.get("prefetch_factor", 2)))
    if (suggested is not None and not suggested.error
            and (1 + MIN_GAIN) * suggested.batches_per_s >= fastest.batches_per_s):
        return suggested
    return fastest


def tune_for_run(run: Any, loader: Any, budget_s: float = DEFAULT_BUDGET_S,
                 progress: bool | TrialCallback | None = None,
                 suggestion: LoaderChange | None = None) -> TuneResult:
    """Tune ``loader`` against what a watched run measured: its consumption rate, its cause, and the
    suggestion Measure continues (``suggestion``, else the first of the run's findings that changes
    ``num_workers``), timed with the time per batch the run measured."""
    facts = primary_loader(run.workload) or {}
    compute = facts.get("compute_total_s") or 0.0
    steps = facts.get("steps") or 0
    # The rate the loop consumed batches when one was ready: one per compute time.
    target = steps / compute if compute > 0 and steps else None
    diagnosis = diagnose(run.summary, run.workload, run.machine)
    io_bound = None if diagnosis is None or diagnosis.cause == "unknown" else diagnosis.cause == "io"
    if suggestion is None:
        suggestion = next((LoaderChange(**f.change) for f in run.findings or [] if "num_workers" in f.change), None)
    batch_s = production_time(diagnosis) if diagnosis is not None and diagnosis.wait_per_step > 0 else None
    return tune_loader(loader, target_rate=target, budget_s=budget_s, name=facts.get("name"),
                       dataset_name=facts.get("dataset_name"), progress=progress, io_bound=io_bound,
                       run_facts=cast(LoaderFacts, facts), workload=run.workload, suggestion=suggestion,
                       batch_s=batch_s)
