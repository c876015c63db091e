"""The DataLoader tuner: measure candidate settings on the user's own loader and pick the cheapest
one that feeds the training loop with margin.

Each candidate is a new DataLoader over the same dataset, sampler and collate function
(the user's loader is never modified). After a warm-up (worker start-up, first prefetch)
a few batches are timed; the candidate's rate is batches per second. The number of workers
is searched upwards from the measurement-based estimate until more stops helping, within
a time budget. The choice is the *fewest* workers whose rate reaches the target (the rate
at which the cell's loop consumed batches when data was ready) times :data:`MARGIN`, not
simply the fastest: each worker costs memory and a core.
"""

from __future__ import annotations

import contextlib
import html
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import psutil

from gpuwidget.advice.code import loader_code
from gpuwidget.advice.loader import diagnose
from gpuwidget.clock import now
from gpuwidget.facts import LoaderFacts, WorkloadFacts
from gpuwidget.figures.summary import primary_loader
from gpuwidget.measure.rng import preserved_rng
from gpuwidget.probes.constructor import rebuild_loader
from gpuwidget.probes.torch_data import loader_kwargs, loader_settings
from gpuwidget.report import html_table, text_table
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

    change: dict[str, Any]
    batches_per_s: float = 0.0
    first_batch_s: float = 0.0
    cpu_percent: float = 0.0  # process tree, percent of one core, while timed
    memory_bytes: float = 0.0  # process tree resident memory at the end of the timing
    error: str | None = None

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.change.items()) or "as it is"


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
    extra: dict[str, Any] = field(default_factory=dict)
    # The watched run's workload, for the code's framework names (trainer, accelerator).
    workload: WorkloadFacts = field(default_factory=WorkloadFacts)

    @property
    def change(self) -> dict[str, Any]:
        return {**self.chosen.change, **self.extra}

    @property
    def code(self) -> str:
        return loader_code(self.facts, self.change, self.workload)

    @property
    def speedup(self) -> float | None:
        """Chosen rate over the loader's own rate as it was (if it was measured)."""
        base = next((t for t in self.trials if not t.change), None)
        if base is None or not base.batches_per_s:
            return None
        return self.chosen.batches_per_s / base.batches_per_s

    def loader(self) -> Any:
        """A new loader of the original's own class with the chosen settings over the same data (the
        original is untouched); ``TypeError`` when that class's constructor cannot take them (the
        ``.code`` then says what to add where the loader is built)."""
        return rebuild_loader(self.original, self.change, self.facts.get("built_at"))

    def _rows(self) -> list[list[str]]:
        rows = []
        for trial in self.trials:
            mark = "chosen" if trial is self.chosen else ""
            rate = "failed" if trial.error else f"{trial.batches_per_s:.1f}"
            rows.append([trial.label, rate, f"{trial.cpu_percent:.0f}%", f"{trial.memory_bytes / 2**20:,.0f} MB",
                         f"{trial.first_batch_s:.2f} s", mark])
        return rows

    def _summary(self) -> str:
        target = f"the loop consumed {self.target_rate:.1f} batches/s" if self.target_rate else "no target rate"
        gain = f", {self.speedup:.2f}x the loader as it was" if self.speedup else ""
        extra = "".join(f", {k}={v!r}" for k, v in self.extra.items())
        return (f"Chosen for {self.name}: {self.chosen.label}{extra} at {self.chosen.batches_per_s:.1f} "
                f"batches/s{gain} ({target}; {len(self.trials)} settings in {self.elapsed_s:.1f} s)")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        headers = ["setting", "batches/s", "CPU", "memory", "first batch", ""]
        rows = self._rows()
        lines = [self._summary(), "", *text_table(headers, rows), "", self.code]
        page = (f"<div class='gpuwidget-tune'><div>{html.escape(self._summary())}</div>"
                f"{html_table(headers, rows, [bool(row[-1]) for row in rows])}"
                f"<pre><code>{html.escape(self.code)}</code></pre></div>")
        return {"text/plain": "\n".join(lines), "text/html": page}


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
    """An iterator whose worker processes are shut down however the block ends."""
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del iterator


def _measure(loader: Any, batches: int, warmup: int, deadline: float) -> tuple[float, float, float, float]:
    """(batches/s, seconds to the first batch, CPU percent of one core, resident bytes)."""
    me = psutil.Process()
    started = now()
    with _iterating(loader) as iterator:
        try:
            next(iterator)
        except StopIteration:
            raise TuneError("the loader produced no batches (an empty or exhausted dataset?)") from None
        first = now() - started
        for _ in range(warmup):
            if next(iterator, None) is None or now() > deadline:
                break
        tree = _tree(me)
        cpu_before = _cpu_seconds(tree)
        timed_start = now()
        count = 0
        for _ in range(batches):
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


def _candidate(original: Any, change: dict[str, Any]) -> Any:
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

    def __call__(self, trial: Trial, elapsed_s: float) -> None:
        print(f"tuning {min(elapsed_s, self.budget_s):.1f}/{self.budget_s:.0f} s: {trial_line(trial)}", flush=True)


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
                workload: WorkloadFacts | None = None) -> TuneResult:
    """Measure DataLoader settings for ``loader`` and choose the cheapest that feeds the loop.

    ``target_rate`` is the batches per second the training loop consumes when data is
    ready (``%%gpuwatch`` measures it); without it the fastest setting found is chosen.
    ``budget_s`` bounds the whole search; ``name`` and ``dataset_name`` are used in the code
    line (``train_loader = DataLoader(train_ds, ...)``); without a name, the code says where the
    loader is built (``run_facts``: what a watch saw of it, its owner and call site; ``workload``:
    the run's, for a Trainer's or Accelerator's name). ``progress``: True prints a line per
    trial, a callable ``progress(trial, elapsed_s)`` is told of each, False or None shows nothing.
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
    cap = min(MAX_WORKERS, per_core * usable_cpu_count())

    def measure(change: dict[str, Any]) -> Trial:
        trial = _trial(loader, change, deadline)
        if told is not None:
            told(trial, now() - started)
        return trial

    # Each trial iterates a loader (drawing its sampler's and workers' seeds): the user's RNG stays as it was.
    with preserved_rng():
        trials, fastest = search_workers(measure, loader.num_workers, cap, target_rate, lambda: now() > deadline)
    chosen = _choose(trials, target_rate, fastest)
    extra = {}
    if chosen.change.get("num_workers", loader.num_workers) and not loader.persistent_workers:
        # Workers otherwise restart (and re-import, re-open files) at every epoch.
        extra["persistent_workers"] = True
    facts: LoaderFacts = {**(run_facts or LoaderFacts()), "name": name, "dataset_name": dataset_name,
                          "settings": loader_settings(loader)}
    return TuneResult(loader, name or "the loader", trials, chosen, target_rate, budget_s, now() - started, facts,
                      extra, workload or WorkloadFacts())


def _trial(loader: Any, change: dict[str, Any], deadline: float) -> Trial:
    """Time one setting on a new loader built like ``loader``; a setting that fails is a Trial with
    its error, a dataset that raises or a loader with nothing to time a :class:`TuneError`."""
    trial = Trial(change)
    workers = int(change.get("num_workers", loader.num_workers))
    warmup = max(1, WARMUP_BATCHES_PER_WORKER * workers)
    try:
        rate, first, cpu, memory = _measure(_candidate(loader, change), MEASURE_BATCHES, warmup, deadline)
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
    return trial


def copies_per_batch(loader: Any, workers: int) -> int:
    """How many workers yield each batch: all of them for an IterableDataset that does not
    split its items with get_worker_info() (torch gives each worker a full copy), else one."""
    from torch.utils.data import IterableDataset

    from gpuwidget.probes.origin import shards_by_worker

    if workers < 2 or not isinstance(loader.dataset, IterableDataset):
        return 1
    return workers if shards_by_worker(loader.dataset, loader.worker_init_fn) is False else 1


def search_workers(measure: Callable[[dict[str, Any]], Trial], workers_now: int, cap: int,
                   target_rate: float | None, expired: Callable[[], bool]) -> tuple[list[Trial], Trial]:
    """The search over ``measure(change) -> Trial``: (every trial in order, the fastest).

    The loader as it is first, then worker counts upwards from one more than it has, until
    one reaches the target with :data:`MARGIN`, more workers stop gaining :data:`MIN_GAIN`,
    a setting fails or time is up (``expired()``); last, a deeper prefetch for the fastest.
    """
    trials: list[Trial] = []

    def run(change: dict[str, Any]) -> Trial:
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


def _choose(trials: list[Trial], target_rate: float | None, fastest: Trial) -> Trial:
    """The cheapest trial that reaches the target with margin, else the fastest."""
    if target_rate is None:
        return fastest
    good = [t for t in trials if not t.error and t.batches_per_s >= MARGIN * target_rate]
    if not good:
        return fastest
    return min(good, key=lambda t: (t.change.get("num_workers", 0), t.change.get("prefetch_factor", 2)))


def tune_for_run(run: Any, loader: Any, budget_s: float = DEFAULT_BUDGET_S,
                 progress: bool | TrialCallback | None = None) -> TuneResult:
    """Tune ``loader`` against what a watched run measured: its consumption rate and its cause."""
    facts = primary_loader(run.workload) or {}
    compute = facts.get("compute_total_s") or 0.0
    steps = facts.get("steps") or 0
    # The rate the loop consumed batches when one was ready: one per compute time.
    target = steps / compute if compute > 0 and steps else None
    diagnosis = diagnose(run.summary, run.workload, run.machine)
    io_bound = None if diagnosis is None or diagnosis.cause == "unknown" else diagnosis.cause == "io"
    return tune_loader(loader, target_rate=target, budget_s=budget_s, name=facts.get("name"),
                       dataset_name=facts.get("dataset_name"), progress=progress, io_bound=io_bound,
                       run_facts=cast(LoaderFacts, facts), workload=run.workload)
