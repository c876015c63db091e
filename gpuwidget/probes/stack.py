"""The watched thread's stack, sampled at each sampler tick: where the training loop waits between steps.

A statistical profile, as py-spy and Scalene take one: nothing of the user's is wrapped or traced.
At every tick the sampler thread reads the watched thread's current frame
(``sys._current_frames()``) and keeps the innermost frame of the user's own code (torch,
gpuwidget, the frameworks, the standard library and installed packages skipped: a wait inside
``time.sleep`` or ``torch.stack`` is charged to the user's line that called it) and the outermost
one (the cell's or script's line, for context), with the tick's Trace time.

A sample is timed by when its tick was due (``sampler.tick_due``), not by when the sampler thread
got the GIL: while the loop's Python holds the GIL the sampler gets it at the loop's next release,
often a wait, and timing by that moment would inflate the waits. It is attributed once the spans
around it reach the Trace: probes queue a span when it ends and the sampler moves it in at a later
tick, so samples wait in a bounded queue until a span of the loop's kind has ended after them, and
one tick more (each probe's spans arrive on their own). Two bases are kept side by side and the one
the loop had is reported: with optimizer steps, samples inside ``train.step`` spans are the loop and those inside
``train.between`` spans (an optimizer step's end to the next forward) are it waiting; without them,
``step`` and ``loader.wait`` spans of the DataLoader. Inside ``train.between``, a sample that is
also inside a DataLoader's ``next()`` is counted as such, so the rules can leave those waits to
the DataLoader's own measurements.

A loop can also wait inside its step: nanoGPT's ``train.py`` fetches the next batch between a
micro-step's forward and its backward. With optimizer steps, a sample inside ``train.step`` is a
wait too when the thread was outside torch's work (no frame of torch's own code on its stack but
the DataLoader's: not in the model's forward, backward, optimizer step or loss) and in a function the
loop's own code called: a line of the loop itself (``loss.item()`` on a GPU, a progress bar) is the
step's own. The loop's code is the one that calls into torch's work most often in the samples inside
the steps (the outermost frame of the user's just outside a frame of torch's: the line calling
``model(x)``, ``loss.backward()``, ``optimizer.step()``).

Cost: one sample walks the watched thread's frames once (a cached verdict per code object) and
places the few pending samples in the new spans by bisection; reading the new spans from the Trace
is the part that grows with the step rate (tens of nanoseconds a span). BENCHMARKS.md ("Stack
sampler") has the figures. What the stack shows is biased the same way as the timing: the frame
read is where the loop released the GIL (sleeping, I/O, torch's C code) or reached the
interpreter's switch interval (5 ms), so a wait is found where it is and a line of Python within a
few milliseconds of where it ran.
"""

from __future__ import annotations

import ast
import builtins
import copy
import gc
import linecache
import math
import os
import site
import sys
import sysconfig
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from inspect import CO_GENERATOR
from types import CodeType, FrameType
from typing import Any

import numpy as np

from gpuwidget.clock import now
from gpuwidget.facts import CodeSite, HostCopy, LoopWait, StackFacts
from gpuwidget.probes import BETWEEN_STEPS_SPAN, DATA_WAIT_SPAN, STEP_SPAN, TRAIN_STEP_SPAN
from gpuwidget.probes.origin import FRAMEWORKS, LIBRARIES, display_path, notebook_cell, parse_source
from gpuwidget.sampler import tick_due

# Samples waiting for the spans that decide them. At the default 4 Hz that is 17 minutes of
# samples; a basis whose loop spans never come (no optimizer steps) drops its oldest.
MAX_PENDING = 4096
# The newest samples kept as taken (time, location), for inspection and tests.
RECENT_SAMPLES = 1024
# Distinct (function line, cell line) locations counted per basis; more fall into one "elsewhere".
MAX_LOCATIONS = 512
# Frames walked per sample: deeper than any framework's fit loop (origin.MAX_FRAMES is 80), and a
# bound on a deep recursion's cost.
MAX_DEPTH = 256
# A sample is in a span when the first span ending after it, or one of the few after that, starts
# before it (spans of one kind arrive in the order they end; nested loaders' steps may overlap).
OVERLAP_SCAN = 8
# A tick read more than this many GIL switch intervals (5 ms by default) after it was due is not sampled.
LATE_SWITCHES = 2
# Durations kept, per location, of the loop steps its waits fell in (the newest).
WAIT_STEP_DURATIONS = 256
# Functions reported in WorkloadFacts["loop_waits"], largest share first.
LOOP_WAITS = 5
# Host-to-device copy methods of a tensor.
COPY_METHODS = ("to", "cuda")

# A sample: (trace time, location). Location: (innermost user code, its line, outermost user code,
# its line), or None when no frame of the user's was on the stack.
# torch's packages whose frames are not the step's work: a DataLoader's next() is a wait (the
# DataLoader rules judge it), gpuwidget's own frames are nobody's work.
NOT_TORCH_WORK = ("torch.utils.data",)
Location = tuple[CodeType, int, CodeType, int]
# Spans of one kind, ordered by end: their start and end times on the Trace's clock.
Spans = tuple[np.ndarray, np.ndarray]
_ELSEWHERE: Any = None  # the bucket for locations beyond MAX_LOCATIONS

# CPython 3.11 can start a garbage collection inside any allocation, and reading another thread's
# frames allocates: the frame objects sys._current_frames() and each f_back make. A collection runs
# finalizers, and one that lets go of the GIL lets the other threads run in the middle of the read:
# * inside sys._current_frames(), before 3.11.9, a thread that is starting or ending then waits
#   forever for the list of threads the call holds locked (CPython gh-106883; a sampler hung so
#   beside a `Thread.start()` in the test suite);
# * inside f_back, the watched thread can return from the frame whose frame object is being made,
#   which is left pointing at freed memory, and reading it kills the process with SIGSEGV (a fresh
#   process's first watched cells, in CI; the profilers of sentry-python and dd-trace-py crash alike).
# The sampler turns the collector off while it reads the frames. 3.12 collects only between
# bytecodes, never inside a call.
FRAMES_NEED_COLLECTOR_OFF = (3, 11) <= sys.version_info[:2] < (3, 12)


def _library_prefixes() -> tuple[str, ...]:
    """Folders whose files are not the user's: the standard library and installed packages."""
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.add(os.path.dirname(os.__file__))
    try:
        folders.update(site.getsitepackages())
        folders.add(site.getusersitepackages())
    except AttributeError:  # an embedded or virtualenv-patched site module without them
        pass
    out = set()
    for folder in folders:
        for form in (folder, os.path.realpath(folder)):
            out.add(os.path.join(form, ""))
    return tuple(sorted(out))


_LIBRARY_PREFIXES = _library_prefixes()


def thread_stack(thread_id: int, limit: int = MAX_DEPTH) -> list[FrameType]:
    """The frames of the thread with this ``threading.get_ident()``, innermost first (none when it has
    none), at most ``limit``; read without the hazards of :data:`FRAMES_NEED_COLLECTOR_OFF`."""
    collector_off = FRAMES_NEED_COLLECTOR_OFF and gc.isenabled()
    # Left off where it was off. Another thread turning it off within this read is undone (CPython's
    # own fix of the deadlock has the same window, between its check and its call).
    if collector_off:
        gc.disable()
    try:
        frames: list[FrameType] = []
        frame = sys._current_frames().get(thread_id)
        while frame is not None and len(frames) < limit:
            frames.append(frame)
            frame = frame.f_back
        return frames
    finally:
        if collector_off:
            gc.enable()


def is_user_frame(frame: FrameType) -> bool:
    """The frame runs the user's code: not torch, gpuwidget or a framework (``origin.LIBRARIES``),
    not the standard library or an installed package, not generated code (``<string>``)."""
    name = frame.f_globals.get("__name__")
    if isinstance(name, str) and name.split(".")[0] in LIBRARIES:
        return False
    file = frame.f_code.co_filename
    if file.startswith("<"):
        return file.startswith("<ipython-input")  # IPython's older names for cells
    return not file.startswith(_LIBRARY_PREFIXES)


def is_torch_work(frame: FrameType) -> bool:
    """The frame is torch's own code doing the step's work (a module's forward, autograd, an
    optimizer, a loss), not a DataLoader's ``next()`` (:data:`NOT_TORCH_WORK`)."""
    name = frame.f_globals.get("__name__")
    return (isinstance(name, str) and (name == "torch" or name.startswith("torch."))
            and not name.startswith(NOT_TORCH_WORK))


def is_framework(frame: FrameType) -> bool:
    """The frame is a training framework's code (Lightning, the HF Trainer, accelerate: ``origin.FRAMEWORKS``)."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and name.split(".")[0] in FRAMEWORKS


class _Basis:
    """Samples attributed against one pair of span kinds: the loop's steps and the waits inside them."""

    def __init__(self, loop_kind: str, wait_kind: str, inside_kind: str | None = None) -> None:
        self.loop_kind = loop_kind
        self.wait_kind = wait_kind
        self.inside_kind = inside_kind  # also counted: waits inside spans of this kind
        self.kinds = (loop_kind, wait_kind, *([inside_kind] if inside_kind else []))
        # [time, location, in a wait span, in an inside span, outside torch's work in a function of the
        #  user's, when it was read, read inside a wait span, caller, in torch's work, in a framework's code]
        self.pending: deque[list[Any]] = deque(maxlen=MAX_PENDING)
        self.loop_spans = 0
        self.callers: Counter[CodeType] = Counter()  # the user's code calling into torch's work, in the steps
        self._held: Spans | None = None  # the loop spans of the last call, deciding samples at the next
        self.loop_samples = 0
        self.waits: Counter[Location | None] = Counter()
        self.inside: Counter[Location | None] = Counter()
        self.working: Counter[Location | None] = Counter()  # of the waits, those inside torch's work
        self.framework: Counter[Location | None] = Counter()  # of the waits, those in a framework's code above it
        self.wait_steps: dict[Location | None, deque[float]] = {}  # of the waits, the steps they fell in
        self.unplaced = 0  # of the waits, those read after their wait had ended: where, unknown

    def take(self, new: Mapping[str, Spans]) -> None:
        """Mark the pending samples with the spans recorded since the last call (``new``, by kind);
        decide those the loop spans of the call before decide.

        A wait span ends before the step around it, but probes move their spans into the Trace each
        on its own (the DataLoader's, the step probe's), at most one tick apart: deciding a sample one
        call after its step span was read lets every wait span around it arrive first.
        """
        loop = new.get(self.loop_kind)
        waits = new.get(self.wait_kind)
        if waits is not None and len(waits[1]):
            self._mark(waits, 2)
            self._mark(waits, 6, at=5, same=True)
        inside = new.get(self.inside_kind) if self.inside_kind is not None else None
        if inside is not None and len(inside[1]):
            self._mark(inside, 3)
        self.flush()
        if loop is not None and len(loop[1]):
            self.loop_spans += len(loop[1])
            self._held = loop

    def loop_code(self) -> CodeType | None:
        """The loop's own code: the user's code seen calling into torch's work most often in the steps."""
        return self.callers.most_common(1)[0][0] if self.callers else None

    def flush(self) -> None:
        """Decide the samples the loop spans read last decide."""
        held, self._held = self._held, None
        if held is not None:
            self._decide(held)

    def add(self, t: float, location: Location | None, off_step: bool = False, read: float | None = None,
            caller: CodeType | None = None, working: bool = False, framework: bool = False) -> None:
        # off_step counts only with optimizer steps (the loader basis's steps are next() to next()).
        self.pending.append([t, location, False, False, off_step and self.inside_kind is not None,
                             t if read is None else read, False, caller, working, framework])

    def _mark(self, spans: Spans, slot: int, at: int = 0, same: bool = False) -> None:
        """Mark ``slot`` of the pending samples whose time ``at`` (0: due, 5: read) falls in ``spans``;
        with ``same``, only where the span holding it began by the sample's due time: the one it was due in.

        A read is late while the loop's Python holds the GIL, and comes where the loop next lets go of
        it, which is often a later wait's torch call (an evaluation's, a checkpoint's). Read there but
        due in an earlier, shorter wait (a framework's own work between two steps), the stack shows
        the later wait: marked as read inside its wait, it would add to that wait's samples the time of
        the waits before it."""
        # Wait spans do not nest: the first to end started first (the next few cover an overlap).
        starts = spans[0]
        earliest = min(starts[:OVERLAP_SCAN].tolist())
        for sample in reversed(self.pending):  # newest first (due and read times both grow): the last few
            if sample[at] < earliest:
                break
            if not sample[slot]:
                span = _containing(spans, sample[at])
                if span is not None and (not same or starts[span] <= sample[0]):
                    sample[slot] = True

    def _decide(self, spans: Spans) -> None:
        starts, ends = spans
        last_end = float(ends[-1])
        pending = self.pending
        decided = []
        while pending and pending[0][0] <= last_end:
            sample = pending.popleft()
            span = _containing(spans, sample[0])
            if span is not None:
                decided.append((sample, float(ends[span]), float(ends[span] - starts[span])))
                if sample[7] is not None:
                    self.callers[sample[7]] += 1
        self.loop_samples += len(decided)
        # Once per call, from every sample it decides: a call decides a second of them (probes.FLUSH_EVERY_S),
        # and the first second's must not be judged before any caller of torch's work was seen.
        loop_code = self.loop_code()
        for sample, span_end, step_s in decided:
            t, location, waiting, inside, off_step, read, read_waiting, caller, working, framework = sample
            # A wait inside the step only where the stack was read inside the same step and not between
            # steps: a read late for the GIL shows where the loop released it next, maybe the next fetch.
            if off_step and (read_waiting or read > span_end or location[0] is loop_code):
                off_step = False
            if waiting and not read_waiting:
                # Due inside a wait but read after it (another thread had the GIL first): the stack
                # then shows where the loop went next (its forward, often), not where it waited.
                self.unplaced += 1
                location = None
            if waiting or off_step:
                if location not in self.waits and len(self.waits) >= MAX_LOCATIONS:
                    location = _ELSEWHERE
                self.waits[location] += 1
                if inside:
                    self.inside[location] += 1
                if working:
                    self.working[location] += 1
                if framework:
                    self.framework[location] += 1
                steps = self.wait_steps.get(location)
                if steps is None:
                    steps = self.wait_steps[location] = deque(maxlen=WAIT_STEP_DURATIONS)
                steps.append(step_s)


def _containing(spans: Spans, t: float) -> int | None:
    """The index of the first of ``spans`` (ordered by end) that ``t`` falls in, or None.

    A tick brings thousands of spans on a fast loop and a few samples to place among them: a binary
    search in the arrays, with no object made per span."""
    starts, ends = spans
    first = int(ends.searchsorted(t))  # the first span ending at or after t
    for offset, start in enumerate(starts[first:first + OVERLAP_SCAN].tolist()):
        if start <= t:
            return first + offset
    return None


def _without_children(starts: np.ndarray, ends: np.ndarray, attrs: np.ndarray | None) -> Spans:
    """This process's spans: those a child process recorded carry its pid (most spans carry no attrs)."""
    if attrs is None or not any(attrs):
        return starts, ends
    ours = np.fromiter((not (a and "pid" in a) for a in attrs.tolist()), dtype=bool, count=len(attrs))
    return starts[ours], ends[ours]


class StackSampler:
    """Samples one thread's stack at each sampler tick and attributes the samples to the loop's waits.

    Built on the thread to watch (the watched cell's); :meth:`tick` is called on the sampler thread.
    """

    def __init__(self, trace: Any, thread_id: int | None = None) -> None:
        self.trace = trace
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.optimizer = _Basis(TRAIN_STEP_SPAN, BETWEEN_STEPS_SPAN, DATA_WAIT_SPAN)
        self.loader = _Basis(STEP_SPAN, DATA_WAIT_SPAN)
        self._seen = dict.fromkeys((*self.optimizer.kinds, *self.loader.kinds), 0)  # kind -> spans read
        self.recent: deque[tuple[float, Location | None]] = deque(maxlen=RECENT_SAMPLES)
        self.samples = 0
        self.late_s = 0.0  # summed over the samples: how long after its tick was due each one was read
        self.dropped = 0  # ticks read later than late_max_s after they were due: counted, but not located
        # The GIL comes at most one switch interval late (CPython then makes the holder drop it), and
        # once more if another thread got it first; later than that, the OS kept the sampler off a core.
        self.late_max_s = LATE_SWITCHES * sys.getswitchinterval()
        self.ticks = 0
        self.cpu_s = 0.0
        # id(code) -> (code, the user's, torch's work, a framework's)
        self._user: dict[int, tuple[CodeType, bool, bool, bool]] = {}
        # The user's functions seen outside each caller of torch's work (cli_main around Lightning's fit,
        # around training_step): they hold the loop, so a wait in them is the loop's own, never prefetched.
        self._callers_outside: dict[CodeType, set[CodeType]] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._sampled = False  # this tick's sample was taken (sample()) before its sources were read

    def sample(self) -> None:
        """Take this tick's sample now: called first on a sampler tick, before its sources are read (on a
        busy host or with many GPUs that takes milliseconds, and the stack would show where the loop
        went meanwhile); the tick's :meth:`tick` then reads the new spans. Never raises."""
        self._sampled = self._locked(sample=True, spans=False)

    def tick(self) -> None:
        """Take one sample unless :meth:`sample` took this tick's, then read the new spans; never raises
        (a listener of the sampler)."""
        sample, self._sampled = not self._sampled, False
        if self._locked(sample=sample, spans=True):
            self.ticks += 1

    def _locked(self, sample: bool, spans: bool) -> bool:
        """The sample and/or the spans, under the lock; False where nothing was done."""
        if self._closed or threading.get_ident() == self.thread_id:
            return False  # the watched thread itself (the watch's first poll) has nothing to sample
        started = time.thread_time()
        with self._lock:
            if self._closed:
                return False
            try:
                # The sample first: a span that ends after its due time may reach the Trace before it
                # is read (the read comes late), and must find it pending.
                if sample:
                    self._sample_when_due()
                if spans:
                    self._take_spans()
            except Exception as exc:  # noqa: BLE001 - a sample lost is no reason to disturb the run
                if len(self.errors) < 10:
                    self.errors.append(f"stack sample failed: {exc!r}")
        self.cpu_s += time.thread_time() - started
        return True

    def close(self) -> None:
        """Attribute what the last spans decide and take no more samples; safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._take_spans()
                for basis in (self.optimizer, self.loader):
                    basis.flush()
            self._user.clear()

    def _sample_when_due(self) -> None:
        """One sample, timed by when the tick was due: the GIL comes late while the loop's Python
        holds it, and then at the loop's next release (often a wait), which would inflate the waits."""
        reading = now()
        due = tick_due()
        if due is None or due > reading:
            due = reading
        elif reading - due > self.late_max_s:
            # Read long after it was due (the sampler thread waited for a core, or the loop held the
            # GIL off one): where the thread is now says nothing about where it was then. The span it
            # was due in still counts it: left out, the ticks due while the loop held the GIL (its
            # step, mostly) would be the ones missing, and the waits would read larger than they are.
            self.dropped += 1
            t = due - self.trace.start_clock
            self.recent.append((t, None))
            for basis in (self.optimizer, self.loader):
                basis.add(t, None, read=math.inf)  # never read inside a wait: an unplaced one if due in one
            return
        self.late_s += reading - due
        self._sample(due - self.trace.start_clock, reading - self.trace.start_clock)

    def _take_spans(self) -> None:
        """The spans of each kind recorded since the last tick, read once for both bases: this
        process's only (a child process's carry its pid; its loop is not this thread's). Once the
        optimizer has stepped, its basis is the one reported and the DataLoader's is left alone."""
        bases = (self.optimizer,) if self.optimizer.loop_spans else (self.optimizer, self.loader)
        new = {}
        for kind in {kind: None for basis in bases for kind in basis.kinds}:
            starts, ends, attrs, self._seen[kind] = self.trace.span_arrays_since(kind, self._seen[kind])
            new[kind] = _without_children(starts, ends, attrs)
        for basis in bases:
            basis.take(new)

    def _sample(self, t: float, read: float | None = None) -> None:
        inner: FrameType | None = None
        outer: FrameType | None = None
        cache = self._user
        working = below_torch = framework = False
        caller: CodeType | None = None
        outside: list[CodeType] = []  # the user's functions walked since the caller
        for frame in thread_stack(self.thread_id):
            code = frame.f_code
            known = cache.get(id(code))
            if known is None or known[0] is not code:
                known = cache[id(code)] = (code, is_user_frame(frame), is_torch_work(frame), is_framework(frame))
            if known[1]:
                if inner is None:
                    inner = frame
                outer = frame
                if below_torch:  # the user's frame calling into torch's work (through any library)
                    caller, below_torch = code, False
                    outside = []
                elif caller is not None:
                    outside.append(code)
            elif known[2]:
                working = below_torch = True
            elif known[3] and inner is None:  # a framework's code runs above the user's innermost frame
                framework = True
        if caller is not None and outside:
            known_outside = self._callers_outside.setdefault(caller, set())
            if len(known_outside) < MAX_LOCATIONS:
                known_outside.update(outside)
        location: Location | None = None
        if inner is not None and outer is not None:
            location = (inner.f_code, inner.f_lineno or 0, outer.f_code, outer.f_lineno or 0)
        self.samples += 1
        self.recent.append((t, location))
        # Outside torch's work, in a function the loop called: a wait inside the step (module docstring).
        off_step = not working and location is not None and location[0] is not location[2]
        self.optimizer.add(t, location, off_step, read, caller, working, framework)
        self.loader.add(t, location, read=read)

    # ----------------------------------------------------------------- facts, after the watch

    def basis(self) -> _Basis:
        """The attribution the loop had: optimizer steps where any were recorded, else the DataLoader's."""
        return self.optimizer if self.optimizer.loop_spans else self.loader

    def facts(self, namespace: Mapping[str, Any] | None = None) -> tuple[list[LoopWait], StackFacts]:
        """``WorkloadFacts["loop_waits"]`` (largest share first) and ``["stack_samples"]``."""
        self.close()
        basis = self.basis()
        stats = self.trace.span_stats(basis.loop_kind)
        loop_s = float(stats.total) if stats is not None else 0.0
        stack: StackFacts = {"basis": basis.wait_kind, "samples": self.samples, "loop_samples": basis.loop_samples,
                             "steps": basis.loop_spans, "loop_s": loop_s,
                             "tick_us": 1e6 * self.cpu_s / self.ticks if self.ticks else 0.0,
                             "late_ms": 1e3 * self.late_s / self.samples if self.samples else 0.0,
                             "dropped": self.dropped, "unplaced": basis.unplaced}
        if not basis.loop_samples:
            return [], stack
        # code -> [samples, inside, Counter(line), Counter(outer), in torch's work, in a framework's code,
        #          the steps its samples fell in]
        by_code: dict[CodeType, list[Any]] = {}
        for location, count in basis.waits.items():
            if location is None:
                continue
            code, line, outer_code, outer_line = location
            entry = by_code.setdefault(code, [0, 0, Counter(), Counter(), 0, 0, []])
            entry[0] += count
            entry[1] += basis.inside.get(location, 0)
            entry[4] += basis.working.get(location, 0)
            entry[5] += basis.framework.get(location, 0)
            entry[6].extend(basis.wait_steps.get(location, ()))
            entry[2][line] += count
            entry[3][(outer_code, outer_line)] += count
        # A wait read after it had ended is timed (its tick was due inside it) but not placed: the waits
        # read in time say where the waits were, and the unplaced ones are shared out as they are.
        waited = sum(basis.waits.values())
        placed_share = (waited - basis.unplaced) / waited if waited > basis.unplaced else 1.0
        ranked = sorted(by_code.items(), key=lambda item: item[1][0], reverse=True)[:LOOP_WAITS]
        names = namespace or {}
        loop_code = basis.loop_code() if basis is self.optimizer else None
        holding_the_loop = self._callers_outside.get(loop_code, set()) if loop_code is not None else set()
        median_step = self._median_step(basis.loop_kind)
        waits: list[LoopWait] = []
        for code, (count, inside, lines, outers, working, framework, steps) in ranked:
            line = lines.most_common(1)[0][0]
            outer_code, outer_line = outers.most_common(1)[0][0]
            share = count / placed_share / basis.loop_samples
            wait: LoopWait = {**code_site(code, line), "share": share, "seconds": share * loop_s,
                              # Without optimizer steps the waits are a DataLoader's next() itself.
                              "samples": count, "in_loader": inside / count if basis.inside_kind else 1.0,
                              # The loop's own: its code, or a function of the user's around it (waiting
                              # there, the thread was in a library's loop it called: Lightning's fit).
                              "in_model": working / count,
                              # In a framework's code the user's line called (Lightning's loop under fit()).
                              "in_framework": framework / count,
                              # The steps it was seen in, against the loop's usual step: a wait that makes
                              # some steps slow (a periodic evaluation) reads many times 1, one in every step ~1.
                              "step_ratio": float(np.median(steps)) / median_step if steps and median_step > 0 else 1.0,
                              "in_loop": code is loop_code or code in holding_the_loop,
                              "source": _line_text(code.co_filename, line),
                              "called_from": code_site(outer_code, outer_line),
                              "name": user_name(code, names), "generator": bool(code.co_flags & CO_GENERATOR),
                              "copy": host_copy(code.co_filename, line, names)}
            waits.append(wait)
        return waits, stack

    def _median_step(self, kind: str) -> float:
        """The median of this process's loop steps the Trace keeps (seconds; 0.0 without any)."""
        starts, ends, attrs, _ = self.trace.span_arrays_since(kind, 0)
        starts, ends = _without_children(starts, ends, attrs)
        return float(np.median(ends - starts)) if len(ends) else 0.0


# --------------------------------------------------------------------------- in the user's terms


def code_site(code: CodeType, line: int) -> CodeSite:
    """``code`` at ``line`` as the user knows it: the function's name, the file relative to the
    working directory (a cell keeps IPython's file) and the cell's number where it is a cell. A
    function defined inside another goes by its own name (``collate_fn``); a generator expression or
    a lambda by the function around it (``ByteTokenizer.__call__.<genexpr>``)."""
    scopes = getattr(code, "co_qualname", code.co_name).split("<locals>.")
    function = scopes[-1]
    if function.startswith("<") and len(scopes) > 1:
        function = scopes[-2].rstrip(".") + "." + function
    file = code.co_filename
    cell = notebook_cell(file)
    return {"function": function, "file": file if cell is not None else display_path(file), "line": line,
            "cell": cell}


def _line_text(file: str, line: int) -> str | None:
    text = linecache.getline(file, line).strip()
    return text or None


def user_name(code: CodeType, namespace: Mapping[str, Any]) -> str | None:
    """The user's name for the function running ``code``, as an assignment target: a variable
    (``get_batch``), or an object's method (``batcher.next``); None where no name of theirs holds it."""
    for name, value in namespace.items():
        if not name.startswith("_") and _code_of(value) is code:
            return name
    for name, value in namespace.items():
        if name.startswith("_") or isinstance(value, type) or callable(getattr(value, "__code__", None)):
            continue
        try:
            members = [(attr, member) for klass in type(value).__mro__ for attr, member in vars(klass).items()]
        except TypeError:
            continue
        for attr, member in members:
            if _code_of(member) is code:
                return f"{name}.{attr}"
    return None


def _code_of(value: Any) -> CodeType | None:
    """The code a function, method, static/class method or ``functools.wraps`` wrapper runs."""
    for _ in range(4):
        code = getattr(value, "__code__", None)
        if isinstance(code, CodeType):
            return code
        inner = getattr(value, "__func__", None) or getattr(value, "__wrapped__", None)
        if inner is None:
            return None
        value = inner
    return None


def host_copy(file: str, line: int, namespace: Mapping[str, Any]) -> HostCopy | None:
    """The tensor-to-device copies on ``line`` of ``file`` (``x.to(device)``, ``x.cuda()``), or None.

    ``same_each_step``: every copied name is one of the user's host tensors that the loop (or the
    function the line is in) never assigns, so the same data crosses to the device at every step.
    ``once`` is then the statement that moves them once (valid in the user's namespace: every
    name it uses is there); ``rewritten`` is the line with pinned memory and non-blocking copies.
    """
    tree = parse_source(file)
    if tree is None:
        return None
    statement = _statement_at(tree, line)
    if statement is None:
        return None
    calls = [node for node in ast.walk(statement) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in COPY_METHODS]
    if not calls:
        return None
    receivers = [call.func.value for call in calls]  # type: ignore[attr-defined]
    scope = _scope_at(tree, line)
    assigned = _assigned_names(scope) if scope is not None else set()
    torch = sys.modules.get("torch")
    same = torch is not None and all(
        isinstance(node, ast.Name) and node.id not in assigned and isinstance(namespace.get(node.id), torch.Tensor)
        and namespace[node.id].device.type == "cpu" for node in receivers)
    once = None
    if same:
        used = {node.id for call in calls for arg in [*call.args, *call.keywords]
                for node in ast.walk(arg) if isinstance(node, ast.Name)}
        if all(name in namespace or hasattr(builtins, name) for name in used):
            statements = []
            for call in calls:
                name = call.func.value.id  # type: ignore[attr-defined]
                statement_text = f"{name} = {ast.unparse(call)}"
                if statement_text not in statements:
                    statements.append(statement_text)
            once = "\n".join(statements)
    return {"tensors": _unique(ast.unparse(node) for node in receivers), "same_each_step": bool(same),
            "once": once, "rewritten": _pinned(statement)}


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _statement_at(tree: ast.Module, line: int) -> ast.stmt | None:
    """The innermost simple statement spanning ``line``."""
    simple = [node for node in ast.walk(tree) if isinstance(node, ast.stmt) and not hasattr(node, "body")
              and node.lineno <= line <= (node.end_lineno or node.lineno)]
    return max(simple, key=lambda node: node.lineno, default=None)


def _scope_at(tree: ast.Module, line: int) -> ast.AST | None:
    """What runs again at each step around ``line``: the innermost function holding it (called
    each step), else the innermost loop; None outside both."""
    around = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)
              and node.lineno <= line <= (node.end_lineno or node.lineno)]
    for kinds in ((ast.FunctionDef, ast.AsyncFunctionDef), (ast.For, ast.AsyncFor, ast.While)):
        group = [node for node in around if isinstance(node, kinds)]
        if group:
            return max(group, key=lambda node: node.lineno)
    return None


def _assigned_names(scope: ast.AST) -> set[str]:
    """Names bound inside ``scope``: assignment targets, loop variables, ``with ... as``, and a
    function's parameters (bound anew at every call)."""
    names = {node.id for node in ast.walk(scope) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = scope.args
        names.update(arg.arg for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs])
        names.update(arg.arg for arg in (arguments.vararg, arguments.kwarg) if arg is not None)
    return names


def _pinned(statement: ast.stmt) -> str | None:
    """``statement`` with each ``x.to(...)``/``x.cuda(...)`` copying from pinned memory without
    blocking; None where every copy does already."""
    rewritten = copy.deepcopy(statement)
    changed = False
    for node in ast.walk(rewritten):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COPY_METHODS):
            continue
        receiver = node.func.value
        if not (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
                and receiver.func.attr == "pin_memory"):
            node.func.value = ast.Call(func=ast.Attribute(value=receiver, attr="pin_memory", ctx=ast.Load()),
                                       args=[], keywords=[])
            changed = True
        blocking = [keyword for keyword in node.keywords if keyword.arg == "non_blocking"]
        if not blocking or not (isinstance(blocking[0].value, ast.Constant) and blocking[0].value.value is True):
            node.keywords = [keyword for keyword in node.keywords if keyword.arg != "non_blocking"]
            node.keywords.append(ast.keyword(arg="non_blocking", value=ast.Constant(True)))
            changed = True
    return ast.unparse(rewritten) if changed else None
