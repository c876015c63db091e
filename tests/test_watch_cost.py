"""What watching costs, said where it costs too much: the sampler charges each part of a tick its
thread CPU (saved with the run), and a run whose sampler took more than its share names the part."""

from __future__ import annotations

import time

import pytest

from gpuwidget.options import WatchOptions
from gpuwidget.report import WATCH_COST_MIN_TICKS, gpu_lines, run_text, watch_cost_notes
from gpuwidget.run import Run
from gpuwidget.sampler import Sampler
from gpuwidget.trace import Trace


class Spinning:
    """A source whose read spends ``cpu_s`` of this thread's CPU."""

    def __init__(self, name: str, cpu_s: float) -> None:
        self.name, self.cpu_s = name, cpu_s

    def read(self) -> dict[str, float]:
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return {f"{self.name}.value": 1.0}


def test_each_part_of_a_tick_is_charged_its_own_cpu_and_the_parts_add_up():
    heavy, light = Spinning("nvml", 0.004), Spinning("host", 0.0)
    sampler = Sampler([heavy, light], Trace(), interval=1.0, listeners=[lambda trace: None],
                      first=[lambda trace: None])
    for _ in range(5):
        sampler.tick()
    parts = sampler.stats.part_cpu_s
    assert set(parts) == {"stack sample", "nvml", "host", "trace row", "listeners"}
    assert parts["nvml"] >= 5 * 0.004 and parts["nvml"] > 4 * parts["host"]
    assert sum(parts.values()) == pytest.approx(sampler.stats.cpu_time_s, rel=1e-9)


def run_with(ticks: int, cpu_s: float, duration_s: float, parts: dict[str, float] | None = None) -> Run:
    sampler = {"ticks": ticks, "missed_ticks": 0, "cpu_time_s": cpu_s, "errors": [], "stalled": []}
    if parts is not None:
        sampler["part_cpu_s"] = parts
    return Run(trace=Trace(), summary={"duration_s": duration_s, "steps": 100}, options=WatchOptions(),
               finished=True, sampler=sampler)


def test_a_watch_that_cost_more_than_its_share_says_how_much_and_where():
    # As on the H200 machine: 32 ticks at 0.1 s, 0.206 s of the sampler's CPU over a 3 s watch.
    run = run_with(32, 0.206, 3.0, {"nvml": 0.03, "host": 0.15, "trace row": 0.006, "listeners": 0.02})
    [note] = watch_cost_notes(run)
    assert note == ("watching took 6.9% of a core here (6.4 ms a tick, most of it the host's /proc reads, "
                    "4.7 ms): a longer --interval costs less")
    assert note in gpu_lines(run) and note in run_text(run)
    # A run saved before the parts were kept still says what it cost.
    assert watch_cost_notes(run_with(32, 0.206, 3.0)) == [
        "watching took 6.9% of a core here (6.4 ms a tick): a longer --interval costs less"]


@pytest.mark.parametrize(("ticks", "cpu_s"), [(400, 0.9), (WATCH_COST_MIN_TICKS - 1, 0.5)])
def test_a_watch_within_its_share_or_too_short_to_tell_says_nothing(ticks, cpu_s):
    # 0.9 s over 100 s is 0.9% of a core; a cell of a few ticks is mostly its one-off first ticks.
    assert watch_cost_notes(run_with(ticks, cpu_s, 100.0 if ticks == 400 else 2.0, {"host": cpu_s})) == []
