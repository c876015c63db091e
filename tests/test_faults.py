"""Faults on the kernel side: a hung metric source, a second Ctrl-C, a failed cell's memory, hostile files."""

from __future__ import annotations

import gc
import json
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError
from test_run import gpu_run

import gpuwidget
from gpuwidget import runfile, sampler, session
from gpuwidget.clock import now as clock_now
from gpuwidget.probes import Probes
from gpuwidget.run import Run, RunFormatError
from gpuwidget.sampler import Sampler
from gpuwidget.sources.host import HostSource
from gpuwidget.trace import Trace

from fakenvml import FakeNvml

# Judges deadlines of hung sources, stops and Ctrl-C: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

MB = 1024**2


class Hang:
    """Makes a source method block, from its ``after``-th call, until the test ends (or ``release``)."""

    def __init__(self, after: int = 1) -> None:
        self.after = after
        self.calls = 0
        self.released = threading.Event()
        self.threads: set[threading.Thread] = set()

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def hanging(source: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.threads.add(threading.current_thread())
            if self.calls >= self.after:
                self.released.wait(60)
            return method(source, *args, **kwargs)

        return hanging


@pytest.fixture
def hang() -> Iterator[Callable[[int], Hang]]:
    """Hangs made in a test are released when it ends, so their stuck threads can finish."""
    made: list[Hang] = []

    def make(after: int = 1) -> Hang:
        made.append(Hang(after))
        return made[-1]

    yield make
    for each in made:
        each.released.set()


class CountingSource:
    name = "counting"

    def __init__(self) -> None:
        self.errors: list[Any] = []
        self.reads = 0

    def read(self) -> dict[str, float]:
        self.reads += 1
        return {"fake.reads": float(self.reads)}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        pass


class StuckGpuSource(CountingSource):
    """A GPU source whose third read never returns (a GPU falling off the bus mid-query)."""

    name = "nvml"

    def __init__(self, released: threading.Event) -> None:
        super().__init__()
        self.released = released
        self.busy_with: str | None = None
        self.hung_at: float | None = None  # when the read that never returns began (gpuwidget.clock)

    def read(self) -> dict[str, float]:
        self.busy_with = "GPU 1"
        if self.reads >= 2:
            self.hung_at = clock_now()
            self.released.wait(60)
        self.busy_with = None
        return {"gpu1.util": float(super().read()["fake.reads"])}


def wait_until(condition: Callable[[], Any], timeout: float = 30.0) -> bool:
    """Whether ``condition()`` came true within ``timeout`` s (polled; it ends as soon as it does)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ----------------------------------------------------------------- a hung source


def timed_cell(ip: Any, cell: str) -> tuple[Any, float]:
    started = time.perf_counter()
    result = ip.run_cell(cell)
    return result, time.perf_counter() - started


def test_hung_source_never_holds_up_the_cell_and_is_read_and_closed_off_the_users_thread(ip, hang, monkeypatch):
    cell = "%%gpuwatch --interval 0.05 --quiet\nimport time\ntime.sleep(0.3)\n"
    # The same cell without the hang: what starting, summarising and recording a watch cost on this
    # machine now (a loaded host stretches them), timed before and after the cell under test (after
    # one untimed: the first watch of a process imports what the next ones find imported).
    timed_cell(ip, cell)
    controls = [timed_cell(ip, cell)[1]]
    reads = hang(after=3)
    read, close = HostSource.read, HostSource.close
    monkeypatch.setattr(HostSource, "read", reads.wrap(read))
    closed_on: list[threading.Thread] = []
    monkeypatch.setattr(HostSource, "close", lambda source: (closed_on.append(threading.current_thread()),
                                                             close(source))[1])

    result, elapsed = timed_cell(ip, cell)

    assert result.success
    assert reads.calls >= 3  # it did hang
    assert threading.main_thread() not in reads.threads
    assert closed_on and threading.main_thread() not in closed_on
    run = gpuwidget.last_run()
    [stalled] = run.sampler["stalled"]
    assert stalled["source"] == "host" and 0.0 <= stalled["at_s"] < elapsed
    assert f"host stopped answering at {stalled['at_s']:.1f} s" in run._repr_mimebundle_()["text/plain"]
    assert session._active is None
    monkeypatch.setattr(HostSource, "read", read)
    monkeypatch.setattr(HostSource, "close", close)
    controls.append(timed_cell(ip, cell)[1])
    # The hung read costs the cell the sampler's deadline for it (sampler.STOP_DEADLINE_S), no more:
    # within a second of what the same cell takes unhung (0.3 s of its own code and the watch's work).
    assert elapsed < max(controls) + 1.0, f"the cell took {elapsed:.2f} s, {controls} without the hang"


def test_gpu_whose_driver_call_hangs_does_not_hold_up_the_cell(ip, fake_nvml, hang):
    """The real nvidia-ml-py code path: GPU 1's memory query stops returning mid-cell (a GPU falling
    off the bus). The NVML source holds its lock through the read, so closing it on the user's
    thread would hang the cell too."""
    import pynvml

    fake = fake_nvml(FakeNvml.gpus(2))
    fake.real_time = True
    stuck = hang(after=3)
    query = pynvml.nvmlDeviceGetMemoryInfo
    lost = fake.gpu(1)

    def memory_info(gpu: Any, *args: Any) -> Any:
        if gpu is lost:
            return stuck.wrap(lambda _source, *rest: query(gpu, *rest))(None, *args)
        return query(gpu, *args)

    pynvml.nvmlDeviceGetMemoryInfo = memory_info
    try:
        started = time.perf_counter()
        result = ip.run_cell("%%gpuwatch --interval 0.05 --quiet\nimport time\ntime.sleep(0.3)\n")
        elapsed = time.perf_counter() - started
    finally:
        pynvml.nvmlDeviceGetMemoryInfo = query
    assert result.success
    assert stuck.calls >= 3
    assert elapsed < 0.3 + 1.0, f"the cell took {elapsed:.2f} s for 0.3 s of its own code"
    [stalled] = gpuwidget.last_run().sampler["stalled"]
    assert stalled["source"] == "GPU 1"  # the device it was reading (Source.busy_with), not "nvml"
    shown = gpuwidget.last_run()._repr_mimebundle_()["text/plain"]
    assert f"GPU 1 stopped answering at {stalled['at_s']:.1f} s" in shown


def test_nvml_that_never_starts_leaves_host_metrics_after_a_bounded_wait(ip, fake_nvml, hang, monkeypatch):
    import pynvml

    fake_nvml(FakeNvml.gpus(2))
    stuck = hang()
    monkeypatch.setattr(session, "GPU_START_DEADLINE_S", 0.3)
    hanging = stuck.wrap(lambda _source: None)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: hanging(None))
    started = time.perf_counter()
    result = ip.run_cell("%%gpuwatch --interval 0.05 --quiet\npass\n")
    assert result.success and time.perf_counter() - started < 0.3 + 1.0
    run = gpuwidget.last_run()
    assert not run.gpu_found
    assert "NVML did not answer within 0.3 s" in run._repr_mimebundle_()["text/plain"]
    with pytest.raises(UsageError, match=r"--gpus: there is no GPU 1 here \(no GPU found \(NVML did not answer"):
        ip.run_cell_magic("gpuwatch", "--gpus 1 --quiet", "pass\n")
    assert threading.main_thread() not in stuck.threads


def test_source_that_stops_answering_is_dropped_by_name_and_the_others_go_on(hang, monkeypatch):
    monkeypatch.setattr(sampler, "SOURCE_DEADLINE_S", 0.3)
    monkeypatch.setattr(sampler, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(sampler, "WATCHDOG_LATE_S", 0.1)
    released = hang().released
    host, gpu, trace = CountingSource(), StuckGpuSource(released), Trace()
    running = Sampler([gpu, host], trace, interval=0.02).start()
    try:
        # Waited for, not slept: a busy host delays the watchdog's and the sampler's turns.
        assert wait_until(lambda: running.stats.stalled), "the hung source was never dropped"
        before = host.reads
        assert wait_until(lambda: host.reads >= before + 5), "the other sources stopped with the hung one"
    finally:
        started = time.perf_counter()
        running.stop()
        assert time.perf_counter() - started < sampler.STOP_DEADLINE_S + 0.3
    [stalled] = running.stats.stalled
    assert stalled["source"] == "GPU 1"
    # When its third read began (about 0.04 s in; later where a busy host delays the ticks).
    assert gpu.hung_at is not None and 0.0 < stalled["at_s"] <= gpu.hung_at - trace.start_clock
    # The read's start, not the watchdog's drop (a deadline later) nor an earlier tick's.
    assert gpu.hung_at - trace.start_clock - stalled["at_s"] < sampler.SOURCE_DEADLINE_S
    assert stalled["message"].startswith(f"GPU 1 stopped answering at {stalled['at_s']:.1f} s; its readings end")
    assert running.hung_sources == [gpu]
    assert gpu.reads == 2  # once dropped, never asked again


def test_stop_takes_the_last_reading_on_the_sampler_thread(monkeypatch):
    readers: list[threading.Thread] = []

    class Recording(CountingSource):
        def read(self) -> dict[str, float]:
            readers.append(threading.current_thread())
            return super().read()

    running = Sampler([Recording()], Trace(), interval=5.0).start()
    assert wait_until(lambda: readers)  # the first tick, however long the thread takes to start
    running.stop()
    assert len(readers) == 2  # the first tick, and the last one on the way out
    assert threading.current_thread() not in readers


# ----------------------------------------------------------------- a second Ctrl-C


def _interrupting(method: Callable[..., Any], before: Callable[[Any], None] = lambda _: None) -> Callable[..., Any]:
    def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self)
        raise KeyboardInterrupt

    return interrupted


@pytest.mark.parametrize("step", ["probes", "sampler", "source"])
def test_ctrl_c_during_teardown_still_frees_the_kernel_for_the_next_watch(ip, monkeypatch, step):
    if step == "probes":  # the interrupt lands just after the patches came off
        uninstall = Probes.uninstall
        monkeypatch.setattr(Probes, "uninstall", _interrupting(uninstall, uninstall))
    elif step == "sampler":  # ...while stop() waits for the thread, which then ends on its own
        monkeypatch.setattr(Sampler, "stop", _interrupting(Sampler.stop, lambda s: s._stop.set()))
    else:
        monkeypatch.setattr(HostSource, "close", _interrupting(HostSource.close))

    # The cell's own Ctrl-C, then a second one while gpuwidget winds down: the user sees theirs, once.
    result = ip.run_cell("%%gpuwatch --quiet --interval 0.02\nraise KeyboardInterrupt('mine')\n")
    assert isinstance(result.error_in_exec, KeyboardInterrupt) and str(result.error_in_exec) == "mine"
    assert result.error_in_exec.__context__ is None
    assert session._active is None
    assert gpuwidget.last_run().outcome == "interrupted"

    # A cell that ran to its end, and Ctrl-C while it winds down: honoured once everything is released.
    result = ip.run_cell("%%gpuwatch --quiet --interval 0.02\nfinished_cell = 1\n")
    assert isinstance(result.error_in_exec, KeyboardInterrupt) and ip.user_ns.pop("finished_cell") == 1
    assert session._active is None
    assert gpuwidget.last_run().outcome == "ok"  # recorded before the interrupt went on

    monkeypatch.undo()
    again = ip.run_cell("%%gpuwatch --quiet --interval 0.02\nwatched_again = 1\n")
    assert again.success and ip.user_ns.pop("watched_again") == 1


def _ctrl_c_as_the_sampler_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT to this process from inside Sampler.stop: Ctrl-C while the watch winds down."""
    import os
    import signal

    stop = Sampler.stop

    def interrupted_stop(self: Sampler, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        stop(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "stop", interrupted_stop)


def test_ctrl_c_while_winding_down_is_honoured_once_everything_is_released(monkeypatch):
    _ctrl_c_as_the_sampler_stops(monkeypatch)
    with pytest.raises(KeyboardInterrupt), gpuwidget.watch(interval=0.02, quiet=True):
        pass
    assert session._active is None and gpuwidget.last_run().outcome == "ok"  # recorded first


def test_ctrl_c_while_winding_down_goes_to_the_callers_own_handler_afterwards(monkeypatch):
    """gpuwatch's command line forwards Ctrl-C to its command: its handler gets it, nothing raises."""
    import signal

    _ctrl_c_as_the_sampler_stops(monkeypatch)
    calls: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, forward)
    try:
        with gpuwidget.watch(interval=0.02, quiet=True):
            pass
        installed = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert calls == [signal.SIGINT] and installed is forward  # called once, and its handler is back
    assert session._active is None and gpuwidget.last_run().outcome == "ok"


# ----------------------------------------------------------------- a failed cell's memory

FAILING_CELL = """\
import weakref
import numpy as np

def train():
    global held
    big = np.ones(25_000_000)  # 200 MB, alive only in this frame
    held = weakref.ref(big)
    raise RuntimeError("loss diverged")

train()
"""


def test_failed_watched_cell_frees_its_frames_after_a_later_error_as_unwatched(ip):
    process = psutil.Process()
    for watched in (False, True):
        gc.collect()
        rss_before = process.memory_info().rss
        result = ip.run_cell(("%%gpuwatch --quiet --interval 0.05\n" if watched else "") + FAILING_CELL)
        assert isinstance(result.error_in_exec, RuntimeError)
        del result  # it holds the exception, as IPython's own last result does until the next cell
        ip.run_cell("raise ValueError('an unrelated mistake')")  # IPython lets go of the first traceback
        gc.collect()
        assert ip.user_ns["held"]() is None, f"the 200 MB local is still alive ({watched=})"
        assert process.memory_info().rss - rss_before < 100 * MB
    error = gpuwidget.last_run().error
    assert error is not None and (error.type, error.message) == ("RuntimeError", "loss diverged")
    assert 'raise RuntimeError("loss diverged")' in error.traceback
    for name in ("held", "train", "np", "weakref"):
        ip.user_ns.pop(name, None)


# ----------------------------------------------------------------- files written safely


def test_save_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run.json.tmp").symlink_to(victim)  # the name Run.save used to write through
    target = gpu_run().save(tmp_path / "run.json")
    assert victim.read_text() == "precious"
    assert Run.load(target).label == "In [7]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.json.tmp", "victim.txt"]


def test_save_replaces_a_link_at_the_target_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run.json").symlink_to(victim)
    gpu_run().save(tmp_path / "run.json")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "run.json").is_symlink()


def test_concurrent_saves_to_one_path_never_share_a_temporary_file(tmp_path, monkeypatch):
    temporaries: list[str] = []
    mkstemp = runfile.tempfile.mkstemp

    def recording(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = mkstemp(*args, **kwargs)
        temporaries.append(name)
        return fd, name

    monkeypatch.setattr(runfile.tempfile, "mkstemp", recording)
    run = gpu_run()
    errors: list[BaseException] = []

    def save_often() -> None:
        try:
            for _ in range(10):
                run.save(tmp_path / "run.json")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=save_often) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(temporaries) == len(set(temporaries)) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary left behind
    assert Run.load(tmp_path / "run.json").findings == run.findings


def test_bad_save_path_is_refused_before_the_cell_runs(ip, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UsageError, match=r"--save: cannot save to .*a_file.* is not a folder"):
        ip.run_cell_magic("gpuwatch", f"--quiet --save {tmp_path}/a_file/run.json", "cell_ran = 1\n")
    assert "cell_ran" not in ip.user_ns


def test_save_through_dotdot_leaves_no_stray_folder(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = ip.run_cell("%%gpuwatch --quiet --interval 0.05 --save a/../b/run.json\npass\n")
    assert result.success
    assert Run.load(tmp_path / "b" / "run.json").finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


# ----------------------------------------------------------------- files read with suspicion


def _saved(tmp_path: Path) -> dict[str, Any]:
    return json.loads(gpu_run().save(tmp_path / "run.json").read_text())


def _write(tmp_path: Path, data: Any, name: str = "hostile.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


MALFORMED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a list": lambda d: [d],
    "no trace": lambda d: {k: v for k, v in d.items() if k != "trace"},
    "findings not a list": lambda d: {**d, "findings": {"rule": "x"}},
    "finding without a rule": lambda d: {**d, "findings": [{"severity": "warn"}]},
    "unknown severity": lambda d: {**d, "findings": [{**d["findings"][0], "severity": "doom"}]},
    "error without a type": lambda d: {**d, "error": {"message": "m"}},
    "summary a string": lambda d: {**d, "summary": "fast"},
    "times as text": lambda d: {**d, "trace": {**d["trace"], "t": ["0"] * len(d["trace"]["t"])}},
    "short column": lambda d: {**d, "trace": {**d["trace"], "mean": {
        k: v[:-1] for k, v in d["trace"]["mean"].items()}}},
    "stats for a column not there": lambda d: {**d, "trace": {**d["trace"], "stats": {
        **d["trace"]["stats"], "ghost": {"count": 1, "total": 1.0, "min": 1, "max": 1, "last": 1}}}},
    "span without an end": lambda d: {**d, "trace": {**d["trace"], "spans": [{"kind": "step", "start": 0}]}},
    "negative rows": lambda d: {**d, "trace": {**d["trace"], "archive_rows": -1}},
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_run_files_raise_one_clear_error(tmp_path, case):
    path = _write(tmp_path, MALFORMED[case](_saved(tmp_path)))
    with pytest.raises(RunFormatError, match="not a saved gpuwidget run"):
        Run.load(path)


def test_not_json_at_all_is_the_same_clear_error(tmp_path):
    with pytest.raises(RunFormatError, match="not JSON"):
        Run.load(_write(tmp_path, "{'format': "))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(RunFormatError, match="not UTF-8"):
        Run.load(binary)
    assert issubclass(RunFormatError, ValueError)  # callers catching ValueError still do


def test_sizes_written_in_a_file_never_drive_what_loading_allocates(tmp_path):
    data = _saved(tmp_path)
    data["trace"]["archive_rows"] = 5_000_000  # the file holds 50 rows
    path = _write(tmp_path, data)
    assert path.stat().st_size < 64 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(RunFormatError, match="archive_rows"):
            Run.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MB


def test_many_empty_columns_load_in_memory_bounded_by_the_file(tmp_path):
    data = _saved(tmp_path)
    trace = data["trace"]
    columns = {f"c{i}": [None] * len(trace["t"]) for i in range(2000)}
    for key in ("min", "max"):
        trace[key].update({name: [None] * trace["archive_rows"] for name in columns})
    trace["archive_count"].update({name: [0] * trace["archive_rows"] for name in columns})
    trace["mean"].update(columns)
    path = _write(tmp_path, data)
    tracemalloc.start()
    try:
        loaded = Run.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(loaded.trace.columns) >= 2000
    assert peak < 20 * path.stat().st_size, f"{peak / MB:.0f} MB for a {path.stat().st_size / MB:.1f} MB file"


def test_non_finite_values_in_a_file_render_as_not_available(tmp_path):
    text = gpu_run().save(tmp_path / "run.json").read_text()
    data = json.loads(text)
    data["summary"]["samples_per_s"] = "NAN_HERE"
    data["summary"]["gpu_busy_mean"] = "INF_HERE"
    data["findings"][0]["evidence"]["data_wait_fraction"] = "NAN_HERE"
    text = json.dumps(data).replace('"NAN_HERE"', "NaN").replace('"INF_HERE"', "Infinity")
    loaded = Run.load(_write(tmp_path, text))
    assert loaded.summary["samples_per_s"] is None and loaded.summary["gpu_busy_mean"] is None
    for shown in loaded._repr_mimebundle_().values():
        assert "n/a" in shown and "nan" not in shown and "inf/s" not in shown
        assert "data_wait_fraction=n/a" in shown or "data_wait_fraction = n/a" in shown


# ----------------------------------------------------------------- --gpus without a driver


@pytest.mark.parametrize("scenario", [FakeNvml.library_missing, FakeNvml.driver_not_loaded])
def test_asking_for_a_gpu_without_a_driver_is_an_error_as_with_gpus(ip, fake_nvml, scenario):
    fake_nvml(scenario())
    with pytest.raises(UsageError, match=r"--gpus: there is no GPU 5 here \(no GPU found"):
        ip.run_cell_magic("gpuwatch", "--gpus 5 --quiet", "cell_ran = 1\n")
    assert "cell_ran" not in ip.user_ns
    assert session._active is None
    ip.run_cell_magic("gpuwatch", "--quiet --interval 0.05", "pass\n")  # without --gpus: host metrics
    assert not gpuwidget.last_run().gpu_found



# ----------------------------------------------------------------- measurements leave the user's state


def _rng_states() -> tuple[Any, ...]:
    import random

    import numpy as np
    import torch

    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same_rng(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    return bool(before[0].equal(after[0]) and (before[1] == after[1]).all() and before[2] == after[2])


class DrawingDataset:
    """A dataset whose items draw from NumPy's and Python's generators, as augmentations do."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> Any:
        import random

        import numpy as np
        import torch

        return torch.full((4,), float(index) + random.random() + float(np.random.rand()))


def test_tuner_leaves_torch_numpy_and_python_random_state_as_they_were(one_torch_thread):
    from torch.utils.data import DataLoader

    loader = DataLoader(DrawingDataset(), batch_size=8, shuffle=True)  # type: ignore[arg-type]
    before = _rng_states()
    gpuwidget.tune_loader(loader, budget_s=4)
    assert _same_rng(before, _rng_states())


def test_batch_probe_leaves_numpy_and_python_random_state_as_they_were(one_torch_thread):
    import random

    import numpy as np
    import torch

    class Jittered(torch.nn.Module):
        """Draws from all three generators in its forward pass, as some augmentations do."""

        def __init__(self) -> None:
            super().__init__()
            self.linear, self.dropout = torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.linear(x)) * (1 + 0.01 * (random.random() + float(np.random.rand())))

    model, example = Jittered(), torch.randn(8, 16)
    before = _rng_states()
    gpuwidget.probe_batch_size(model, example, max_batch=32, budget_s=3)
    assert _same_rng(before, _rng_states())


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0, -1, "10"])
def test_batch_probe_refuses_a_budget_that_is_not_a_positive_time(budget):
    import torch

    with pytest.raises(ValueError, match="budget_s must be a positive number of seconds"):
        gpuwidget.probe_batch_size(torch.nn.Linear(4, 4), torch.zeros(2, 4), budget_s=budget)


def test_cpu_memory_search_stops_short_of_the_memory_available(one_torch_thread, monkeypatch):
    import torch

    from gpuwidget.measure import batch_probe
    from gpuwidget.measure.host_memory import peak_resident

    available = 96 * MB  # as if the machine had this much left
    monkeypatch.setattr(batch_probe, "available_bytes", lambda: available)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    # The memory bound must stop it, not the budget: a long one (it stops in seconds here, but each
    # trial times at least MIN_TIMED_S of real steps, which a busy host makes take longer).
    with peak_resident() as probe_memory:
        result = gpuwidget.probe_batch_size(model, torch.randn(8, 256), max_batch=1 << 20, budget_s=240,
                                            search_memory=True)
    ran = max(t.batch_size for t in result.trials if t.samples_per_s is not None)
    assert 256 <= ran < 1 << 20, "the search never grew, or was stopped by max_batch"
    assert result.largest_fitting == ran
    assert any("host memory available" in note for note in result.notes)
    assert not any("budget" in note for note in result.notes)
    assert probe_memory.peak - probe_memory.before < available


# ----------------------------------------------------------------- DataLoader workers after Ctrl-C

INTERRUPTED_LOOP = """\
import _thread, threading, time
import torch
from torch.utils.data import DataLoader, Dataset

class SlowItems(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, index):
        time.sleep(0.2)  # storage: the loop is blocked in next() when Ctrl-C comes
        return torch.zeros(4)

threading.Timer(0.3, _thread.interrupt_main).start()
for batch in DataLoader(SlowItems(), batch_size=4, num_workers=2):
    pass
"""


def _workers() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _workers_end(before: set[int], timeout: float = 60.0) -> bool:
    """Whether the workers started since ``before`` ended within ``timeout`` s: it returns as soon as they
    do (about 1 s here); a loaded host stretches their shutdown, a Run that holds them never ends it."""
    deadline = time.monotonic() + timeout
    while _workers() - before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return not _workers() - before


def test_workers_of_an_interrupted_watched_loop_end_as_unwatched(ip, monkeypatch):
    """Interrupted inside next(), the traceback holds the iterator: IPython lets go of it at the next
    error, and so must the Run (it used to keep the exception, hence the workers, until the next watch)."""
    from torch.utils.data import _utils

    # The iterator's shutdown waits this long per worker before it terminates it (5 s by default).
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    before = _workers()
    for magic in ("", "%%gpuwatch --quiet --interval 0.05\n"):
        result = ip.run_cell(magic + INTERRUPTED_LOOP)
        assert isinstance(result.error_in_exec, KeyboardInterrupt)
        del result
        assert len(_workers() - before) == 2  # the loop really had its two workers
        ip.run_cell("raise ValueError('an unrelated mistake')")
        assert _workers_end(before), f"workers outlived the interrupted loop ({magic=})"
    assert gpuwidget.last_run().outcome == "interrupted"
    for name in ("SlowItems", "batch", "DataLoader", "Dataset"):
        ip.user_ns.pop(name, None)


# ----------------------------------------------------------------- Ctrl-C twice in a real kernel

# Run in the kernel before the watched cell: two fake GPUs (the real nvidia-ml-py code path), GPU 1's
# memory query stops returning from its third call (a GPU falling off the bus, NVML's lock held), and
# Sampler.stop touches a file as it starts, so the test knows the teardown has begun.
KERNEL_SETUP = """\
import sys, threading, time
sys.path.insert(0, {tests!r})
import pynvml
from fakenvml import FakeNvml
from gpuwidget.sampler import Sampler

fake = FakeNvml.gpus(2)
fake.real_time = True
_patch = fake.patched()  # kept: a dropped generator would undo the patch
_patch.__enter__()
_query, _lost, _released, _asked = pynvml.nvmlDeviceGetMemoryInfo, fake.gpu(1), threading.Event(), []
_hang = threading.Event()  # set for the cell under test; the control cells run without the hang

def _memory_info(gpu, *args):
    if gpu is _lost and _hang.is_set():
        _asked.append(1)
        if len(_asked) >= 3:
            _released.wait(120)
    return _query(gpu, *args)

pynvml.nvmlDeviceGetMemoryInfo = _memory_info
_stop = Sampler.stop

def _marked_stop(self, *args, **kwargs):
    open({marker!r}, "w").close()
    return _stop(self, *args, **kwargs)

Sampler.stop = _marked_stop
"""

# What the interrupted run recorded, and the threads it left: only the reader stuck inside NVML.
KERNEL_INTERRUPTED = """\
import gpuwidget, json, threading
from gpuwidget.sampler import THREAD_NAME
interrupted = gpuwidget.last_run()
stuck = [t for t in threading.enumerate() if t.name == THREAD_NAME]
print(json.dumps({"outcome": interrupted.outcome, "stalled": [e["source"] for e in interrupted.sampler["stalled"]],
                  "stuck": len(stuck)}))
"""
# After the next watch, the hang released: what the abandoned reader did once its read returned.
KERNEL_RELEASED = """\
import time
rows = interrupted.trace.rows_total
_released.set()
for thread in stuck:
    thread.join(5)
time.sleep(0.2)
print(json.dumps({"left": [t.name for t in threading.enumerate() if t.name == THREAD_NAME],
                  "late_rows": interrupted.trace.rows_total - rows}))
"""


def _kernel_json(kc: Any, code: str) -> Any:
    output: list[str] = []
    reply = kc.execute_interactive(code, timeout=30, output_hook=lambda msg: output.append(
        msg["content"].get("text", "") if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout" else ""))
    assert reply["content"]["status"] == "ok"
    return json.loads("".join(output))


@pytest.mark.kernel
def test_ctrl_c_twice_in_a_real_kernel_with_a_hung_gpu_ends_the_cell_and_frees_the_kernel(tmp_path):
    from jupyter_client.manager import start_new_kernel
    from test_kernel import of_type

    marker = tmp_path / "teardown-started"
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        setup = KERNEL_SETUP.format(tests=str(Path(__file__).parent), marker=str(marker))
        assert kc.execute_interactive("%load_ext gpuwidget\n" + setup, timeout=60)["content"]["status"] == "ok"

        def interrupted_cell(second: bool) -> tuple[float, list[tuple[float, dict]]]:
            """A watched cell that sleeps, Ctrl-C after 0.6 s, and with ``second`` Ctrl-C again once the
            teardown has begun; seconds from the first Ctrl-C to the cell's end, and its messages."""
            if marker.exists():
                marker.unlink()
            msg_id = kc.execute("%%gpuwatch --interval 0.05 --quiet\nimport time\ntime.sleep(60)\n")
            messages: list[tuple[float, dict]] = []

            def until(done: Callable[[dict], bool], timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        msg = kc.get_iopub_msg(timeout=0.005)
                    except Exception:  # noqa: BLE001 - queue.Empty: look at the marker
                        if marker.exists() and done({}):
                            return
                        continue
                    if msg["parent_header"].get("msg_id") == msg_id:
                        messages.append((time.monotonic(), msg))
                        if done(msg):
                            return
                raise AssertionError(f"the kernel did not get there in time: {[m['msg_type'] for _, m in messages]}")

            until(lambda msg: msg.get("msg_type") == "execute_input", 30)
            time.sleep(0.6)  # the cell sleeps; GPU 1's read has hung since its third tick (when it hangs)
            km.interrupt_kernel()  # Ctrl-C: the cell's own code ends here
            interrupted = time.monotonic()
            if second:
                # The teardown has begun: stop() waits on the stuck read.
                until(lambda msg: not msg and marker.exists(), 10)
                km.interrupt_kernel()  # Ctrl-C again, while gpuwidget winds down
            until(lambda msg: msg.get("msg_type") == "status" and msg["content"]["execution_state"] == "idle", 30)
            return messages[-1][0] - interrupted, messages

        # The same cell without the hang, interrupted once: how long summarising and showing the run take
        # on this machine now (a loaded host stretches it), measured before the cell under test and after.
        controls = [interrupted_cell(second=False)[0]]
        assert kc.execute_interactive("_hang.set()", timeout=30)["content"]["status"] == "ok"
        ended, messages = interrupted_cell(second=True)
        errors = [m["content"]["ename"] for _, m in of_type(messages, "error")]
        assert errors == ["KeyboardInterrupt"]  # the user's own interrupt, shown once
        recorded = _kernel_json(kc, KERNEL_INTERRUPTED)
        assert recorded == {"outcome": "interrupted", "stalled": ["GPU 1"], "stuck": 1}
        assert kc.execute_interactive("_hang.clear()", timeout=30)["content"]["status"] == "ok"
        controls.append(interrupted_cell(second=False)[0])

        # Ended within about a second of the first Ctrl-C (it hung for good closing NVML under the stuck
        # read): the sampler's deadline waiting for the reader (0.5 s), then summarising and showing the
        # run as the control cells did, and a margin for the load changing between them.
        assert ended < max(controls) + sampler.STOP_DEADLINE_S + 0.5, \
            f"the cell ended {ended:.2f} s after its code (without the hang: {controls})"

        again = kc.execute_interactive("%%gpuwatch --interval 0.05 --quiet\nwatched_again = 1\n", timeout=30)
        assert again["content"]["status"] == "ok"  # not "another watch is already running"
        released = _kernel_json(kc, KERNEL_RELEASED)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert released["left"] == []  # once its read returns, the abandoned reader ends too
    assert released["late_rows"] == 0  # ...and what it read so late is discarded
