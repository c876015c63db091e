"""The stack sampler (gpuwidget.probes.stack): which frame a sample names, which spans it falls in,
how the user's code is named, and that a watch leaves nothing of it behind.

The attribution tests drive :meth:`StackSampler.tick` by hand against a real thread parked in a
function of this file, with spans written into a real Trace around the samples, so what each
sample falls in is known exactly.
"""

from __future__ import annotations

import contextlib
import gc
import linecache
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpuwidget
from gpuwidget import sampler as sampler_module
from gpuwidget.clock import now
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN, Probes
from gpuwidget.probes import stack as stack_module
from gpuwidget.probes.stack import (
    BETWEEN_STEPS_SPAN,
    TRAIN_STEP_SPAN,
    StackSampler,
    display_path,
    host_copy,
    is_user_frame,
    user_name,
)
from gpuwidget.trace import Trace

from support import sampler_threads

# The spans' names as CONTRACT.md gives them (the step probe defines them in gpuwidget.probes).
assert (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN) == ("train.step", "train.between")


def parked_here(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()  # the line a sample of the parked thread names


def calls_parked(started: threading.Event, release: threading.Event, via: Any = None) -> None:
    (via or parked_here)(started, release)  # the outermost frame of the user's on the parked thread


class ParksInForward(torch.nn.Module):
    """A module whose forward parks: the thread is inside torch's work (a module call) while it waits."""

    def forward(self, started: threading.Event, release: threading.Event) -> None:
        parked_here(started, release)


PARKED_LINE = parked_here.__code__.co_firstlineno + 2
CALLER_LINE = calls_parked.__code__.co_firstlineno + 1


@contextlib.contextmanager
def parked_thread(in_forward: bool = False) -> Iterator[threading.Thread]:
    """A thread waiting in ``parked_here`` (called from ``calls_parked``; ``in_forward``: through a
    module's forward, torch's work) until the block ends."""
    started, release = threading.Event(), threading.Event()
    via = ParksInForward() if in_forward else None
    thread = threading.Thread(target=calls_parked, args=(started, release, via), name="parked")
    thread.start()
    started.wait(5)
    try:
        yield thread
    finally:
        release.set()
        thread.join(5)


def sample_between(sampler: StackSampler, trace: Trace, kinds: tuple[str, ...]) -> None:
    """One sample with a span of each of ``kinds`` around it, recorded after the sample (as probes do)."""
    start = trace.now()
    time.sleep(0.002)
    sampler.tick()
    time.sleep(0.002)
    end = trace.now()
    for kind in kinds:
        trace.add_span(kind, start, end)


def test_a_sample_inside_train_between_names_the_function_the_thread_waits_in():
    trace = Trace()
    with parked_thread(in_forward=True) as thread:
        sampler = StackSampler(trace, thread.ident)
        for _ in range(3):
            sample_between(sampler, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        for _ in range(2):  # computing: in a step, in torch's work (the model's forward), not between steps
            sample_between(sampler, trace, (TRAIN_STEP_SPAN,))
        sampler.tick()  # after the last step: not in the loop
        waits, stack = sampler.facts({"parked_here": parked_here})
    assert stack["basis"] == BETWEEN_STEPS_SPAN and stack["samples"] == 6
    assert stack["loop_samples"] == 5 and stack["steps"] == 5
    [wait] = waits
    assert (wait["function"], wait["line"], wait["samples"]) == ("parked_here", PARKED_LINE, 3)
    assert wait["share"] == pytest.approx(3 / 5)
    assert wait["file"] == display_path(__file__) and not wait["file"].startswith("/")  # relative to the cwd
    assert wait["cell"] is None and wait["name"] == "parked_here" and wait["in_loader"] == 0.0
    assert not wait["in_loop"]  # called by the loop's code (calls_parked, the model's caller): one to prefetch
    assert wait["called_from"]["function"] == "calls_parked" and wait["called_from"]["line"] == CALLER_LINE
    assert wait["source"] == "release.wait()  # the line a sample of the parked thread names"
    loop_s = trace.span_stats(TRAIN_STEP_SPAN).total
    assert wait["seconds"] == pytest.approx(0.6 * loop_s)


def calls_the_model(started: threading.Event, release: threading.Event) -> None:
    ParksInForward()(started, release)  # the loop's code: it calls torch's work


def holds_the_loop(in_model: threading.Event, model_done: threading.Event, waiting: threading.Event,
                   release: threading.Event) -> None:
    calls_the_model(in_model, model_done)  # a step (Lightning's fit, called from the script's cli_main)
    waiting.set()
    release.wait()  # between steps, the thread waits here: inside the loop's own machinery


# A training framework's loop code (Lightning's fit loop) between steps, as its module names it.
FRAMEWORK: dict[str, Any] = {"__name__": "lightning.pytorch.loops.fit_loop"}
exec(compile("def between_steps(release):\n    release.wait()\n", "<lightning's fit loop>", "exec"), FRAMEWORK)


def fits_in_a_framework(in_model: threading.Event, model_done: threading.Event, waiting: threading.Event,
                        release: threading.Event) -> None:
    calls_the_model(in_model, model_done)  # a step
    waiting.set()
    FRAMEWORK["between_steps"](release)  # trainer.fit(): between steps the framework's loop runs


def starts_the_script(*events: threading.Event, holder: Any = holds_the_loop) -> None:
    holder(*events)  # the script's own outermost line


@pytest.mark.parametrize(("holder", "in_framework"), [(holds_the_loop, 0.0), (fits_in_a_framework, 1.0)])
def test_a_wait_in_a_function_around_the_loops_code_is_the_loops_own_not_one_to_prefetch(holder, in_framework):
    """Lightning's loop runs inside ``trainer.fit``, called from the script's ``cli_main()``: waits in the
    framework between steps land on ``cli_main``, around the code that calls the model, which is the
    loop's own and nothing to prefetch (fresh-check run 19 was told ``cli_main = Prefetcher(cli_main)``),
    and the samples say the framework's code ran there (``in_framework``), not the user's line."""
    trace = Trace()
    in_model, model_done, waiting, release = (threading.Event() for _ in range(4))
    thread = threading.Thread(target=starts_the_script, args=(in_model, model_done, waiting, release),
                              kwargs={"holder": holder})
    thread.start()
    try:
        in_model.wait(5)
        sampler = StackSampler(trace, thread.ident)
        for _ in range(3):  # computing: in the model's forward, called by calls_the_model
            sample_between(sampler, trace, (TRAIN_STEP_SPAN,))
        model_done.set()
        waiting.wait(5)
        for _ in range(3):
            sample_between(sampler, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        waits, _ = sampler.facts({})
    finally:
        model_done.set()
        release.set()
        thread.join(5)
    [wait] = [wait for wait in waits if wait["function"] == holder.__name__]
    assert wait["called_from"]["function"] == "starts_the_script" and wait["samples"] == 3
    assert wait["in_loop"]  # a function the loop calls is not (the first test of this file)
    assert wait["in_framework"] == in_framework


def test_spans_that_reach_the_trace_ticks_later_still_attribute_the_samples_they_hold():
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        start = trace.now()
        for _ in range(4):  # four ticks inside one long wait, whose spans come only after all of them
            sampler.tick()
            time.sleep(0.001)
        end = trace.now()
        time.sleep(0.001)
        sampler.tick()  # after the step: outside the loop
        trace.add_span(BETWEEN_STEPS_SPAN, start, end)
        trace.add_span(TRAIN_STEP_SPAN, start - 0.001, end)
        sampler.tick()
        waits, stack = sampler.facts()
    assert stack["loop_samples"] == 4 and waits[0]["samples"] == 4 and waits[0]["share"] == 1.0


@contextlib.contextmanager
def tick_due_at(due: float) -> Iterator[None]:
    """This thread's ticks read as due at ``due`` (the sampler thread sets it before each tick)."""
    sampler_module._due.value = due
    try:
        yield
    finally:
        sampler_module._due.value = None


def test_a_sample_is_timed_by_when_its_tick_was_due_and_placed_only_where_it_was_read_inside_the_wait():
    """A tick due inside a wait but read after the wait ended (another thread held the GIL) counts as
    waiting, by its due time, but at no location: the stack read then shows where the loop went next
    (under %run in a kernel, the model's forward line took the collate_fn's waits)."""
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        # How late a read may come before it is dropped is not what this judges: a loaded host's 3 ms
        # sleep can outlast it (fresh-check run 64: the second read dropped, so unplaced).
        sampler.late_max_s = 60.0
        start, due = trace.now(), now()
        time.sleep(0.003)  # the tick comes late (the loop held the GIL)...
        end = trace.now()
        trace.add_span(BETWEEN_STEPS_SPAN, start, end)  # ...after the wait around its due time had ended
        trace.add_span(TRAIN_STEP_SPAN, start, end)
        with tick_due_at(due):
            sampler.tick()
        late_waits, late = sampler.facts()

        sampler = StackSampler(trace, thread.ident)
        sampler.late_max_s = 60.0
        start, due = trace.now(), now()
        time.sleep(0.003)
        with tick_due_at(due):
            sampler.tick()  # read late too, but while the wait still lasts
        end = trace.now()
        trace.add_span(BETWEEN_STEPS_SPAN, start, end)
        trace.add_span(TRAIN_STEP_SPAN, start, end)
        waits, stack = sampler.facts()
    assert late["loop_samples"] == 1 and late["unplaced"] == 1 and late_waits == [] and late["late_ms"] >= 3
    assert stack["loop_samples"] == 1 and stack["unplaced"] == 0 and waits[0]["share"] == 1.0
    assert waits[0]["function"] == "parked_here" and stack["late_ms"] >= 3


def test_waits_read_too_late_to_place_are_shared_out_among_the_waits_read_in_time():
    """Two ticks due in waits, one read after its wait had ended: both are waiting, and the one read
    inside its wait says where the loop waits: the location's share is both of them, not one."""
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        start, due = trace.now(), now()
        end = trace.now()
        trace.add_span(BETWEEN_STEPS_SPAN, start, end)
        trace.add_span(TRAIN_STEP_SPAN, start, end)
        with tick_due_at(due):
            sampler.tick()  # read after its wait ended: unplaced
        start, due = trace.now(), now()
        with tick_due_at(due):
            sampler.sample()  # read inside it: placed...
            sampler.tick()  # ...and the tick that follows only reads the spans
        end = trace.now()
        trace.add_span(BETWEEN_STEPS_SPAN, start, end)
        trace.add_span(TRAIN_STEP_SPAN, start, end)
        waits, stack = sampler.facts()
    assert stack["samples"] == 2 and stack["loop_samples"] == 2 and stack["unplaced"] == 1
    assert [(wait["function"], wait["samples"], wait["share"]) for wait in waits] == [("parked_here", 1, 1.0)]


def test_a_tick_due_in_one_wait_and_read_in_a_later_one_is_not_placed_in_the_later_one():
    """The GIL comes back where the loop next lets go of it, often a later wait's torch call (a
    periodic evaluation's). Read there, the stack shows that wait, not the one the tick was due in."""
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        sampler.late_max_s = 60.0  # how late a read may come is not what this judges
        first, due = trace.now(), now()
        time.sleep(0.001)
        first_end = trace.now()
        time.sleep(0.001)  # the step's own work between the two waits
        second = trace.now()
        with tick_due_at(due):
            sampler.tick()  # due in the first wait, read in the second
        time.sleep(0.001)
        end = trace.now()
        trace.add_span(BETWEEN_STEPS_SPAN, first, first_end)
        trace.add_span(BETWEEN_STEPS_SPAN, second, end)
        trace.add_span(TRAIN_STEP_SPAN, first, end)
        waits, stack = sampler.facts()
    assert stack["loop_samples"] == 1 and stack["unplaced"] == 1 and waits == []


def test_a_waits_step_ratio_says_whether_it_makes_some_steps_slow_or_is_in_every_step():
    """A wait seen only in a slow step (a periodic evaluation) reads that step over the usual one; a
    wait seen in every step reads about 1 (loop-waits leaves the first to periodic-stall)."""
    trace = Trace()
    with parked_thread() as thread:
        stalled = StackSampler(trace, thread.ident)
        start = trace.now()
        sample_between(stalled, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        slow_s = trace.now() - start
        usual = trace.now()
        for step in range(9):  # nine usual steps, 0.4 ms each, with no sample in them
            trace.add_span(TRAIN_STEP_SPAN, usual + 4e-4 * step, usual + 4e-4 * (step + 1))
        stalled.tick()
        stalled_waits, _ = stalled.facts()

        trace = Trace()
        every = StackSampler(trace, thread.ident)
        for _ in range(5):
            sample_between(every, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        every.tick()
        every_waits, _ = every.facts()
    assert stalled_waits[0]["step_ratio"] == pytest.approx(slow_s / 4e-4, rel=0.5) and slow_s / 4e-4 > 5
    assert every_waits[0]["samples"] == 5 and every_waits[0]["step_ratio"] == pytest.approx(1.0, rel=0.5)


def test_a_tick_read_long_after_it_was_due_counts_in_the_span_it_was_due_in_but_is_not_located():
    """Where the thread is when a tick is read long after it was due says nothing about where it was
    then. Left out, the ticks due while the loop held the GIL (its step) would be the ones missing,
    and the waits would read larger than they are (a nanoGPT fetch 0.11 over its share, fresh-check)."""
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        start = trace.now()
        with tick_due_at(now() - 2 * sampler.late_max_s):  # due in the step, read now: in a wait
            sampler.tick()
        wait_start, due = trace.now(), now()
        with tick_due_at(due):  # due and read in the wait: located
            sampler.tick()
        time.sleep(2 * sampler.late_max_s)
        with tick_due_at(due + 1e-6):  # due in the wait, read long after
            sampler.tick()
        trace.add_span(BETWEEN_STEPS_SPAN, wait_start, trace.now())
        trace.add_span(TRAIN_STEP_SPAN, start - 2 * sampler.late_max_s, trace.now())
        waits, stack = sampler.facts()
    assert sampler.dropped == 2 and stack["samples"] == 1 and stack["loop_samples"] == 3
    # Of the three ticks, two were due in the wait: one located there, one shared out as it was.
    assert stack["unplaced"] == 1 and [(wait["function"], wait["samples"]) for wait in waits] == [("parked_here", 1)]
    assert waits[0]["share"] == pytest.approx(2 / 3)


def test_a_wait_inside_a_dataloader_next_between_steps_is_counted_as_the_loaders():
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        sample_between(sampler, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN, DATA_WAIT_SPAN))
        sample_between(sampler, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        waits, _ = sampler.facts()
    assert waits[0]["samples"] == 2 and waits[0]["in_loader"] == 0.5


def test_a_child_processs_spans_do_not_make_this_threads_samples_a_loop():
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        start = trace.now()
        sampler.tick()
        end = trace.now()
        child = {"pid": 4242, "rank": 0}  # as gpuwidget.children records a child's spans
        trace.add_span(STEP_SPAN, start, end, child)
        trace.add_span(DATA_WAIT_SPAN, start, end, child)
        sample_between(sampler, trace, (STEP_SPAN, DATA_WAIT_SPAN))  # and one of this process's own
        waits, stack = sampler.facts()
    assert stack["loop_samples"] == 1 and waits[0]["samples"] == 1


def test_without_optimizer_steps_samples_are_attributed_to_the_loaders_waits():
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        sample_between(sampler, trace, (STEP_SPAN, DATA_WAIT_SPAN))
        sample_between(sampler, trace, (STEP_SPAN,))
        waits, stack = sampler.facts()
    assert stack["basis"] == DATA_WAIT_SPAN and stack["loop_samples"] == 2
    assert waits[0]["share"] == 0.5 and waits[0]["in_loader"] == 1.0


def test_optimizer_steps_are_the_basis_wherever_they_exist_beside_a_dataloader():
    trace = Trace()
    with parked_thread(in_forward=True) as thread:
        sampler = StackSampler(trace, thread.ident)
        sample_between(sampler, trace, (STEP_SPAN, DATA_WAIT_SPAN, TRAIN_STEP_SPAN))  # computing, by the optimizer
        sample_between(sampler, trace, (STEP_SPAN, TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        waits, stack = sampler.facts()
    assert stack["basis"] == BETWEEN_STEPS_SPAN and waits[0]["share"] == 0.5 and waits[0]["in_loader"] == 0.0


def test_a_wait_inside_the_step_outside_torchs_work_is_a_wait_as_nanogpts_fetch_after_forward_is():
    # nanoGPT fetches the next batch between a micro-step's forward and its backward: inside train.step.
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        for _ in range(3):
            sample_between(sampler, trace, (TRAIN_STEP_SPAN,))
        waits, stack = sampler.facts({"parked_here": parked_here})
    assert stack["basis"] == BETWEEN_STEPS_SPAN and stack["loop_samples"] == 3
    [wait] = waits
    assert (wait["function"], wait["samples"], wait["share"]) == ("parked_here", 3, 1.0)


def test_inside_the_step_the_loops_own_line_and_torchs_work_are_the_step_not_waits():
    trace = Trace()
    with parked_thread(in_forward=True) as thread:  # in a module's forward
        sampler = StackSampler(trace, thread.ident)
        sample_between(sampler, trace, (TRAIN_STEP_SPAN,))
        in_forward, _ = sampler.facts()
    started, release = threading.Event(), threading.Event()
    own_line = threading.Thread(target=parked_here, args=(started, release))  # the only frame of the user's
    own_line.start()
    started.wait(5)
    try:
        sampler = StackSampler(trace, own_line.ident)
        sample_between(sampler, trace, (TRAIN_STEP_SPAN,))
        loop_line, stack = sampler.facts()
    finally:
        release.set()
        own_line.join(5)
    assert in_forward == [] and loop_line == [] and stack["loop_samples"] == 1


def loop_like(events: list[tuple[threading.Event, threading.Event]]) -> None:
    """A training loop's shape: a call into torch's work (a module's forward), a helper it calls
    (a fetch), then a line of its own (a progress bar, ``loss.item()``), each parked in turn."""
    ParksInForward()(*events[0])
    parked_here(*events[1])
    events[2][0].set()
    events[2][1].wait()  # the loop's own line


def runs_loop_like(events: list[tuple[threading.Event, threading.Event]]) -> None:
    loop_like(events)  # as %run or a script's main() calls the loop: a frame of the user's above it


def sampled_in_turn(loop: Any, sample: Any) -> tuple[Trace, StackSampler, float]:
    """``loop`` run on a thread of its own through the three places it parks in, two samples taken in
    each by ``sample(sampler, trace)``: the trace, the sampler and the trace's time before the first."""
    trace = Trace()
    events = [(threading.Event(), threading.Event()) for _ in range(3)]
    thread = threading.Thread(target=loop, args=(events,))
    thread.start()
    try:
        sampler = StackSampler(trace, thread.ident)
        start = trace.now()
        for started, release in events:
            started.wait(5)
            for _ in range(2):
                sample(sampler, trace)
            release.set()
    finally:
        for _, release in events:
            release.set()
        thread.join(5)
    return trace, sampler, start


def test_inside_the_step_a_line_of_the_loop_that_calls_torchs_work_is_the_step_not_a_wait():
    _, sampler, _ = sampled_in_turn(runs_loop_like, lambda sampler, trace: sample_between(
        sampler, trace, (TRAIN_STEP_SPAN,)))
    waits, stack = sampler.facts()
    assert stack["loop_samples"] == 6
    # In the forward: torch's work. In parked_here: a wait. On loop_like's own line: the loop's code
    # (it called into torch's work), so the step's own, although a frame of the user's is above it.
    assert [(wait["function"], wait["samples"]) for wait in waits] == [("parked_here", 2)]


def own_line_first(events: list[tuple[threading.Event, threading.Event]]) -> None:
    """A loop's step that starts on a line of its own (a timer, a log), then calls into torch's work
    (a module's forward) and a helper (a fetch), each parked in turn."""
    events[0][0].set()
    events[0][1].wait()  # the loop's own line, before its forward
    ParksInForward()(*events[1])
    parked_here(*events[2])


def runs_own_line_first(events: list[tuple[threading.Event, threading.Event]]) -> None:
    own_line_first(events)


def test_samples_whose_spans_arrive_together_know_the_loops_code_from_all_of_them():
    # The probes make spans once a second (probes.FLUSH_EVERY_S): a watch's first second of samples is
    # judged at once, before any had shown which of the user's functions calls into torch's work. The
    # loop's own line, sampled before its first forward, is the step's, not a wait to prefetch.
    def sample_alone(sampler: StackSampler, _trace: Trace) -> None:
        time.sleep(0.002)
        sampler.sample()  # the sample alone: no spans have reached the trace yet
        sampler._sampled = False

    trace, sampler, start = sampled_in_turn(runs_own_line_first, sample_alone)
    trace.add_span(TRAIN_STEP_SPAN, start, trace.now())  # the second's spans, at once
    waits, stack = sampler.facts()
    assert stack["loop_samples"] == 6
    assert [(wait["function"], wait["samples"]) for wait in waits] == [("parked_here", 2)]


def test_a_step_sample_read_late_between_steps_is_not_a_wait_inside_the_step(monkeypatch):
    # Due while the step computed, read once the loop released the GIL in the next step's fetch: where
    # the stack was read is not where the thread was when the sample was due.
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        due = now()
        monkeypatch.setattr(stack_module, "tick_due", lambda: due)
        step_start = due - trace.start_clock - 0.01
        time.sleep(0.003)
        sampler.tick()  # read 3 ms after it was due
        read_at = trace.now()
        trace.add_span(TRAIN_STEP_SPAN, step_start, due - trace.start_clock + 0.001)  # ended 1 ms after due
        trace.add_span(BETWEEN_STEPS_SPAN, due - trace.start_clock + 0.001, read_at + 0.001)
        trace.add_span(TRAIN_STEP_SPAN, due - trace.start_clock + 0.001, read_at + 0.002)
        waits, stack = sampler.facts()
    assert stack["loop_samples"] == 1 and waits == []


def test_samples_of_a_loop_that_never_had_steps_stay_bounded_and_report_nothing():
    trace = Trace()
    with parked_thread() as thread:
        sampler = StackSampler(trace, thread.ident)
        for _ in range(stack_module.MAX_PENDING + 50):
            sampler.tick()
        assert len(sampler.optimizer.pending) == stack_module.MAX_PENDING
        assert len(sampler.recent) == stack_module.RECENT_SAMPLES
        waits, stack = sampler.facts()
    assert waits == [] and stack["loop_samples"] == 0 and stack["samples"] == stack_module.MAX_PENDING + 50
    assert sampler.optimizer.pending  # left as they were: no span ever decided them
    assert stack["tick_us"] > 0


def test_library_frames_are_skipped_down_to_the_users_own():
    frame = sys._getframe()
    assert is_user_frame(frame)  # this test file
    assert not is_user_frame(_frame_in(threading.Event.wait))  # type: ignore[arg-type]
    assert not is_user_frame(_frame_in(torch.nn.Module.__call__))  # type: ignore[arg-type]


def _frame_in(function: object) -> object:
    """A frame whose code is ``function``'s and whose globals are its module's (what the walk sees)."""

    class Frame:
        f_code = function.__code__  # type: ignore[attr-defined]
        f_globals = function.__globals__  # type: ignore[attr-defined]

    return Frame()


@pytest.mark.skipif(not stack_module.FRAMES_NEED_COLLECTOR_OFF,
                    reason="this Python starts no garbage collection inside a call that reads frames")
def test_reading_a_threads_frames_starts_no_garbage_collection_where_python_starts_one():
    """CPython 3.11 collects inside allocations, and reading another thread's frames allocates their
    frame objects. A collection inside ``sys._current_frames()`` deadlocks before 3.11.9 (CPython
    gh-106883; a sampler hung so in CI); one inside ``f_back`` whose finalizer lets go of the GIL leaves
    a frame object on freed memory (a fresh process died of SIGSEGV in the sampler so, in CI). The
    sampler's read starts none, where the bare read, made the same way, does."""
    started_in: list[str] = []

    def note_where_a_collection_starts(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_in.append(sys._getframe(1).f_code.co_name)  # the frame the collection interrupted

    def bare_read(thread_id: int) -> list[Any]:
        frames, frame = [], sys._current_frames().get(thread_id)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return frames

    thresholds = gc.get_threshold()
    gc.callbacks.append(note_where_a_collection_starts)
    try:
        for read in (bare_read, stack_module.thread_stack):
            for _ in range(20):
                # Two threads whose frames have no frame object yet: the read makes them, allocating.
                with parked_thread() as thread, parked_thread():
                    gc.set_threshold(1)  # a collection at every other allocation
                    try:
                        frames = read(thread.ident)
                    finally:
                        gc.set_threshold(*thresholds)
                    assert parked_here.__code__ in [frame.f_code for frame in frames]  # the parked thread's
    finally:
        gc.callbacks.remove(note_where_a_collection_starts)
    assert started_in.count("bare_read") > 0, "the hazard did not show: the test proves nothing here"
    assert started_in.count("thread_stack") == 0


def test_the_watched_thread_itself_never_samples():
    trace = Trace()
    sampler = StackSampler(trace)
    sampler.tick()
    assert sampler.samples == 0


def test_the_users_name_for_a_function_or_a_method_is_found_in_the_namespace():
    class Batcher:
        def next(self) -> None:
            return None

    def get_batch() -> None:
        return None

    batcher = Batcher()
    namespace = {"get_batch": get_batch, "batcher": batcher, "_hidden": get_batch}
    assert user_name(get_batch.__code__, namespace) == "get_batch"
    assert user_name(Batcher.next.__code__, namespace) == "batcher.next"
    assert user_name(Batcher.next.__code__, {"bound": batcher.next}) == "bound"
    assert user_name(get_batch.__code__, {"_hidden": get_batch}) is None


def test_functions_of_a_notebook_cell_are_named_by_the_cells_number(ip):
    ip.run_cell("import threading\n"
                "def parked(started, release):\n"
                "    started.set()\n"
                "    release.wait()\n", store_history=True)
    defined_in = ip.execution_count - 1
    parked = ip.user_ns["parked"]
    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=parked, args=(started, release))
    thread.start()
    started.wait(5)
    trace = Trace()
    sampler = StackSampler(trace, thread.ident)
    try:
        sample_between(sampler, trace, (TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN))
        waits, _ = sampler.facts(ip.user_ns)
    finally:
        release.set()
        thread.join(5)
    assert (waits[0]["function"], waits[0]["cell"], waits[0]["line"]) == ("parked", defined_in, 4)
    assert waits[0]["name"] == "parked" and waits[0]["source"] == "release.wait()"


# --------------------------------------------------------------------------- host-to-device copies


@pytest.fixture
def source_file(tmp_path):
    """Register ``text`` as a file's source (as IPython does a cell's) and return its name."""
    made = []

    def make(text: str) -> str:
        path = tmp_path / f"loop{len(made)}.py"
        path.write_text(text)
        made.append(str(path))
        return str(path)

    yield make
    for path in made:
        linecache.checkcache(path)


def test_a_tensor_copied_at_every_step_is_moved_once_in_the_users_names(source_file):
    file = source_file("device = 'cpu'\n"
                       "X = torch.randn(64, 4)\n"
                       "for step in range(10):\n"
                       "    xb, yb = X.to(device), Y.to(device, non_blocking=False)\n"
                       "    loss = model(xb)\n")
    X, Y = torch.randn(64, 4), torch.randn(64)
    namespace = {"device": "cpu", "X": X, "Y": Y}
    found = host_copy(file, 4, namespace)
    assert found is not None and found["tensors"] == ["X", "Y"] and found["same_each_step"]
    assert found["once"] == "X = X.to(device)\nY = Y.to(device, non_blocking=False)"
    assert found["rewritten"] == ("xb, yb = (X.pin_memory().to(device, non_blocking=True), "
                                  "Y.pin_memory().to(device, non_blocking=True))")
    exec(found["once"], namespace)  # runs as pasted, and the data stays the same
    assert torch.equal(namespace["X"], X) and torch.equal(namespace["Y"], Y)


def test_a_batch_assigned_in_the_loop_is_not_the_same_tensor_each_step(source_file):
    file = source_file("for x in batches:\n"
                       "    xb = x.to(device)\n"
                       "def fetch(i):\n"
                       "    part = X[i]\n"
                       "    return part.cuda(), X.to(device)\n")
    namespace = {"device": "cpu", "x": torch.randn(2), "X": torch.randn(4, 2), "part": torch.randn(2)}
    in_loop = host_copy(file, 2, namespace)
    assert in_loop is not None and not in_loop["same_each_step"] and in_loop["once"] is None
    in_function = host_copy(file, 5, namespace)
    assert in_function is not None and in_function["tensors"] == ["part", "X"] and not in_function["same_each_step"]
    assert in_function["rewritten"] == ("return (part.pin_memory().cuda(non_blocking=True), "
                                        "X.pin_memory().to(device, non_blocking=True))")


def test_a_copy_already_pinned_and_non_blocking_needs_no_rewrite(source_file):
    file = source_file("x = x.pin_memory().to(device, non_blocking=True)\nprint(x)\n")
    found = host_copy(file, 1, {})
    assert found is not None and found["rewritten"] is None
    assert host_copy(file, 2, {}) is None  # no copy on that line


def test_moving_once_is_written_only_with_names_the_user_has(source_file):
    file = source_file("def step(dev):\n    return X.to(dev)\n")
    found = host_copy(file, 2, {"X": torch.randn(3)})
    assert found is not None and found["same_each_step"] and found["once"] is None  # dev: the function's parameter
    file = source_file("for i in range(3):\n    xb = X.to(dev)\n")
    found = host_copy(file, 2, {"X": torch.randn(3)})
    assert found is not None and found["same_each_step"] and found["once"] is None  # dev: nowhere
    found = host_copy(file, 2, {"X": torch.randn(3), "dev": "cpu"})
    assert found is not None and found["once"] == "X = X.to(dev)"
    found = host_copy(file, 2, {"X": [1, 2], "dev": "cpu"})
    assert found is not None and not found["same_each_step"]  # not a tensor of the user's


# --------------------------------------------------------------------------- in a watch


def fetch_slowly(seconds: float) -> None:
    time.sleep(seconds)


def test_a_watch_samples_the_thread_that_started_it_and_ends_with_it():
    with gpuwidget.watch(quiet=True, interval=0.01) as run:
        deadline = time.perf_counter() + 0.4
        while time.perf_counter() < deadline:
            fetch_slowly(0.005)
    stack = run.workload["stack_samples"]
    assert stack["samples"] + stack["dropped"] >= 10 and stack["samples"] >= 1 and stack["tick_us"] > 0
    assert run.workload["loop_waits"] == []  # no loop spans: no loop to attribute to
    assert not sampler_threads()


@pytest.mark.parametrize("raised", [ValueError("in the cell"), KeyboardInterrupt()])
def test_the_stack_sampler_is_closed_and_no_thread_remains_after_a_failed_or_interrupted_watch(raised):
    built: list[Probes] = []
    original = Probes.__init__

    def keep(self: Probes, trace: Trace) -> None:
        original(self, trace)
        built.append(self)

    with contextlib.ExitStack() as undo:
        undo.callback(setattr, Probes, "__init__", original)
        Probes.__init__ = keep  # type: ignore[method-assign]
        with pytest.raises(type(raised)), gpuwidget.watch(quiet=True, interval=0.01):
            fetch_slowly(0.2)
            raise raised
    sampler = built[0]._stack
    assert sampler._closed and sampler._user == {}
    samples = sampler.samples
    late = threading.Thread(target=sampler.tick)  # a tick after the watch (a sampler thread left behind)...
    late.start()
    late.join(5)
    assert sampler.samples == samples and samples + sampler.dropped >= 3  # ...takes nothing
    assert not sampler_threads()


class Batch:
    """Something a frame of the user's holds while it is sampled."""


def fetch_holding(batch: Batch, seconds: float) -> None:
    time.sleep(seconds)


def fetch_a_batch() -> weakref.ref[Batch]:
    batch = Batch()
    fetch_holding(batch, 0.3)
    return weakref.ref(batch)


def test_the_sampler_keeps_no_frame_of_the_users_alive():
    with gpuwidget.watch(quiet=True, interval=0.01) as run:
        alive = fetch_a_batch()
    gc.collect()
    assert alive() is None and run.workload["stack_samples"]["samples"] >= 3


def test_the_stack_sampler_lives_in_the_watch_only_not_in_a_childs_span_buffer():
    from gpuwidget.children.agent import SpanBuffer

    assert Probes(SpanBuffer())._stack is None  # type: ignore[arg-type]
    assert isinstance(Probes(Trace())._stack, StackSampler)


@pytest.mark.serial  # a cause judged from a watched loop's timing: alone (beside xdist's workers it missed once)
def test_the_step_probes_real_spans_attribute_a_slow_batch_function():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(4096, 16)

    def next_batch() -> torch.Tensor:
        time.sleep(0.02)  # most of a step even when contention for the cores makes the math 10x slower
        return data[torch.randint(len(data), (32,))]

    # 100 steps of at least 20 ms: past the evidence gate's second of steady steps on any machine.
    with gpuwidget.watch(quiet=True, interval=0.01) as run:
        for _ in range(100):
            loss = model(next_batch()).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert run.workload["stack_samples"]["basis"] == "train.between"
    assert run.workload["loop_waits"][0]["function"] == "next_batch"
    assert any(f.rule == "loop-waits" for f in run.findings), (
        [f.title[:80] for f in run.findings], run.workload["loop_waits"][0]["share"],
        {key: run.summary.get(key) for key in ("steps", "warmup_steps", "warmup_s", "step_time_p50")})


class Tokenizer:
    def __call__(self, text: str) -> str:
        return "".join(ch for ch in text)


def test_a_generator_expression_is_named_by_the_function_around_it_a_nested_function_by_its_own():
    from gpuwidget.probes.stack import code_site

    codes = Tokenizer.__call__.__code__.co_consts
    genexpr = next(const for const in codes if isinstance(const, type(parked_here.__code__)))

    def collate_fn(batch: list[Any]) -> list[Any]:
        return batch

    assert code_site(genexpr, 1)["function"] == "Tokenizer.__call__.<genexpr>"
    assert code_site(collate_fn.__code__, 1)["function"] == "collate_fn"
    assert code_site(parked_here.__code__, 1)["function"] == "parked_here"
