"""Sampler cadence and robustness; host and replay sources."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import pytest

from gpuwidget.clock import now
from gpuwidget.sampler import DITHER, PROMPT_SWITCH_S, THREAD_NAME, PromptGil, Sampler, next_tick_due, tick_due
from gpuwidget.sources import host
from gpuwidget.sources.base import Source
from gpuwidget.sources.host import HostSource, usable_cpu_count
from gpuwidget.sources.replay import ReplaySource
from gpuwidget.trace import Trace

from support import burn_cpu

# Judges the sampler's cadence and CPU figures in real time: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial


class CountingSource:
    name = "counting"

    def __init__(self, delay: float = 0.0, fail_every: int = 0) -> None:
        self.errors: list = []
        self.reads = 0
        self.delay = delay
        self.fail_every = fail_every
        self.closed = False

    def read(self) -> dict[str, float]:
        self.reads += 1
        if self.fail_every and self.reads % self.fail_every == 0:
            raise RuntimeError("device went away")
        if self.delay:
            time.sleep(self.delay)
        return {"fake.reads": float(self.reads)}

    def describe(self) -> dict:
        return {"name": self.name, "available": True}

    def close(self) -> None:
        self.closed = True


def test_sources_follow_the_protocol():
    assert isinstance(CountingSource(), Source)
    assert isinstance(HostSource(), Source)
    assert isinstance(ReplaySource(Trace()), Source)


def test_ticks_follow_the_interval_on_a_monotonic_clock():
    trace = Trace()
    sampler = Sampler([CountingSource()], trace, interval=0.02).start()
    time.sleep(0.5)
    sampler.stop(final_tick=False)
    t = trace.window().t
    # ~25 ticks expected; a loaded CI machine may drop a few, never double up.
    assert 12 <= len(t) <= 27
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.02, abs=0.01)


def test_slow_source_counts_missed_ticks_instead_of_bursting():
    trace = Trace()
    sampler = Sampler([CountingSource(delay=0.05)], trace, interval=0.01).start()
    time.sleep(0.4)
    sampler.stop(final_tick=False)
    assert sampler.stats.missed_ticks >= 10
    gaps = [b - a for a, b in zip(trace.window().t, trace.window().t[1:])]
    assert min(gaps) >= 0.045  # no catch-up burst


def test_failing_source_and_listener_never_raise_and_the_run_goes_on():
    trace = Trace()
    calls = []

    def bad_listener(_trace: Trace) -> None:
        calls.append(1)
        raise ValueError("plot broke")

    sampler = Sampler([CountingSource(fail_every=2)], trace, interval=0.01, listeners=[bad_listener]).start()
    time.sleep(0.2)
    sampler.stop()
    assert sampler.stats.ticks >= 5
    assert any("device went away" in e for e in sampler.stats.errors)
    assert any("plot broke" in e for e in sampler.stats.errors)
    assert len(calls) == sampler.stats.ticks
    assert trace.stats("fake.reads").count >= 2


def test_the_first_listeners_run_before_any_source_is_read_and_the_others_after_the_row():
    """What must see the moment a tick was due (the stack sampler's sample) comes before the sources,
    which take milliseconds on a busy host or with many GPUs; a failing one is recorded, like the others."""
    order: list[str] = []

    class Slow(CountingSource):
        def read(self) -> dict[str, float]:
            order.append("source")
            return super().read()

    def first(_trace: Trace) -> None:
        order.append("first")
        if len(order) == 1:
            raise ValueError("first broke")

    sampler = Sampler([Slow(delay=0.002)], Trace(), interval=0.01, listeners=[lambda _t: order.append("after")],
                      first=[first])
    sampler.tick()
    sampler.tick()
    assert order == ["first", "source", "after"] * 2
    assert any("first broke" in e for e in sampler.stats.errors)


def due_times(first: bool, interval: float = 0.01, seconds: float = 0.6) -> list[float]:
    """When each tick of a sampler (with a ``first`` listener or without) was due; each tick was told
    when the next one would be (the step probe plans its windows for it), as it came."""
    dues: list[float] = []
    told: list[float] = []

    def record(_trace: Trace) -> None:
        due, following = tick_due(), next_tick_due()
        if due is not None and following is not None:
            dues.append(due)
            told.append(following)

    sampler = Sampler([CountingSource()], Trace(), interval=interval, listeners=[] if first else [record],
                      first=[record] if first else []).start()
    time.sleep(seconds)
    sampler.stop()
    # The next tick came when told, or whole intervals after it (a late tick skips them).
    for following, due in zip(told, dues[1:], strict=False):
        skipped = (due - following) / interval
        assert skipped > -1e-6 and abs(skipped - round(skipped)) < 1e-6, (following, due)
    assert sum(abs(due - following) < 1e-9 for following, due in zip(told, dues[1:], strict=False)) >= len(dues) / 2
    return dues


def test_a_stack_samplers_ticks_come_at_dithered_intervals_and_the_others_on_the_cadence():
    """A loop whose step takes about one interval was sampled at the same point of its step tick after
    tick (and the tick moved that point): its waits read 0.84-0.88 of the loop for 0.77. The stack
    sample's ticks come one interval apart on average, uniformly within DITHER of it; a sampler
    without one keeps ``start + k * interval``."""
    interval = 0.01
    steady = due_times(first=False, interval=interval)
    gaps = [b - a for a, b in zip(steady, steady[1:], strict=False)]
    assert len(gaps) >= 20 and all(abs(gap / interval - round(gap / interval)) < 1e-6 for gap in gaps), gaps
    dithered = due_times(first=True, interval=interval)
    gaps = [b - a for a, b in zip(dithered, dithered[1:], strict=False)]
    # (a tick read late skips whole intervals: the gaps after those are longer)
    within = [gap for gap in gaps if gap <= (1 + DITHER) * interval + 1e-9]
    assert len(within) >= 0.8 * len(gaps) >= 20, gaps
    assert min(within) >= (1 - DITHER) * interval - 1e-9
    below = sum(gap < 0.8 * interval for gap in within) / len(within)
    above = sum(gap > 1.2 * interval for gap in within) / len(within)
    assert 0.15 < below < 0.55 and 0.15 < above < 0.55, [round(gap / interval, 2) for gap in gaps]


def spin_python(seconds: float) -> None:
    """Run bytecode for ``seconds``, never letting go of the GIL on its own (as a tokenizer does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_first_listener_reads_promptly_while_the_watched_thread_runs_python_and_the_users_interval_stays():
    """The stack sample reads where the loop is when its tick is due. A thread running Python keeps the
    GIL for the switch interval (5 ms) before it is asked to let go: the sampler lowers the interval
    just before each due tick, and the user's is in force again after each read and after the watch."""
    usual = sys.getswitchinterval()
    late: list[float] = []
    intervals: list[float] = []

    def first(_trace: Trace) -> None:
        due = tick_due()
        if due is not None:
            late.append(now() - due)
        intervals.append(sys.getswitchinterval())

    sampler = Sampler([CountingSource()], Trace(), interval=0.02, first=[first]).start()
    try:
        spin_python(0.6)
        assert sys.getswitchinterval() in (usual, PROMPT_SWITCH_S)
        sys.setswitchinterval(0.002)  # the user's own, set while watched
        spin_python(0.4)
    finally:
        sampler.stop()
    assert sys.getswitchinterval() == pytest.approx(0.002)
    sys.setswitchinterval(usual)
    # Each read was a prompt one but the first (due as the sampler starts), the last (after the stop)
    # and the one whose lowered interval the user replaced with theirs.
    assert len([i for i in intervals if i != pytest.approx(PROMPT_SWITCH_S)]) <= 3, intervals
    reads = sorted(late[1:])  # the first tick is due as the sampler starts
    assert len(reads) >= 20
    # Without the prompt read, every read comes at least a switch interval (5 ms) late.
    assert reads[len(reads) // 2] < usual / 2, [round(1e3 * x, 2) for x in reads]


def test_a_process_forked_while_a_tick_has_the_interval_lowered_starts_with_the_users():
    usual = sys.getswitchinterval()
    prompt = PromptGil()
    assert not prompt.wait(threading.Event(), now() + 0.002)  # the tick is due: lowered until its read
    try:
        assert sys.getswitchinterval() == pytest.approx(PROMPT_SWITCH_S)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a DataLoader worker or a rank forked at that moment
            os.write(write, repr(sys.getswitchinterval()).encode())
            os._exit(0)
        os.close(write)
        in_child = float(os.read(read, 64))
        os.close(read)
        os.waitpid(pid, 0)
        assert sys.getswitchinterval() == pytest.approx(PROMPT_SWITCH_S)  # the parent's tick still reads
    finally:
        prompt.restore()
    assert in_child == usual
    assert sys.getswitchinterval() == usual


def test_stop_returns_within_one_interval_and_leaves_no_thread():
    import threading

    sampler = Sampler([CountingSource()], Trace(), interval=2.0).start()
    time.sleep(0.05)
    started = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - started < 0.5
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    # stop() took one last reading, so a short block still ends with its final state.
    assert sampler.stats.ticks == 2


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        Sampler([], Trace(), interval=0)


def _burn_until(stop: object) -> None:
    while not stop.is_set():  # type: ignore[attr-defined]
        pass


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time as the kernel counts it (nanoseconds in schedstat, else clock ticks)."""
    try:
        with open(f"/proc/{pid}/schedstat") as counters:
            return int(counters.read().split()[0]) / 1e9
    except OSError:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system


def test_host_source_reports_process_and_worker_cpu_in_si_units(monkeypatch):
    monkeypatch.setattr(host, "CHILDREN_REFRESH_S", 0.0)  # see the worker at once
    monkeypatch.setattr(host, "IO_REFRESH_S", 0.0)
    source = HostSource()
    source.read()
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    worker = ctx.Process(target=_burn_until, args=(stop,))
    worker.start()
    try:
        time.sleep(0.05)
        # The child's own CPU time and the clock on both sides of each reading: whatever share of a
        # core a loaded host leaves it, the reading's rate lies between what those brackets allow.
        cpu0, t0 = _cpu_seconds(worker.pid), time.perf_counter()
        source.read()
        cpu0_after, t0_after = _cpu_seconds(worker.pid), time.perf_counter()
        time.sleep(0.4)
        cpu1, t1 = _cpu_seconds(worker.pid), time.perf_counter()
        values = source.read()
        cpu1_after, t1_after = _cpu_seconds(worker.pid), time.perf_counter()
    finally:
        stop.set()
        worker.join()
    assert 0 <= values["cpu.util"] <= 100
    assert values["proc.rss"] > 10 * 2**20  # bytes, not KB
    assert values["proc.workers"] >= 1
    # Percent of one core: the busy child's CPU seconds per wall second between the two readings, x 100.
    least = 100 * (cpu1 - cpu0_after) / (t1_after - t0)
    most = 100 * (cpu1_after - cpu0) / (t1 - t0_after)
    assert most >= 10, "the child got next to no CPU: nothing to compare"
    assert least - 2 <= values["proc.workers_cpu"] <= most + 2, (least, values["proc.workers_cpu"], most)
    assert values["mem.total"] > values["mem.used"] > 0
    assert f"cpu.core{os.cpu_count() - 1}.util" in values
    assert "disk.read" in values and values["disk.read"] >= 0
    assert usable_cpu_count() >= 1
    assert source.describe()["cpu_affinity"] == usable_cpu_count()


def test_worker_cpu_counts_workers_that_ended_between_two_readings():
    source = HostSource()
    source.read()
    started = time.perf_counter()
    worker = multiprocessing.get_context("fork").Process(target=burn_cpu, args=(0.4,))
    worker.start()
    worker.join()  # listed by no scan: it started and ended between two readings
    values = source.read()
    elapsed = time.perf_counter() - started
    used = values["proc.workers_cpu"] / 100 * elapsed  # back to CPU seconds (over the same span)
    assert used == pytest.approx(0.4, rel=0.35)


def test_host_source_scans_for_children_at_most_once_a_second(monkeypatch):
    monkeypatch.setattr(host, "CHILDREN_EARLY_S", 0.0)  # past a watch's first seconds (every tick then)
    source = HostSource()
    scans = []
    original = host._descendants
    monkeypatch.setattr(host, "_descendants", lambda pid: scans.append(1) or original(pid))
    for _ in range(20):
        source.read()
    assert len(scans) == 1  # not every tick: a scan reads a file per thread
    disk_reads = []
    monkeypatch.setattr(HostSource, "_disk_bytes", lambda self: disk_reads.append(1) or None)
    for _ in range(20):
        source.read()
    assert len(disk_reads) <= 1


def _parent_of_a_sleeper() -> None:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(2,))
    child.start()
    child.join()


def test_descendants_are_found_through_proc_as_psutil_finds_them():
    import psutil

    if host._descendants(os.getpid()) is None:
        pytest.skip("no /proc/<pid>/task/<tid>/children on this system")
    worker = multiprocessing.get_context("fork").Process(target=_parent_of_a_sleeper)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while not psutil.Process(worker.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)  # the worker's own child started (an earlier test's helper may be listed too)
        expected = {p.pid for p in psutil.Process().children(recursive=True)}
        assert {worker.pid} < expected
        assert set(host._descendants(os.getpid())) == expected
    finally:
        worker.terminate()
        worker.join()


def test_without_the_kernels_children_lists_one_pass_over_proc_finds_what_psutil_finds(monkeypatch):
    # A kernel built without CONFIG_PROC_CHILDREN (minimal VM kernels, gVisor) has no
    # /proc/<pid>/task/<tid>/children: the source reads each process's parent instead.
    import psutil

    worker = multiprocessing.get_context("fork").Process(target=_parent_of_a_sleeper)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while not psutil.Process(worker.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)  # the worker's own child started
        # Everything below this process (an earlier test's helpers too), as psutil finds it now.
        expected = {p.pid for p in psutil.Process().children(recursive=True)}
        assert {worker.pid} < expected
        assert set(host._descendants_by_scan(os.getpid())) == expected
        monkeypatch.setattr(host, "_descendants", lambda pid: None)
        source = HostSource()
        time.sleep(0.05)
        values = source.read()
        assert values["proc.workers"] == len(expected)
    finally:
        worker.terminate()
        worker.join()
    assert host._descendants_by_scan(os.getpid(), proc="/nonexistent") is None


def _costly(cpu_s: float, found: list[int]) -> Any:
    def listing(pid: int) -> list[int]:
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass
        return found
    return listing


@pytest.mark.parametrize(("cpu_s", "listings"), [(0.0, 20), (0.004, 1)])
def test_a_costly_listing_of_children_is_not_repeated_every_early_tick(monkeypatch, cpu_s, listings):
    # In a watch's first seconds the children are listed every tick (workers starting), unless a
    # listing costs more than LISTING_EARLY_MAX_S; then no sooner than its cost / LISTING_BUDGET_SHARE.
    monkeypatch.setattr(host, "_descendants", lambda pid: None)
    calls: list[int] = []
    listing = _costly(cpu_s, [])
    monkeypatch.setattr(host.ProcScan, "descendants", lambda self, pid: calls.append(1) or listing(pid))
    source = HostSource()
    for _ in range(20):
        source.read()
    assert len(calls) == listings
    if cpu_s:
        assert source.listing_cpu_s >= cpu_s
        assert source._listing_every == pytest.approx(max(host.CHILDREN_REFRESH_S,
                                                          source.listing_cpu_s / host.LISTING_BUDGET_SHARE))


def test_host_source_first_read_has_no_rates():
    source = HostSource()
    time.sleep(0.05)  # CPU counters tick at 100 Hz: give them an interval to report on
    values = source.read()
    assert "cpu.util" in values
    assert "disk.read" not in values and "proc.cpu" not in values


def test_replay_plays_rows_in_order_and_then_ends():
    recorded = Trace()
    for i in range(5):
        recorded.append(i * 0.5, {"gpu0.util": 10.0 * i, **({"gpu0.power": 100.0} if i < 2 else {})})
    source = ReplaySource(recorded, prefix_map={"gpu0.": "gpu3."})
    rows = [source.read() for _ in range(6)]
    assert [r.get("gpu3.util") for r in rows[:5]] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert "gpu3.power" in rows[0] and "gpu3.power" not in rows[2]  # absent stays absent
    assert rows[5] == {} and source.finished


def test_replay_through_a_sampler_reproduces_the_recording():
    recorded = Trace()
    for i in range(20):
        recorded.append(i * 0.1, {"gpu0.util": float(i)})
    copy = Trace()
    sampler = Sampler([ReplaySource(recorded, loop=True)], copy, interval=0.005).start()
    time.sleep(0.2)
    sampler.stop(final_tick=False)
    values = copy.window()["gpu0.util"].tolist()
    assert values[:20] == [float(i) for i in range(20)]


def test_replay_rejects_bad_pace():
    with pytest.raises(ValueError, match="pace"):
        ReplaySource(Trace(), pace="fast")


def test_own_schedstat_counts_the_calling_thread_even_in_a_forked_child():
    from gpuwidget.sources.schedstat import THREAD_SELF, own_schedstat, read_schedstat

    if read_schedstat(THREAD_SELF) is None:
        pytest.skip("no schedstat in this kernel")
    own_schedstat()  # the main thread's file is now open
    cpu = time.thread_time()
    while time.thread_time() - cpu < 0.05:
        pass
    assert own_schedstat()[0] >= 0.05
    other: list[tuple[float, float] | None] = []
    thread = threading.Thread(target=lambda: other.append(own_schedstat()))
    thread.start()
    thread.join()
    assert other[0] is not None and other[0][0] < 0.05  # a fresh thread's own time, not the main thread's
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reads its own thread, not the parent's file it inherited
        os.write(write, repr(own_schedstat()[0]).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert float(os.read(read, 64)) < 0.05
