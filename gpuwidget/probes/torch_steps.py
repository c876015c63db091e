"""Step probe: the training loop's steps from its optimizer and its model, whatever feeds them.

A DataLoader is one way to feed a loop; nanoGPT's ``get_batch``, a generator or a stream are
others, and each of them still calls ``optimizer.step()`` once per step. torch's global optimizer
hook (``register_optimizer_step_post_hook``) sees every such call; the *trained model* is the model
(among those :class:`~gpuwidget.probes.torch_model.ModelProbe` saw called) whose parameters that
optimizer holds, matched by parameter identity at the optimizer's first step, never simply the
largest module. Of several optimizers, the one holding most of the trained model's parameters
counts the steps (a GAN's two, nanoGPT-speedrun's Muon beside AdamW).

A loop with no optimizer, which updates the parameters itself (PyTorch's word_language_model:
``p.data.add_(p.grad, alpha=-lr)``, which moves no version counter), is found by the model probe: the
model's parameters changed between its first training calls (:meth:`StepProbe._adopt_updated`). Its
steps then run from one training forward to the next (``step_source`` "forward").

Once the model is known, its training forwards are seen (on the module called at top level: a
LightningModule's ``training_step`` calls its ``encoder``; grad enabled: an evaluation under
``no_grad`` between steps is part of the wait between them). Two spans come of it
(``probes.TRAIN_STEP_SPAN`` and ``probes.BETWEEN_STEPS_SPAN``):

* ``train.step``: from the end of one optimizer step (for the first: the model's first call) to
  the end of the next, for every step;
* ``train.between``: from a step's end to the next training forward: where the loop fetched its
  next batch, logged, evaluated.

How the forwards are seen changes once the first steps are read:

* **First steps** (about four: until :data:`SAMPLE_STEPS` steps' inputs are read): torch's global
  module hooks (kept to the trained model's modules by identity) see every forward: the inputs' first
  dimension (``samples_per_step``), the batch a measurement reuses, a second training forward in a step
  (gradient accumulation), the FLOP-counted step if the counter is loaded by then. Global, so nothing
  of the probe is stored on the user's model. Each forward costs a global hook's dispatch, 10-20 % of a
  0.3 ms step: they end as soon as what they are for is read (BENCHMARKS.md, section 20j).
* **Steady state**: no hook on the model most of the time (any forward hook takes a module off
  ``Module._call_impl``'s fast path, about 3 us a call on this machine), only the optimizer's
  post hook, which appends one clock reading a step. Around each sampler tick a one-shot pre-hook
  (a *window*) is put on the model; it records the next training forward and removes itself.
  Windows open at the ends of the last steps before the tick is due (:data:`LEAD_STEPS` of the
  longest recent steps ahead) and at the tick, before its stack sample, if none is open
  (:meth:`StepProbe.arm`). So the ``train.between`` span the tick's stack sample was due in is
  known, if it was due in one, even when the sample is read late, after that span: all the stack
  attribution (probes.stack) reads. ``forward_calls``,
  ``eval_forwards`` and ``autocast_share`` are then counted in those windows (``forwards_sampled``).
* A loop that calls the model more than once a step with grad enabled (gradient accumulation)
  keeps a hook on every forward: a window could not tell a step's first forward from its second.
  So does a loop that updates its parameters itself (its steps *are* its forwards).

A hook left on the user's model is a :class:`ModelHook`: ``copy.deepcopy(model)`` (an EMA, a
best-model copy) and ``torch.save(model)`` take an inert stand-in that needs no gpuwidget.

On the loop's path each hook reads the clock and appends the reading to a flat list (a step's end
as it is, a training forward negated: nothing is kept per step but that float); the post hook is a
closure over what it touches. The micro-benchmarks are ``benchmarks/step_probe_cost.py`` and
``benchmarks/probe_cost.py``, their figures in BENCHMARKS.md. :meth:`StepProbe.flush` makes spans of
a tick's events at once, with numpy, on the sampler thread. The forward hooks also count calls made
under ``torch.autocast`` (``autocast_share``).

One step per watch, :data:`FLOPS_AT_STEP` or the first after the counter is loaded (on the sampler
thread: :meth:`StepProbe.prepare`), is counted with ``torch.utils.flop_counter.FlopCounterMode``
(forward and backward): entered at that step's first training forward, left as its optimizer step
starts (or, where the forward runs inside ``step()`` as Lightning's closure does, as it ends). Past the
first steps it is entered by a one-shot hook put on the trained model at the end of the step before
(:meth:`StepProbe._arm_count`), the post hook taking its full path until that step is counted.
It is counted after the first steps (CUDA and cuDNN start-up, compilation), which a counted step
would only make slower, and its time is kept out of ``step_times`` (the counter's own cost, in
``flops_step_s``). :meth:`StepProbe.uninstall` leaves the counter if a step that raised or a watch
that ended mid-step left it entered.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections import Counter, deque
from typing import Any

import numpy as np

from gpuwidget.clock import now
from gpuwidget.facts import TrainingFacts
from gpuwidget.probes import BETWEEN_STEPS_SPAN, TRAIN_STEP_SPAN
from gpuwidget.probes.batch_capture import CapturedBatch, capture_batch
from gpuwidget.probes.hooks import ModelHook
from gpuwidget.probes.torch_data import STEP_HISTORY, add_span_arrays, first_dim
from gpuwidget.sampler import next_tick_due
from gpuwidget.trace import Trace

# The step FLOPs are counted on (0-based): after the first steps, which pay for CUDA and cuDNN
# start-up and torch.compile's compilation (a counted step runs eagerly through torch's dispatcher,
# so a compiling step would be counted at its slowest), and early enough that a short cell of a
# few steps still has a count. The warm-up split (figures.warmup) is made after the run, from all
# step times; FLOPs per step do not depend on the step's speed, only its work.
FLOPS_AT_STEP = 3
# Steps whose training inputs' first dimension is summed into samples_per_step (then no more reads).
SAMPLE_STEPS = 3
# Forward calls inside the counted step after which the count is given up (a step that raised
# and a loop that went on without stepping the optimizer would otherwise count on and on).
MAX_COUNTED_FORWARDS = 256
# In the steady state, windows open at every step's end from this many of the longest recent steps
# before the next tick is due (:meth:`StepProbe.arm`), and the recent steps are the last
# LEAD_RECENT_STEPS timed.
LEAD_STEPS = 2
LEAD_RECENT_STEPS = 8

# torch dtype -> the name FLOP peaks are listed under (gpuwidget.peaks).
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8"}
_CONV_OPS = ("convolution", "convolution_backward")


class StepProbe:
    """Counts the trained model's optimizer steps, times them, and counts one step's FLOPs."""

    def __init__(self, trace: Trace, models: Any, data: Any = None) -> None:
        self.trace = trace
        self.models = models  # the watch's ModelProbe: the models called, to match an optimizer's parameters
        self.data = data  # the watch's DataLoaderProbe: which loader fed a step
        self.installed = False
        self._handles: list[Any] = []
        self._forward_handles: list[Any] = []
        # Clock readings appended by the hooks: a step's end as it is, a training forward's negated.
        self._events: list[float] = []
        self._lean = False  # past the first steps: the post hook's short path
        self._optimizer: Any = None  # the optimizer whose steps are counted
        self._overlap = -1  # how many of the trained model's parameters it holds (numel)
        self._judged: dict[int, Any] = {}  # id(optimizer) -> weakref, every optimizer matched once
        self._device_type = "cpu"
        self._model_class: str | None = None
        self._first_call: float | None = None
        self.steps = 0
        self.forward_calls = 0
        self._autocast: dict[Any, int] = {}
        self._waiting = False  # a step ended; the next training forward starts the next step
        self._entry_ids: frozenset[int] = frozenset()  # id() of the modules whose forwards are the model's
        self._step_forwards = 0  # training forwards seen in the step running (the first steps)
        self._several = False  # a step had more than one training forward: a hook on every forward
        self._windowed = False  # the steady state: forwards seen in one-shot windows opened around ticks
        self._armed: ModelHook | None = None  # the window open now
        self._window_lock = threading.Lock()  # windows are opened on the loop's thread and the sampler's
        self._window_from = math.inf  # the post hook opens a window at a step's end from this clock reading on
        self.eval_forwards = 0  # forwards seen with grad disabled (an evaluation between steps)
        self.forwards_sampled = False  # windows were opened: the forwards after the first steps were not all seen
        self.between_spans = 0
        self._sampling = True
        self._early = True  # the full forward hook (samples, FLOP counter) until those are done
        self._entries: list[Any] = []  # weak references to the trained model's top-level modules
        self._step_samples = 0
        self._samples: list[int] = []
        self._counter: Any = None
        self._counter_thread = 0
        self._counter_ready = False  # prepare() ran: counting costs the loop no import
        self._counted_pending = False  # the step ending next was the counted one
        self._counted_end: float | None = None  # when the counted step ended (its event's clock reading)
        self._pre_handle: Any = None
        self._count_hook: ModelHook | None = None  # past the first steps: starts the counter at a training forward
        self._counted_forwards = 0
        self._flops: float | None = None
        self._flops_dtype: str | None = None
        self._flops_at: int | None = None
        self._flops_missing: str | None = None
        # Assembled by flush() on the sampler thread (and once more by uninstall, on the cell's: a lock).
        self._flush_lock = threading.Lock()
        self._last_end: float | None = None
        self._between_start: float | None = None
        self._loop_start: float | None = None  # the first step span's start
        self.spanned = 0  # steps with a span (all but a first step whose start was not seen)
        self.step_times: deque[float] = deque(maxlen=STEP_HISTORY)
        self.step_ends: deque[float] = deque(maxlen=STEP_HISTORY)
        self.between_total = 0.0
        self._counted_step_s: float | None = None
        # For measuring a change later (gpuwidget.measure): one training forward's inputs, copied once.
        self.captured: CapturedBatch | None = None
        self._capture_tried = False
        # No optimizer steps the model: its loop updates the parameters itself, and each training
        # forward starts a step (:meth:`_adopt_updated`).
        self._by_forward = False
        if models is not None:
            models.on_updated = self._adopt_updated

    # ---------------------------------------------------------------- hooks

    def install(self) -> None:
        if self.installed:
            return
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # Bound once: the forward hook runs on every step.
        self._autocast_enabled, self._autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
        self._grad_enabled = torch.is_grad_enabled
        self._handles = [register_optimizer_step_post_hook(self._post_hook())]
        self.installed = True

    def _unhook_forwards(self) -> None:
        """Remove the forward hooks and close a window still open."""
        for handle in self._forward_handles:
            handle.remove()
        self._forward_handles = []
        armed, self._armed = self._armed, None
        if armed is not None:
            armed.remove()
        counting, self._count_hook = self._count_hook, None
        if counting is not None:
            counting.remove()

    def _post_hook(self) -> Any:
        """torch's global optimizer post hook: the steady state inline, as a closure over what it touches
        (a method looked up ``self._events.append`` and the clock on every step); the rest in :meth:`_stepped`."""
        probe, push, clock, full = self, self._events.append, now, self._stepped

        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            if probe._lean and optimizer is probe._optimizer:  # the steady state: a few updates, no branch more
                ended = clock()
                push(ended)
                probe.steps += 1
                probe._waiting = True
                if ended >= probe._window_from:  # a tick is due within the next steps
                    probe._open_window()
                data = probe.data
                if data is not None:
                    last = data.last
                    if last is not None:
                        last.steps_fed += 1
                        data.last = None
                return
            full(optimizer, args, kwargs)

        return stepped

    def uninstall(self) -> None:
        """Remove every hook, leave a FLOP counter still entered, and make spans of what is queued."""
        self.installed = self._lean = self._windowed = False  # first: a tick's arm() now closes its own window
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unhook_forwards()
        if self._counter is not None:
            self._stop_counting(completed=False)
        self.flush()

    def detach(self) -> None:
        """In a forked child: remove the hooks only (no lock, no counter: the parent's thread is not here)."""
        self.installed = self._lean = self._windowed = False
        for handle in self._handles + ([self._pre_handle] if self._pre_handle else []):
            handle.remove()
        self._unhook_forwards()
        self._handles, self._counter, self._pre_handle = [], None, None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After every ``optimizer.step()`` but the steady state's (:meth:`_post_hook`): the end of a training step."""
        if optimizer is not self._optimizer:
            if id(optimizer) in self._judged and self._judged[id(optimizer)]() is optimizer:
                return  # another optimizer, already judged not to count the steps
            counting = self._optimizer
            with contextlib.suppress(Exception):  # a probe never breaks the user's step
                self._judge(optimizer)
            if optimizer is not self._optimizer:
                return
            if counting is not None and self._waiting:
                return  # it takes over the counting within a step the other one ended: not a step more
        ended = now()
        if self._counter is not None:  # its pre-hook did not see the step: left here instead
            self._stop_counting(completed=True)
        self.steps += 1
        self._waiting = True
        if self._step_forwards > 1:
            self._several = True
        self._step_forwards = 0
        if self._counted_pending:
            self._counted_pending = False
            self._counted_end = ended
        self._events.append(ended)
        if self._sampling:
            self._end_sampled_step()
        if self._early:
            if not self._sampling and self._capture_tried and self._counter is None:
                self._hook(early=False)  # samples read, batch captured: the lean hook from now on
        elif self._counting_due:
            if self._counter is None and self._count_hook is None:
                self._arm_count()  # the counter is loaded: the next step's training forward starts it
        else:
            self._lean = self.installed  # the counted step ended: the post hook's short path again
        if self._windowed and ended >= self._window_from:
            self._open_window()
        data = self.data
        if data is not None and data.last is not None:
            data.last.steps_fed += 1
            data.last = None

    def _forward(self, module: Any, args: Any) -> None:
        """Torch's global forward pre-hook in the first steps, kept to the trained model's modules: a
        step's first training forward starts it (and the FLOP counter, on the counted step)."""
        if id(module) not in self._entry_ids:
            return
        if not self._count_forward():
            return  # evaluation between steps: not the step's own forward
        self._step_forwards += 1
        if self._waiting:
            self._waiting = False
            self._events.append(-now())
            if self.steps >= FLOPS_AT_STEP and self._counter_ready and not self._flops_settled:
                self._start_counting()
        elif self._counter is not None:
            self._counted_forwards += 1
            if self._counted_forwards > MAX_COUNTED_FORWARDS:
                self._stop_counting(completed=False)

    def _count_forward(self) -> bool:
        """Count a forward of the trained model the hooks see (under autocast, with grad disabled): True
        where it trains (grad enabled)."""
        self.forward_calls += 1
        device = self._device_type
        if self._autocast_enabled(device):
            dtype = self._autocast_dtype(device)
            self._autocast[dtype] = self._autocast.get(dtype, 0) + 1
        if not self._grad_enabled():
            self.eval_forwards += 1
            return False
        return True

    def _live_entries(self) -> list[Any]:
        """The trained model's top-level modules still alive (held weakly)."""
        return [entry for entry in (ref() for ref in self._entries) if entry is not None]

    def _forwarded(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        """Torch's global forward hook in the first steps (it alone is given keyword arguments: a Hugging
        Face model is called with ``input_ids=``): the inputs' first dimension, and the batch a
        measurement reuses (copied once)."""
        if id(module) not in self._entry_ids or not self._grad_enabled():
            return
        if self._sampling:
            self._step_samples += first_dim(args) or first_dim(kwargs)
        if not self._capture_tried:
            self._capture(module, args, kwargs)

    def arm(self) -> None:
        """On the sampler thread, at each tick, before its stack sample: in the steady state, plan the
        windows before the next tick and open one now if none is open (see the module docstring)."""
        if not self._windowed:
            return
        following = next_tick_due()  # drawn before this tick ran (the ticks are dithered)
        if following is not None:
            self._window_from = following - LEAD_STEPS * self._recent_step_s()
        self._open_window()

    def _recent_step_s(self) -> float:
        """The longest of the last :data:`LEAD_RECENT_STEPS` steps: read from the events the loop queued
        where they hold enough step ends (spans are made of them once a second: probes.FLUSH_EVERY_S,
        and a second of windows planned from older steps, or from none in the first, would open late),
        else from the steps already made."""
        tail = self._events[-(2 * LEAD_RECENT_STEPS + 2):]  # a copy: the loop appends meanwhile
        ends = [reading for reading in tail if reading > 0]  # a training forward's reading is negated
        if len(ends) > LEAD_RECENT_STEPS // 2:
            return max(later - earlier for earlier, later in zip(ends, ends[1:]))
        return max(itertools.islice(reversed(self.step_times), LEAD_RECENT_STEPS), default=0.0)

    def _open_window(self) -> None:
        """A one-shot hook on the trained model that records its next training forward, unless one is
        open: at a tick (the sampler's thread) and at the steps' ends just before one (the loop's).

        A window opened at a step's end records the forward that ends the ``train.between`` span
        after it. A tick's sample is read late when the loop holds the GIL, sometimes after that
        forward: a window opened only then would see the next step's, and the sample, due between
        the steps, would count as the step's. The windows opened at the steps' ends before a tick
        (the longest recent steps, twice: ``LEAD_STEPS``) make the span around its due time known."""
        if not self._windowed:
            return
        with self._window_lock:  # one window at a time: two on one forward would take it for a second
            armed = self._armed
            if armed is not None and not armed.fired:
                return  # open already: a step longer than a tick, or opened at the step's end
            hook = ModelHook(self._window)
            self._armed = hook
            for entry in self._live_entries():
                hook.handles.append(entry.register_forward_pre_hook(hook))
        if hook.fired or not self._windowed:  # it fired while being put on, or the watch ended meanwhile
            hook.remove()

    def _window(self, module: Any, args: Any) -> bool:
        """A window's forward (on the loop's thread): True, and the window closes, at a training forward."""
        if not self._count_forward():
            return False
        if not self._waiting:  # a second training forward since a step's end: a hook on every one from now
            self._several = True
            self._hook(early=False)  # closes this window
            return True
        self._waiting = False  # one training forward a step: this is the step's first
        self._events.append(-now())
        return True

    # ---------------------------------------------------------------- what a measurement reuses

    def _capture(self, module: Any, args: Any, kwargs: Any) -> None:
        """Once per watch, at the first training forward the hook sees: copy the batch (probes.batch_capture)."""
        self._capture_tried = True
        try:
            self.captured = capture_batch(module, args, kwargs)
        except Exception:  # noqa: BLE001 - a probe never breaks the user's step; nothing to measure later
            self.captured = None

    def optimizer(self) -> Any:
        """The optimizer whose steps are counted (the trained model's), or None."""
        return self._optimizer

    # ---------------------------------------------------------------- the trained model

    def _judge(self, optimizer: Any) -> None:
        """Match a newly seen optimizer's parameters to the models called: it counts the steps if it
        holds more of its model's parameters than the optimizer counting them now."""
        self._judged[id(optimizer)] = weakref.ref(optimizer)
        if self._by_forward:
            return  # the loop's steps are its forwards already: an optimizer seen later counts none
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        best: tuple[int, Any, list[Any], float] | None = None
        best_overlap = 0
        for _key, model, entries, first_call in self.models.candidates() if self.models is not None else ():
            overlap = sum(p.numel() for p in model.parameters() if id(p) in held)
            if overlap > best_overlap:
                best, best_overlap = (_key, model, entries, first_call), overlap
        if best_overlap <= self._overlap:
            return
        if self._optimizer is not None and best is None:
            return
        self._optimizer, self._overlap = optimizer, best_overlap
        self._unhook_forwards()
        self._windowed, self._window_from = False, math.inf
        if best is None:  # steps without a model to match (it ran before the watch saw it): count them
            return
        key, model, entries, first_call = best
        self._adopt(key, model, entries)
        if self._first_call is None:
            self._first_call = first_call
        self._hook(early=self._early)

    def _adopt(self, key: int, model: Any, entries: list[Any]) -> None:
        """The trained model: its class, its device, and the top-level modules whose forwards are hooked."""
        self.models.trained_key = key
        self._model_class = type(model).__name__
        devices = {p.device.type for p in model.parameters()}
        self._device_type = "cuda" if "cuda" in devices else next(iter(devices), "cpu")
        self._entries = [weakref.ref(entry) for entry in entries]  # never keep the user's model alive

    def _hook(self, early: bool) -> None:
        """See the trained model's forwards: every one through torch's global hooks in the first steps;
        then in windows opened at ticks, or, where a step has several training forwards, through a lean
        hook on every one (no keyword arguments: torch's hook dispatch costs about a microsecond more
        with them)."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._unhook_forwards()
        entries = self._live_entries()
        self._entry_ids = frozenset(id(entry) for entry in entries)
        self._windowed, self._window_from = False, math.inf
        if early:
            self._forward_handles = [register_module_forward_pre_hook(self._forward),
                                     register_module_forward_hook(self._forwarded, with_kwargs=True)]
        elif self._several:
            hook = ModelHook(self._lean_forward())
            self._forward_handles = [entry.register_forward_pre_hook(hook) for entry in entries]
        else:
            self._windowed = self.forwards_sampled = True  # arm() opens the windows
        self._early = early
        # The counted step goes through _stepped: the short path knows nothing of the counter.
        self._lean = not early and not self._counting_due

    def _lean_forward(self, by_forward: bool = False) -> Any:
        """The steady-state forward hook: a closure over what it reads, as few lookups as can be. With
        ``by_forward`` (a loop without an optimizer), a training forward ends the step before it and
        starts the next."""
        probe, push, clock = self, self._events.append, now
        autocast_enabled, autocast_dtype = self._autocast_enabled, self._autocast_dtype
        grad_enabled = self._grad_enabled
        device, under = self._device_type, self._autocast

        def forward(module: Any, args: Any) -> None:
            probe.forward_calls += 1
            if autocast_enabled(device):
                dtype = autocast_dtype(device)
                under[dtype] = under.get(dtype, 0) + 1
            if not grad_enabled():
                probe.eval_forwards += 1
            elif probe._waiting:
                probe._waiting = False
                push(-clock())

        def forward_step(module: Any, args: Any) -> None:
            probe.forward_calls += 1
            if autocast_enabled(device):
                dtype = autocast_dtype(device)
                under[dtype] = under.get(dtype, 0) + 1
            if not grad_enabled():
                probe.eval_forwards += 1
                return  # evaluation: part of the step it falls in
            push(clock())
            probe.steps += 1
            if len(probe._samples) < SAMPLE_STEPS and args:
                probe._samples.append(first_dim(args))
            data = probe.data
            if data is not None:
                last = data.last
                if last is not None:
                    last.steps_fed += 1
                    data.last = None

        return forward_step if by_forward else forward

    # ---------------------------------------------------------------- a loop without an optimizer

    def _adopt_updated(self, key: int, model: Any, entries: list[Any], first_call: float, calls: int) -> None:
        """The model probe saw a model, which no optimizer steps, called to train after its parameters
        changed: the loop updates them itself (PyTorch's word_language_model example:
        ``p.data.add_(p.grad, alpha=-lr)``). Each training forward then starts a step, and a step runs
        from one to the next (its batch, forward, backward and update; no ``train.between``), so
        ``steps`` counts the forwards, the last step's included, and the spans all but the last.
        Called on the loop's thread, before this forward (``calls`` training forwards so far, this one's
        included): the steps before it are counted, the first spanned from the model's first call
        when it is the only one."""
        if not self.installed or self._optimizer is not None or self.steps:
            return
        self._by_forward = True
        self._adopt(key, model, entries)
        self._first_call = first_call if calls == 2 else None
        self._flops_missing = ("no optimizer steps the model (its loop updates the parameters itself), and a "
                               "step's FLOPs are counted up to its optimizer step")
        self._sampling = False
        self._unhook_forwards()
        self._windowed, self._window_from = False, math.inf
        hook = self._lean_forward(by_forward=True)
        self._forward_handles = [entry.register_forward_pre_hook(ModelHook(hook)) for entry in entries]
        self.steps = calls - 1
        hook(model, ())  # this forward: the hook registered now is first called at the next

    # ---------------------------------------------------------------- samples and FLOPs

    def _end_sampled_step(self) -> None:
        if self.steps > 1:  # the first step ran before the model was known: its inputs were not seen
            self._samples.append(self._step_samples)
        self._step_samples = 0
        if len(self._samples) >= SAMPLE_STEPS:
            self._sampling = False

    @property
    def _counting_due(self) -> bool:
        """The counter is loaded and no step was counted yet."""
        return self._counter_ready and not self._flops_settled

    def _arm_count(self) -> None:
        """Past the first steps, at a step's end (the loop's thread): a hook on the trained model whose next
        training forward, the next step's first, starts the FLOP counter. It stays on through the counted
        step, counting its forwards (:data:`MAX_COUNTED_FORWARDS`), until the counter stops."""
        hook = ModelHook(self._count_window)
        self._count_hook = hook
        for entry in self._live_entries():
            hook.handles.append(entry.register_forward_pre_hook(hook))

    def _count_window(self, module: Any, args: Any) -> bool:
        """The counting hook's forward: True removes it."""
        if not self._grad_enabled():
            return False  # evaluation between steps: the counted step starts at a training forward
        if self._counter is None:
            if not self._counting_due:
                return True
            self._start_counting()
            return self._counter is None  # it could not start (flops_missing says why)
        self._counted_forwards += 1
        if self._counted_forwards > MAX_COUNTED_FORWARDS:
            self._stop_counting(completed=False)
            return True
        return False

    @property
    def _flops_settled(self) -> bool:
        """The step was counted, or it will not be."""
        return self._flops is not None or self._flops_missing is not None

    def prepare(self) -> None:
        """On the sampler thread, at every tick until it is done: load what the FLOP counter needs before a
        step is counted.

        Every torch dispatch mode imports ``torch._dynamo`` at its first dispatch (seconds, in a fresh
        process); done here it never lands in the user's step. Counting waits for it (a later step
        is counted if it takes longer than the first FLOPS_AT_STEP steps)."""
        self._take_the_long_path()
        if self._counter_ready or self._flops_settled or not self.steps or self._model_class is None:
            return  # nothing to count yet: a cell that never trains never pays for the import
        try:
            import torch

            with DtypeFlopCounter():  # dispatch modes are per thread: the loop's thread is untouched
                torch.ones(2, 2) @ torch.ones(2, 2)
        except Exception as exc:  # noqa: BLE001 - without a count the run still has its steps
            self._flops_missing = f"the FLOP counter is unavailable: {exc!r}"
            return
        self._counter_ready = True
        self._take_the_long_path()

    def _take_the_long_path(self) -> None:
        """Past the first steps, with the counter loaded and no step counted: the post hook's full path
        at the next step's end, which arms the count (:meth:`_stepped`). On the sampler thread, at every
        tick until a step is counted: once could lose to :meth:`_hook`'s store on the loop's thread."""
        if self._counting_due and not self._early and self.installed:
            self._lean = False

    def _start_counting(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        try:
            counter = DtypeFlopCounter()
            counter.__enter__()
        except Exception as exc:  # noqa: BLE001 - without a count the run still has its steps
            self._flops_missing = f"the FLOP counter could not start: {exc!r}"
            return
        self._counter, self._counter_thread, self._counted_forwards = counter, threading.get_ident(), 0
        # Left as the optimizer step starts: the update's element-wise math has no FLOPs the counter
        # counts (matmuls, convolutions, attention), and would only pay its dispatch cost.
        self._pre_handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self._optimizer and self._counter is not None:
            self._stop_counting(completed=True)

    def _stop_counting(self, completed: bool) -> None:
        counter, self._counter = self._counter, None
        counting, self._count_hook = self._count_hook, None
        if counting is not None:
            counting.remove()
        if self._pre_handle is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        if counter is None:
            return
        if threading.get_ident() != self._counter_thread:
            # Dispatch modes are per thread: only the thread that entered it can leave it.
            self._flops_missing = "the watch ended in another thread while a step was being counted"
            return
        try:
            counter.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            self._flops_missing = f"the FLOP counter could not stop: {exc!r}"
            return
        if not completed:
            self._flops_missing = "the counted step did not reach its optimizer step"
            return
        self._flops = float(counter.get_total_flops())
        self._flops_dtype = counter.dominant_dtype(self._device_type)
        self._flops_at = self.steps  # the step ending now (0-based)
        self._counted_pending = True

    # ---------------------------------------------------------------- spans and facts

    @property
    def queued(self) -> int:
        """Events the loop put in since the last flush."""
        return len(self._events)

    def flush(self) -> None:
        """Make spans of the queued events (the sampler thread calls this every tick)."""
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        events = self._events
        count = len(events)
        if not count:
            return
        chunk = events[:count]
        del events[:count]  # events appended meanwhile stay for the next flush
        readings = np.array(chunk, dtype=np.float64)
        forward = readings < 0
        at = np.abs(readings) - self.trace.start_clock
        ends = np.flatnonzero(~forward)
        # A step runs from the previous step's end (the first: from the model's first call) to its end.
        starts = at[ends[:-1]]
        start = self._last_end
        if start is None and self._first_call is not None:
            start = self._first_call - self.trace.start_clock
        step_ends = at[ends]
        step_starts = np.concatenate(([np.nan if start is None else start], starts))
        spanned = step_ends >= step_starts  # False where the start was not seen (NaN)
        step_starts, step_ends = step_starts[spanned], step_ends[spanned]
        # Between steps: from a step's end to the training forward right after it.
        forwards = np.flatnonzero(forward)
        after_end = forwards[forwards > 0]
        after_end = after_end[~forward[after_end - 1]]
        between_starts, between_ends = at[after_end - 1], at[after_end]
        if len(forwards) and forwards[0] == 0 and self._between_start is not None:
            between_starts = np.concatenate(([self._between_start], between_starts))
            between_ends = np.concatenate(([at[0]], between_ends))
        if len(between_starts):
            self.between_total = sum((between_ends - between_starts).tolist(), self.between_total)
            self.between_spans += len(between_starts)
        if len(ends):
            self._last_end = float(at[ends[-1]])
            self._between_start = None if forward[-1] else self._last_end
        elif len(forwards):
            self._between_start = None
        if len(step_ends):
            if self._loop_start is None:
                self._loop_start = float(step_starts[0])
            self.spanned += len(step_ends)
            durations = step_ends - step_starts
            timed = np.ones(len(step_ends), dtype=bool)
            if self._counted_end is not None:
                counted = np.flatnonzero(readings[ends][spanned] == self._counted_end)
                if len(counted):  # the counter's cost is in it: not a step time
                    self._counted_step_s = float(durations[counted[0]])
                    timed[counted[0]] = False
            self.step_times.extend(durations[timed].tolist())
            self.step_ends.extend(step_ends[timed].tolist())
            add_span_arrays(self.trace, TRAIN_STEP_SPAN, step_starts, step_ends)
        if len(between_starts):
            add_span_arrays(self.trace, BETWEEN_STEPS_SPAN, between_starts, between_ends)
        if self._counted_end is not None and (readings[ends] == self._counted_end).any():
            self._counted_end = None  # seen (and timed apart if its start was)

    def samples_per_step(self) -> int | None:
        """The first dimension of the trained model's inputs in one step (the most common of those read)."""
        return (Counter(self._samples).most_common(1)[0][0] or None) if self._samples else None

    def facts(self) -> TrainingFacts | None:
        """The loop as its optimizer steps tell it, or None when no optimizer stepped."""
        if not self.steps:
            return None
        self.flush()
        calls = self.forward_calls
        under = sum(self._autocast.values())
        dtype = max(self._autocast, key=lambda d: self._autocast[d]) if self._autocast else None
        facts: TrainingFacts = {
            "optimizer_steps": self.steps,
            "step_times": list(self.step_times),
            "step_ends": list(self.step_ends),
            "forward_calls": calls,
            "eval_forwards": self.eval_forwards,
            "forwards_sampled": self.forwards_sampled,
            "autocast_share": under / calls if calls else 0.0,
            "autocast_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "samples_per_step": self.samples_per_step(),
            "between_s": self.between_total,
            "between_spans": self.between_spans,
            "loop_s": (self._last_end - self._loop_start
                       if self._last_end is not None and self._loop_start is not None else 0.0),
            "spanned_steps": self.spanned,
            "step_source": "forward" if self._by_forward else "optimizer",
            "model_class": self._model_class,
            "device_type": self._device_type if self._model_class is not None else None,
        }
        if self._flops is not None:
            facts["flops_per_step"] = self._flops
            facts["flops_counted_at_step"] = self._flops_at if self._flops_at is not None else FLOPS_AT_STEP
            facts["flops_dtype"] = self._flops_dtype or "fp32"
            if self._counted_step_s is not None:
                facts["flops_step_s"] = self._counted_step_s
        else:
            facts["flops_missing"] = self._flops_missing or (
                "no trained model was matched to the optimizer" if self._model_class is None else
                f"the loop ended before step {FLOPS_AT_STEP + 1}, the one counted" if self.steps <= FLOPS_AT_STEP
                else "the loop ended before a step could be counted after the FLOP counter was loaded"
                if self._counter_ready
                else "the loop ended before the FLOP counter was loaded (torch's dispatch modes import "
                     "torch._dynamo first)")
        return facts


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    return _DTYPE_NAMES.get(name, name)


def _make_counter_class() -> type:
    from torch.utils.flop_counter import FlopCounterMode

    class _DtypeFlopCounter(FlopCounterMode):
        """FlopCounterMode that also tells the dtype each counted FLOP ran in (its operands'), and
        whether it was a convolution (TF32 has a switch of its own for those)."""

        def __init__(self) -> None:
            super().__init__(display=False)
            self.by_kind: dict[tuple[str, bool], int] = {}
            # Only the total is read: no per-module breakdown, so no module and gradient hooks to pay for.
            self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            counts = self.flop_counts["Global"]
            before = counts.get(func_packet, 0)
            result = super()._count_flops(func_packet, out, args, kwargs)
            added = counts.get(func_packet, 0) - before
            if added:
                name = getattr(func_packet, "__name__", str(func_packet))
                dtype = "fp8" if "scaled_mm" in name else _operand_dtype(args)
                kind = (dtype, name in _CONV_OPS)
                self.by_kind[kind] = self.by_kind.get(kind, 0) + added
            return result

        def dominant_dtype(self, device_type: str) -> str:
            """The dtype most FLOPs ran in; FP32 on CUDA counts as TF32 where torch allowed it."""
            from gpuwidget.probes.torch_model import precision_settings

            settings = precision_settings() if device_type == "cuda" else {}
            by_dtype: dict[str, int] = {}
            for (dtype, conv), flops in self.by_kind.items():
                if dtype == "fp32" and settings.get("cudnn_allow_tf32" if conv else "cuda_matmul_allow_tf32"):
                    dtype = "tf32"
                by_dtype[dtype] = by_dtype.get(dtype, 0) + flops
            return max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "fp32"

    return _DtypeFlopCounter


class _GlobalOnly:
    """Stands in for FlopCounterMode's ModuleTracker: every FLOP is the whole model's ("Global")."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def DtypeFlopCounter() -> Any:  # noqa: N802 - builds the class on first use: torch is imported late
    global _counter_class
    if _counter_class is None:
        _counter_class = _make_counter_class()
    return _counter_class()


_counter_class: type | None = None


def _operand_dtype(args: Any) -> str:
    """The dtype of the first operand with two or more dimensions (a matmul's or convolution's input,
    not a 1-d bias)."""
    for arg in args:
        if getattr(arg, "ndim", 0) >= 2 and hasattr(arg, "dtype"):
            return _dtype_name(arg.dtype)
    return "fp32"
