"""The probes' lean hot path: the figures made at flush from per-step records are those of the loop,
whenever the flushes come, on a clock the test controls."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpuwidget.probes
from gpuwidget.advice.loader import MIN_SAMPLED_WAIT_S, MIN_SAMPLED_WAITS
from gpuwidget.probes import Probes, torch_data, torch_model, torch_steps
from gpuwidget.probes.torch_data import CPU_SAMPLE_EVERY, DataLoaderProbe
from gpuwidget.trace import Trace


class Clock:
    """Every reading of the probes' clock is one second after the last: 100, 101, ... from each reset()."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._ticks = itertools.count(100)

    def __call__(self) -> float:
        return float(next(self._ticks))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    now = Clock()
    for module in (gpuwidget.probes, torch_data, torch_steps, torch_model):
        monkeypatch.setattr(module, "now", now)
    monkeypatch.setattr(torch_data, "thread_run_delay", lambda: 0.0)  # the thread's run delay: none
    monkeypatch.setattr(torch_data, "cpu_clock", lambda: 0.0)  # nor its CPU
    monkeypatch.setattr(torch_data, "perf_counter", lambda: 0.0)  # nor a collate function's time
    return now


def loader_run(flush_every: int | None) -> tuple[dict[str, Any], Trace]:
    trace = Trace(start_clock=50.0)
    probe = DataLoaderProbe(trace)
    loader = DataLoader(TensorDataset(torch.zeros(37, 3)), batch_size=4)  # 10 batches, the last of 1
    probe.install()
    try:
        done = 0
        for _ in range(3):
            for _batch in loader:
                done += 1
                if flush_every and done % flush_every == 0:
                    probe.flush()
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    return stats.facts({}), trace


def test_a_loaders_figures_are_its_clock_readings_however_the_flushes_fall(clock):
    facts, trace = loader_run(None)
    # Each next() reads the clock twice (start, end), the one ending an epoch once: a step of 2 s,
    # a wait of 1 s, 1 s of compute between them; the call ending an epoch closes the last step.
    assert facts["steps"] == 30 and facts["epochs"] == 3 and facts["samples"] == 3 * 37
    assert facts["wait_total_s"] == 30.0 and facts["compute_total_s"] == 30.0
    assert facts["step_times"] == [2.0] * 30 and facts["wait_times"] == [1.0] * 30
    waits = trace.spans("loader.wait")
    assert [(s.start, s.end) for s in waits[:2]] == [(50.0, 51.0), (52.0, 53.0)]
    # The next epoch's first next() starts right after the StopIteration reading (70): no step across it.
    assert (waits[10].start, waits[10].end) == (71.0, 72.0)
    steps = trace.spans("step")
    assert len(steps) == 30 and {s.end - s.start for s in steps} == {2.0}
    assert steps[9].end == 70.0  # closed by the call that raised StopIteration
    assert trace.span_stats("step").total == 60.0 and trace.span_stats("loader.wait").count == 30
    for flush_every in (1, 3, 7):
        clock.reset()
        other, other_trace = loader_run(flush_every)
        assert other == facts
        for kind in ("step", "loader.wait"):
            assert other_trace.spans(kind) == trace.spans(kind)
            assert other_trace.span_stats(kind) == trace.span_stats(kind)


class Rows(torch.utils.data.Dataset):
    """Rows a list holds (it may grow between epochs); ``text`` rows are strings, whose batches have no tensor."""

    def __init__(self, count: int, text: bool = False) -> None:
        self.rows: list[Any] = [str(i) if text else torch.full((3,), float(i)) for i in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


def planned_run(loader: DataLoader, epochs: int, between=None) -> tuple[Any, list[float]]:
    """``epochs`` epochs of ``loader``, a flush after every batch; the samples field of each record the loop
    queued (-1: left to the flush to count from the loader's batching)."""
    probe = DataLoaderProbe(Trace(start_clock=50.0))
    queued: list[float] = []
    probe.install()
    try:
        for epoch in range(epochs):
            if between is not None and epoch:
                between()
            for _batch in loader:
                queued.append(probe._records[-1])
                probe.flush()
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    return stats, queued


@pytest.mark.parametrize("drop_last", [False, True])
def test_once_a_batch_read_agrees_with_the_loaders_batching_no_batch_is_read_and_the_samples_stay_exact(
        clock, drop_last):
    loader = DataLoader(Rows(37), batch_size=4, shuffle=True, drop_last=drop_last)  # 9 batches of 4 (and one of 1)
    stats, queued = planned_run(loader, 3)
    per_epoch = 36 if drop_last else 37
    assert stats.steps == 3 * len(loader) and stats.samples == 3 * per_epoch
    assert stats.last_batch_samples == (4 if drop_last else 1)
    # The first batch is read (4), then none but the sampled calls' (every CPU_SAMPLE_EVERY-th, from the second).
    assert queued[0] == 4 and queued[2:CPU_SAMPLE_EVERY + 1] == [-1] * (CPU_SAMPLE_EVERY - 1)
    assert stats.planned and stats.plan_trusted


def test_a_dataset_grown_between_epochs_counts_its_new_length_from_the_next_epoch(clock):
    dataset = Rows(37)
    loader = DataLoader(dataset, batch_size=4)
    stats, _ = planned_run(loader, 2, between=lambda: dataset.rows.extend(torch.zeros(3) for _ in range(6)))
    assert stats.samples == 37 + 43 and stats.steps == 10 + 11 and stats.last_batch_samples == 3


def test_batches_whose_first_dimension_is_not_their_samples_are_read_every_time(clock):
    def pairs(rows: list[Any]) -> tuple[Any, ...]:  # a collate function of the user's: two rows a sample
        return (torch.stack([row for row in rows for _ in range(2)]),)

    collated = DataLoader(Rows(37), batch_size=4, collate_fn=pairs)
    stats, queued = planned_run(collated, 2)
    assert stats.plan is None and stats.samples == 2 * 74 and -1 not in queued
    # torch's own collation of strings: a list of them, no tensor to read a size from (0, as ever);
    # the batching said 4: the read disagrees and every batch is read from then on.
    text = DataLoader(Rows(37, text=True), batch_size=4)
    stats, queued = planned_run(text, 2)
    assert stats.samples == 0 and stats.plan_trusted is False and not stats.planned and -1 not in queued


def test_the_cpu_counters_are_read_on_the_same_steps_as_before(clock, monkeypatch):
    reads: list[int] = []
    probe_stats: list[Any] = []

    def counters() -> float:
        reads.append(probe_stats[0].calls if probe_stats else -1)
        return 0.0

    monkeypatch.setattr(torch_data, "thread_run_delay", counters)
    probe = DataLoaderProbe(Trace())
    loader = DataLoader(TensorDataset(torch.zeros(40, 1)), batch_size=1)
    probe.install()
    try:
        iterator = iter(loader)
        probe_stats.append(probe.stats[0])
        for _ in iterator:
            pass
    finally:
        probe.uninstall()
    # Twice (before and after) around next() calls 1, 9, 17, ... (0-based): never the first.
    sampled = sorted(set(reads))
    assert sampled == list(range(1, 40, CPU_SAMPLE_EVERY))
    assert probe.stats[0].wait_sampled == float(len(sampled))


class TimedDataset(torch.utils.data.Dataset):
    """Each sample takes ``wait`` seconds of the test's clock to fetch."""

    def __init__(self, clock: list[float], samples: int, wait: float) -> None:
        self.clock, self.samples, self.wait = clock, samples, wait

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        self.clock[0] += self.wait
        return torch.zeros(1)


def sampled_calls(monkeypatch: pytest.MonkeyPatch, wait: float, compute: float, steps: int = 4000) -> list[int]:
    """The next() calls (0-based) whose CPU and run delay were read, in a loop of ``steps`` batches that
    each wait ``wait`` seconds in next() and compute ``compute`` seconds between them."""
    clock = [100.0]
    reads: list[int] = []
    stats: list[Any] = []

    def counters() -> float:
        reads.append(stats[0].calls)
        return 0.0

    monkeypatch.setattr(torch_data, "now", lambda: clock[0])
    monkeypatch.setattr(torch_data, "thread_run_delay", counters)
    probe = DataLoaderProbe(Trace(start_clock=50.0))
    loader = DataLoader(TimedDataset(clock, steps, wait), batch_size=1)
    probe.install()
    try:
        iterator = iter(loader)
        stats.append(probe.stats[0])
        for _batch in iterator:
            clock[0] += compute
    finally:
        probe.uninstall()
    facts = probe.stats[0].facts({})
    assert facts["wait_sampled_s"] == pytest.approx(wait * len(set(reads)))
    return sorted(set(reads))


def cost_stride(step_s: float) -> int:
    return math.ceil(torch_data.SAMPLED_CALL_COST_S / (torch_data.SAMPLE_COST_SHARE * step_s))


def test_a_fast_loop_reads_its_cpu_on_fewer_steps_once_the_advice_has_what_it_needs(monkeypatch):
    # A 0.3 ms step with a 10 us wait: its loader is not what holds it up, and reading the thread's CPU
    # (four system calls) on one step in eight would cost it more than the 0.1 % the reads may take.
    fast = sampled_calls(monkeypatch, wait=10e-6, compute=300e-6)
    assert fast[:2] == [1, 9]  # the first reads as before, to learn the step
    assert {b - a for a, b in zip(fast[1:], fast[2:])} == {cost_stride(310e-6)}
    assert len(fast) < 4000 / 100
    # A 1.2 ms step that waits 1 ms on its loader: one in eight until enough waits are sampled for the
    # advice to tell CPU work from sleep (three times its minimum: a count, or seconds of long waits),
    # then as many as the cost allows.
    enough = torch_data.SAMPLED_WAITS_ENOUGH
    assert enough >= 3 * MIN_SAMPLED_WAITS and round(torch_data.SAMPLED_WAIT_ENOUGH_S / MIN_SAMPLED_WAIT_S, 9) >= 3
    starved = sampled_calls(monkeypatch, wait=1e-3, compute=0.2e-3)
    assert starved[:enough] == list(range(1, CPU_SAMPLE_EVERY * enough, CPU_SAMPLE_EVERY))
    assert {b - a for a, b in zip(starved[enough - 1:], starved[enough:])} == {cost_stride(1.2e-3)}
    # Half of a 0.3 ms step waiting: one in eight until sampled enough, the same as the 1 ms wait.
    half = sampled_calls(monkeypatch, wait=155e-6, compute=155e-6)
    assert half[:enough] == list(range(1, CPU_SAMPLE_EVERY * enough, CPU_SAMPLE_EVERY))
    assert {b - a for a, b in zip(half[enough - 1:], half[enough:])} == {cost_stride(310e-6)}
    # A 3 ms step waiting 2.1 ms: its sampled waits reach three times the advice's minimum seconds
    # (0.3 s) after 143 of them, before the count.
    long = sampled_calls(monkeypatch, wait=2.1e-3, compute=0.9e-3, steps=2000)
    by_seconds = math.ceil(torch_data.SAMPLED_WAIT_ENOUGH_S / 2.1e-3)
    assert by_seconds < enough
    assert long[:by_seconds] == list(range(1, CPU_SAMPLE_EVERY * by_seconds, CPU_SAMPLE_EVERY))
    assert {b - a for a, b in zip(long[by_seconds - 1:], long[by_seconds:])} == {cost_stride(3e-3)}
    # A slow step that hardly waits: one in eight already costs it little.
    slow = sampled_calls(monkeypatch, wait=10e-6, compute=40e-3, steps=400)
    assert slow == list(range(1, 400, CPU_SAMPLE_EVERY))


def test_two_loaders_in_one_loop_keep_their_own_figures_and_the_spans_stay_in_time_order(clock):
    trace = Trace(start_clock=0.0)
    probe = DataLoaderProbe(trace)
    first = DataLoader(TensorDataset(torch.zeros(12, 1)), batch_size=4)
    second = DataLoader(TensorDataset(torch.zeros(24, 1)), batch_size=8)
    probe.install()
    try:
        for index, _ in enumerate(zip(first, second)):
            if index == 1:
                probe.flush()
    finally:
        probe.uninstall()
    by_size = {s.settings["batch_size"]: s for s in probe.stats}
    assert by_size[4].steps == 3 and by_size[8].steps == 3
    assert by_size[4].samples == 12 and by_size[8].samples == 24
    # zip asks the first loader, then the second: 4 readings a step for each. The first one's end
    # (StopIteration) closes its last step; the second's last step is still open.
    assert list(by_size[4].wait_times) == [1.0] * 3 and list(by_size[4].step_times) == [4.0] * 3
    assert list(by_size[8].step_times) == [4.0] * 2 and by_size[8].pending_start is not None
    recorded, _ = trace.spans_since("loader.wait", 0)
    starts = [start for start, _, _ in recorded]
    assert starts == sorted(starts) and len(starts) == 6


def train_run(flush_every: int | None, steps: int = 24) -> tuple[dict[str, Any], Trace]:
    trace = Trace(start_clock=0.0)
    probes = Probes(trace)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8)
    probes.poll()
    try:
        done = 0
        while done < steps:
            for (x,) in loader:
                probes.arm()  # a tick before every step: each step's wait is in a window
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == 2:
                    probes.poll()  # loads the FLOP counter (prepare) and flushes, as the sampler thread does
                elif flush_every and done % flush_every == 0:
                    probes.flush()  # what a tick does once a second (probes.FLUSH_EVERY_S)
                if done == steps:
                    break
    finally:
        probes.uninstall()
    facts = probes.facts({})
    return {"training": facts["training"], "loader": facts["loaders"][0]}, trace


def test_the_step_probes_spans_and_times_do_not_depend_on_when_they_are_made(clock):
    figures, trace = train_run(None)
    training = figures["training"]
    assert training["optimizer_steps"] == 24 and training["flops_per_step"] > 0
    # The counted step's time is kept apart, the others are step times.
    assert "flops_step_s" in training and len(training["step_times"]) == training["spanned_steps"] - 1
    assert len(trace.spans("train.step")) == training["spanned_steps"]
    between = trace.spans("train.between")
    assert len(between) == 23 and training["between_s"] == pytest.approx(sum(s.end - s.start for s in between))
    assert training["loop_s"] == pytest.approx(sum(training["step_times"]) + training["flops_step_s"])
    for flush_every in (1, 5):
        clock.reset()
        other, other_trace = train_run(flush_every)
        assert other == figures
        for kind in ("train.step", "train.between", "step", "loader.wait"):
            assert other_trace.spans(kind) == trace.spans(kind)


def test_ticks_make_spans_at_most_once_a_second_and_the_watchs_end_makes_the_rest(clock, monkeypatch):
    """A flush costs the sampler thread a fixed ~0.3 ms with the GIL held: ticks (4 a second by default)
    make spans once a second, and nothing the loop queued meanwhile is lost."""
    monotonic = [49.8]
    monkeypatch.setattr(gpuwidget.probes.time, "monotonic", lambda: monotonic[0])
    trace = Trace(start_clock=0.0)
    probes = Probes(trace)
    probes.poll()  # installs
    loader = DataLoader(TensorDataset(torch.zeros(80, 1)), batch_size=8)
    try:
        monotonic[0] = 49.9
        probes.poll()  # a tick before the loop starts: nothing queued, so it does not count as a flush
        monotonic[0] = 50.0
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        probes.poll()  # the first tick the loop's records come to makes spans at once
        assert len(trace.spans("loader.wait")) == 3
        for at in (50.25, 50.5, 50.99):  # the next ticks within the second leave the records queued
            next(batches)
            monotonic[0] = at
            probes.poll()
        assert len(trace.spans("loader.wait")) == 3
        monotonic[0] = 51.0
        probes.poll()
        assert len(trace.spans("loader.wait")) == 6
        next(batches)
    finally:
        probes.uninstall()
    assert len(trace.spans("loader.wait")) == 7  # the watch's end: everything queued
    assert probes.facts({})["loaders"][0]["steps"] == 7
