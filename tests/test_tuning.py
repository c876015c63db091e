"""Measured advice: the DataLoader tuner and the batch-size probe, on real torch objects (CPU)."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

from gpuwidget.measure.batch_probe import SizeTrial, _recommend, probe_batch_size, search_sizes
from gpuwidget.measure.tuner import Trial, TuneError, _choose, search_workers, tune_loader

import workloads

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# torch's DataLoader gives each worker MP_STATUS_CHECK_INTERVAL (5 s) to exit before it terminates it:
# on a busy host the workers of an interrupted trial are gone within that per worker, not within 5 s.
CHILDREN_GONE_S = 4 * MP_STATUS_CHECK_INTERVAL


def new_children_left(before: set[int], timeout: float = CHILDREN_GONE_S) -> list[str]:
    """The processes started since ``before`` still alive after ``timeout`` (pid, state and command line:
    a failure says whose they are); empty once they are all gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not children() - before:
            return []
        time.sleep(0.05)
    left = []
    for pid in sorted(children() - before):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            left.append(f"{pid} {process.status()} {' '.join(process.cmdline())[:200]}")
    return left


# --------------------------------------------------------------------------- the tuner


def test_tuner_feeds_a_starved_loop_and_never_touches_the_users_loader():
    # A loader that waits on storage: workers overlap the waits whatever else keeps the cores busy. (A
    # CPU-bound one gains what free cores allow: 1.197x on two cores beside one CPU-bound neighbour.)
    workload = workloads.slow_storage(items=640)
    loader = workload.loader
    before = children()
    result = tune_loader(loader, target_rate=40.0, budget_s=15, name="train_loader", dataset_name="train_ds")
    assert loader.num_workers == 0 and loader.batch_size == 16  # untouched
    assert result.chosen.change.get("num_workers", 0) >= 1
    assert result.speedup > 1.2
    assert result.elapsed_s <= 15 + 5
    assert result.code.splitlines()[-1].startswith(
        "train_loader = DataLoader(train_ds, batch_size=16, shuffle=True, num_workers=")
    rebuilt = result.loader()
    assert rebuilt.dataset is loader.dataset and rebuilt.batch_size == 16
    assert rebuilt.num_workers == result.change["num_workers"]
    text = result._repr_mimebundle_()["text/plain"]
    assert "batches/s" in text and "chosen" in text and "as it is" in text
    assert not new_children_left(before)


def test_tuner_picks_the_cheapest_setting_that_meets_the_target():
    workload = workloads.slow_storage(items=640, latency=0.002)
    # The loop needs ~10 batches/s: a couple of workers do it; the tuner must not take 8.
    result = tune_loader(workload.loader, target_rate=10.0, budget_s=15, io_bound=True)
    meeting = [t for t in result.trials if not t.error and t.batches_per_s >= 1.2 * 10.0]
    assert result.chosen in meeting
    assert result.chosen.change.get("num_workers", 0) == min(t.change.get("num_workers", 0) for t in meeting)


def test_tuner_refuses_what_is_not_a_dataloader():
    with pytest.raises(TypeError, match="needs a torch.utils.data.DataLoader, not list"):
        tune_loader([1, 2, 3])
    with pytest.raises(ValueError, match="budget_s"):
        tune_loader(DataLoader(TensorDataset(torch.zeros(4))), budget_s=0)


def test_tuner_progress_is_true_false_or_a_callable(capsys):
    loader = DataLoader(TensorDataset(torch.zeros(64, 3)), batch_size=4)
    quiet = tune_loader(loader, budget_s=3, progress=False)
    assert quiet.trials and capsys.readouterr().out == ""
    told: list[tuple[str, float]] = []
    told_result = tune_loader(loader, budget_s=3, progress=lambda trial, elapsed: told.append((trial.label, elapsed)))
    assert [label for label, _ in told] == [t.label for t in told_result.trials]
    assert all(b >= a >= 0 for (_, a), (_, b) in zip(told, told[1:]))
    printed = tune_loader(loader, budget_s=3, progress=True)
    plan, *lines = capsys.readouterr().out.splitlines()
    assert plan == "tuning for at most 3.0 s"  # the plan first: no suggestion, so the budget bounds it
    assert len(lines) == len(printed.trials) and lines[0].startswith("tuning ") and lines[0].endswith(
        f"/3.0 s: as it is: {printed.trials[0].batches_per_s:.1f} batches/s")


@pytest.mark.parametrize("progress", [1, "yes", 0.5, [print]])
def test_tuner_refuses_any_other_progress_before_a_trial(progress, monkeypatch):
    import gpuwidget.measure.tuner as tuner

    trials: list[object] = []
    monkeypatch.setattr(tuner, "_trial", lambda *args: trials.append(args))
    with pytest.raises(TypeError, match=r"progress must be True, False or a callable progress\(trial, elapsed_s\)"):
        tune_loader(DataLoader(TensorDataset(torch.zeros(8, 3))), budget_s=3, progress=progress)
    assert trials == []


class Exhausted(IterableDataset):
    def __iter__(self):
        return iter(())


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(4)


def test_tuner_reports_an_empty_iterable_and_bounds_an_endless_one_by_batches():
    with pytest.raises(TuneError, match="produced no batches"):
        tune_loader(DataLoader(Exhausted(), batch_size=2), budget_s=5)
    before = children()
    result = tune_loader(DataLoader(Endless(), batch_size=2), budget_s=6)
    assert result.elapsed_s < 15
    assert result.chosen.batches_per_s > 0
    assert not new_children_left(before)


class Corrupt(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 37:
            raise OSError("truncated JPEG")
        return torch.zeros(3)


def test_a_dataset_that_raises_is_reported_with_the_item_and_workers_are_cleaned_up():
    before = children()
    for workers in (0, 2):
        with pytest.raises(TuneError, match=r"item 37: OSError: truncated JPEG"):
            tune_loader(DataLoader(Corrupt(), batch_size=4, num_workers=workers), budget_s=10)
    assert not new_children_left(before)


class Slow(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.zeros(3)


def test_interrupting_the_tuner_leaves_no_worker_processes():
    before = children()
    loader = DataLoader(Slow(), batch_size=8, num_workers=0)
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            tune_loader(loader, budget_s=30)
    finally:
        timer.cancel()
    assert not new_children_left(before)


def test_a_ctrl_c_inside_torchs_own_worker_shutdown_leaves_no_worker_processes(monkeypatch):
    # torch's _shutdown_workers sets its "shut down" flag before the try whose finally ends the workers: a
    # Ctrl-C landing between the two left them waiting for work until the kernel exits (the flag then
    # makes every later shutdown, __del__'s too, a no-op). Here the Ctrl-C lands exactly there.
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    def interrupted(self: Any) -> None:
        self._shutdown = True
        raise KeyboardInterrupt

    before = children()
    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            tune_loader(DataLoader(Slow(), batch_size=8, num_workers=2), budget_s=30)
    finally:
        monkeypatch.undo()
    assert not new_children_left(before)


# Armed by the test below: a Ctrl-C from inside the parent's at-fork callbacks (registered once; they
# cannot be removed), where CPython ignores the exceptions raised.
_ctrl_c_in_fork: list[bool] = []


def _interrupt_in_fork_callback() -> None:
    if _ctrl_c_in_fork:
        _ctrl_c_in_fork.clear()
        _thread.interrupt_main()
        sum(range(100))  # a few bytecodes: the KeyboardInterrupt is raised here, and dropped


def test_a_ctrl_c_that_lands_in_a_workers_fork_still_stops_the_tuner():
    # logging's lock release runs in the parent as each worker forks: a Ctrl-C landing there was dropped
    # as "Exception ignored", and the tuner ran on to the end of its budget (fresh-check run 44).
    if not hasattr(_interrupt_in_fork_callback, "registered"):
        os.register_at_fork(after_in_parent=_interrupt_in_fork_callback)
        _interrupt_in_fork_callback.registered = True  # type: ignore[attr-defined]
    before = children()
    _ctrl_c_in_fork.append(True)
    started = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            tune_loader(DataLoader(Slow(), batch_size=8, num_workers=1), budget_s=30, suggestion={"num_workers": 2})
    finally:
        _ctrl_c_in_fork.clear()
    assert time.perf_counter() - started < 15  # stopped at the fork, not at the end of the budget
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back
    assert not new_children_left(before)


def test_an_interrupt_while_a_trials_workers_start_leaves_none_running(monkeypatch: pytest.MonkeyPatch):
    # Ctrl-C inside iter(), after the workers started and before the iterator was whole: torch leaves
    # them to the iterator's __del__, which waits as long as the traceback is kept (as IPython keeps it).
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    def interrupted(self: object, loader: object, first_iter: bool = False) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_reset", interrupted)
    before = children()
    with pytest.raises(KeyboardInterrupt) as caught:
        tune_loader(DataLoader(Slow(), batch_size=8, num_workers=2), budget_s=30)
    started = [frame.f_locals["self"] for frame, _ in traceback.walk_tb(caught.tb)
               if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"),
                                                                       _MultiProcessingDataLoaderIter)]
    assert started and started[0]._workers  # the interrupt came after workers started, the traceback holds them
    assert not new_children_left(before, timeout=MP_STATUS_CHECK_INTERVAL)
    # Shut down as torch does, their pids out of its SIGCHLD watch: the next trial runs (ended with a bare
    # SIGTERM, the next one read "DataLoader worker (pid ...) is killed by signal: Terminated").
    monkeypatch.undo()
    again = tune_loader(DataLoader(Slow(), batch_size=8, num_workers=1), budget_s=5, suggestion={"num_workers": 1})
    assert again.trials


def test_an_interrupt_inside_a_workers_start_leaves_that_worker_not_running(monkeypatch: pytest.MonkeyPatch):
    # Ctrl-C as the second worker's Process.start() returns (forked, not yet in the iterator's list, which
    # torch shuts down): on a busy host start() takes long enough for a Ctrl-C to land there (fresh-check).
    import multiprocessing.process

    original_start = multiprocessing.process.BaseProcess.start
    started: list[Any] = []

    def start_then_interrupt(process: Any) -> None:
        original_start(process)
        started.append(process)
        if len(started) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_interrupt)
    before = children()
    with pytest.raises(KeyboardInterrupt):
        tune_loader(DataLoader(Slow(), batch_size=8, num_workers=2), budget_s=30)
    monkeypatch.undo()
    assert len(started) == 2 and not started[1].is_alive()
    assert not new_children_left(before, timeout=MP_STATUS_CHECK_INTERVAL)


# %%gpuwatch --tune on the cell's own loader: tests/test_measure_plan.py (the loader and every finding).


# --------------------------------------------------------------------------- the batch-size probe


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class MemoryLimited(torch.nn.Module):
    """Raises torch's real out-of-memory error above a batch size, like a full GPU would."""

    def __init__(self, inner: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self.inner, self.limit = inner, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return self.inner(x)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return state


def test_probe_leaves_weights_buffers_grads_and_rng_bitwise_unchanged():
    model = Net().eval()
    model(torch.randn(4, 64)).sum().backward()  # the user's gradients, mid-accumulation
    example = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    before, rng = snapshot(model), torch.get_rng_state()
    result = probe_batch_size(model, example, torch.nn.functional.cross_entropy, max_batch=256, budget_s=10)
    after = snapshot(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())
    assert not model.training  # the mode is restored too
    assert result.recommended in {t.batch_size for t in result.trials}
    assert result.largest_fitting is None  # on the CPU: no memory search
    assert "measured on the CPU" in result._repr_mimebundle_()["text/plain"]


def test_probe_finds_the_memory_limit_by_bisection_and_keeps_a_margin():
    model = MemoryLimited(Net(), limit=300)
    before = snapshot(model)
    result = probe_batch_size(model, torch.randn(32, 64), max_batch=4096, budget_s=20, search_memory=True)
    assert 256 <= result.largest_fitting <= 300
    assert result.max_safe <= 0.95 * result.largest_fitting and result.max_safe % 8 == 0
    ran_out = [t.batch_size for t in result.trials if t.samples_per_s is None]
    assert ran_out and min(ran_out) > result.largest_fitting
    assert all(t.batch_size % 8 == 0 for t in result.trials)
    assert all(torch.equal(v, snapshot(model)[k]) for k, v in before.items())


def test_probe_refuses_bad_input():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        probe_batch_size(lambda x: x, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="max_batch"):
        probe_batch_size(Net(), torch.zeros(2, 64), max_batch=0)


def test_probe_restores_state_even_when_the_model_fails():
    class Broken(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("shape mismatch")

    model = Broken()
    before = snapshot(model)
    with pytest.raises(ValueError, match="shape mismatch"):
        probe_batch_size(model, torch.zeros(8, 64), budget_s=5)
    assert all(torch.equal(v, snapshot(model)[k]) for k, v in before.items())


# --------------------------------------------------------------------------- the searches, over a fake measure


def fake_loader(rate_of: Callable[[int], float], fail_at: int | None = None
                ) -> tuple[Callable[[dict], Trial], list[dict]]:
    """A measure(change) -> Trial whose batches/s is ``rate_of(workers)``; the calls are recorded."""
    calls: list[dict] = []

    def measure(change: dict) -> Trial:
        calls.append(dict(change))
        workers = change.get("num_workers", 0)
        if workers == fail_at:
            return Trial(change, error="OSError: too many open files")
        return Trial(change, batches_per_s=rate_of(workers) * (1.5 if "prefetch_factor" in change else 1.0))

    return measure, calls


def never() -> bool:
    return False


def test_worker_search_stops_at_the_first_count_that_feeds_the_loop_with_margin():
    measure, calls = fake_loader(lambda workers: 5.0 + 10.0 * workers)
    trials, fastest = search_workers(measure, workers_now=0, cap=32, target_rate=25.0, expired=never)
    # 3 workers give 35 >= 1.2 x 25; then one deeper prefetch for the fastest, which beats it.
    assert calls == [{}, {"num_workers": 1}, {"num_workers": 2}, {"num_workers": 3},
                     {"num_workers": 3, "prefetch_factor": 4}]
    assert fastest.change == {"num_workers": 3, "prefetch_factor": 4}
    assert _choose(trials, 25.0, fastest).change == {"num_workers": 3}  # the cheapest that is enough


def test_worker_search_stops_where_more_workers_stop_helping():
    measure, calls = fake_loader(lambda workers: 10.0 * min(max(workers, 1), 2))
    trials, fastest = search_workers(measure, workers_now=0, cap=32, target_rate=None, expired=never)
    assert [c.get("num_workers") for c in calls] == [None, 1, 2, 3, 2]  # 3 gained nothing: stop
    assert fastest.change == {"num_workers": 2, "prefetch_factor": 4}


def test_worker_search_starts_above_the_loaders_own_count_and_respects_the_cap():
    measure, calls = fake_loader(lambda workers: 10.0 * workers)
    search_workers(measure, workers_now=4, cap=8, target_rate=None, expired=never)
    assert [c.get("num_workers") for c in calls] == [None, 6, 8, 8]


def test_worker_search_ends_at_a_failing_setting_and_at_the_deadline():
    measure, calls = fake_loader(lambda workers: 10.0 * workers + 1, fail_at=3)
    trials, fastest = search_workers(measure, workers_now=0, cap=32, target_rate=None, expired=never)
    assert [c.get("num_workers") for c in calls] == [None, 1, 2, 3, 2]
    assert fastest.change == {"num_workers": 2, "prefetch_factor": 4}

    measure, calls = fake_loader(lambda workers: 10.0 * workers + 1)
    search_workers(measure, workers_now=0, cap=32, target_rate=None, expired=lambda: len(calls) >= 2)
    assert calls == [{}, {"num_workers": 1}]


def test_worker_search_refuses_a_loader_that_fails_as_it_is():
    measure, _ = fake_loader(lambda workers: 1.0, fail_at=0)
    with pytest.raises(TuneError, match="could not be measured as it is"):
        search_workers(measure, workers_now=0, cap=4, target_rate=None, expired=never)


def fake_model(limit: int, saturates_at: int) -> tuple[Callable[[int], SizeTrial], list[int]]:
    """A measure(size) -> SizeTrial: out of memory above ``limit``, samples/s flat from ``saturates_at``."""
    sizes: list[int] = []

    def measure(size: int) -> SizeTrial:
        sizes.append(size)
        return SizeTrial(size, samples_per_s=None if size > limit else 100.0 * min(size, saturates_at))

    return measure, sizes


def test_size_search_doubles_until_doubling_stops_paying_unless_asked_for_memory():
    measure, sizes = fake_model(limit=300, saturates_at=64)
    trials, fitted, failed = search_sizes(measure, 32, 4096, search_memory=False, expired=never)
    assert sizes == [32, 64, 128, 256] and (fitted, failed) == (256, None)  # two doublings gained nothing
    assert _recommend(trials) == 64


def test_size_search_bisects_to_the_memory_limit_on_aligned_sizes():
    measure, sizes = fake_model(limit=300, saturates_at=64)
    trials, fitted, failed = search_sizes(measure, 32, 4096, search_memory=True, expired=never)
    assert sizes[:5] == [32, 64, 128, 256, 512]
    assert fitted is not None and failed is not None
    assert fitted <= 300 < failed and failed - fitted <= max(1, fitted // 16)
    assert all(size % 8 == 0 for size in sizes)


def test_size_search_stops_at_max_batch_and_at_the_deadline():
    measure, sizes = fake_model(limit=10_000, saturates_at=10_000)
    _, fitted, failed = search_sizes(measure, 32, 100, search_memory=True, expired=never)
    assert sizes == [32, 64, 100] and (fitted, failed) == (100, None)

    measure, sizes = fake_model(limit=10_000, saturates_at=10_000)
    _, fitted, _ = search_sizes(measure, 32, 4096, search_memory=True, expired=lambda: len(sizes) >= 3)
    assert sizes == [32, 64, 128] and fitted == 128
