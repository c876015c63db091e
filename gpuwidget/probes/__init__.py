"""Workload probes: observe the user's training loop from inside the process, only during a watch.

Probes need torch, and gpuwidget never imports torch itself: when the watch starts
before the cell has imported torch (``import torch`` inside the watched cell), the
sampler thread installs them as soon as torch appears in ``sys.modules``. Whatever
happens in the cell, :meth:`Probes.uninstall` leaves nothing patched or hooked.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from gpuwidget.clock import now
from gpuwidget.facts import WorkloadFacts
from gpuwidget.trace import Trace

if TYPE_CHECKING:
    from gpuwidget.probes.batch_capture import CapturedBatch

log = logging.getLogger("gpuwidget")

# The span kinds the probes record in the Trace (the summary, the report and the live view read them).
DATA_WAIT_SPAN = "loader.wait"  # blocked in a DataLoader's next()
STEP_SPAN = "step"  # from one next() to the following one
TRAIN_STEP_SPAN = "train.step"  # one optimizer step of the trained model: from the previous one's end to its end
BETWEEN_STEPS_SPAN = "train.between"  # from an optimizer step's end to the trained model's next training forward

# Seconds between the sampler ticks that make spans and figures of what the probes queued. Each flush
# costs a fixed ~0.3 ms on the sampler thread (numpy's calls, from cold caches after the loop's steps)
# besides its share per step, with the GIL held: once a second rather than every tick takes three
# quarters of it off a fast loop at the default interval. The spans reach the live view and the
# stack sampler that much later (the first ones at the first tick after the loop starts); the watch's end
# flushes whatever is queued.
FLUSH_EVERY_S = 1.0


class WatchedObjects(TypedDict, total=False):
    """The user's live objects the probes saw (:meth:`Probes.objects`), for measuring advice; nothing is copied."""

    loaders: list[Any]  # DataLoaders, the one that fed the optimizer's steps first
    model: Any  # the trained model, or None
    optimizer: weakref.ref[Any] | None
    batch: CapturedBatch | None  # a copy of one training forward's inputs


class Probes:
    """The probes of one watch."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._lock = threading.Lock()
        self._data: Any = None
        self._model: Any = None
        self._cuda: Any = None
        self._steps: Any = None
        self.errors: list[str] = []
        self._closed = False
        self._flushed_at = -float("inf")
        # The watched thread's stack at each tick (probes.stack): the thread building the probes is the cell's.
        self._stack = _stack_sampler(trace)

    def sample(self, _trace: Trace | None = None) -> None:
        """The watched thread's stack, first thing on a sampler tick (before the sources are read)."""
        self.arm()
        if self._stack is not None:
            self._stack.sample()

    def arm(self) -> None:
        """Before a tick's stack sample: the step probe's window on the trained model's next training
        forward (probes.torch_steps), which tells whether the sample fell between two steps."""
        steps = self._steps
        if steps is not None:
            try:
                steps.arm()
            except Exception as exc:  # noqa: BLE001 - without a window the sample counts as the step's
                if len(self.errors) < 8:
                    self.errors.append(f"step probe window: {exc!r}")

    def poll(self, _trace: Trace | None = None) -> None:
        """Install the probes once torch is importable without importing it ourselves; once
        installed, move what they queued into the Trace every :data:`FLUSH_EVERY_S`.

        Called at the start of the watch and then on every sampler tick (cheap: a dict lookup).
        """
        if self._stack is not None:
            self._stack.tick()
        if self._data is not None:
            t = time.monotonic()  # not the watch's clock: a reading of its own on no user's timeline
            if t - self._flushed_at >= FLUSH_EVERY_S and self.flush():
                self._flushed_at = t  # the first records are taken in at the tick they come to
            if self._steps is not None:
                self._steps.prepare()  # once: the FLOP counter's imports, off the loop's thread, at once
            return
        if self._closed or "torch.utils.data" not in sys.modules:
            return
        with self._lock:
            if self._data is not None or self._closed:
                return
            try:
                from gpuwidget.probes.torch_data import DataLoaderProbe
                from gpuwidget.probes.torch_model import CudaMemoryProbe, ModelProbe
                from gpuwidget.probes.torch_steps import StepProbe

                data, model, cuda = DataLoaderProbe(self.trace), ModelProbe(), CudaMemoryProbe()
                steps = StepProbe(self.trace, model, data)
                data.install()
                model.install()
                cuda.install()
                steps.install()
                self._data, self._model, self._cuda, self._steps = data, model, cuda, steps
            except Exception as exc:  # noqa: BLE001 - without probes the run still has metrics
                self.errors.append(f"probes unavailable: {exc!r}")
                log.warning("gpuwidget: workload probes unavailable: %s", exc)
                self._closed = True

    def flush(self) -> bool:
        """Make spans and figures of what the loop queued since the last flush; False where it queued nothing."""
        data, steps = self._data, self._steps
        if data is None:
            return False
        queued = data.queued or (steps is not None and steps.queued)
        data.flush()
        if steps is not None:
            steps.flush()
        return bool(queued)

    def uninstall(self) -> None:
        """Remove every hook and patch; safe to call more than once."""
        with self._lock:
            self._closed = True
            for probe in (self._steps, self._data, self._model, self._cuda):
                if probe is None:
                    continue
                try:
                    probe.uninstall()
                except Exception as exc:  # noqa: BLE001
                    self.errors.append(f"could not remove {type(probe).__name__}: {exc!r}")
            if self._data is not None:
                self._data.finish(now())
            if self._stack is not None:
                self._stack.close()

    def detach_after_fork(self) -> None:
        """In a forked child: put torch back without taking any lock (another thread of the parent
        may have held one at the fork, and that thread does not exist here) and record nothing more."""
        self._closed = True
        data, model, steps = self._data, self._model, self._steps
        if data is not None and data.installed:
            from torch.utils.data import DataLoader
            from torch.utils.data.dataloader import _BaseDataLoaderIter

            for owner, name, key in ((DataLoader, "__init__", "init"), (DataLoader, "__iter__", "iter"),
                                     (_BaseDataLoaderIter, "__next__", "next")):
                if owner.__dict__.get(name) is data._wrappers[key]:
                    setattr(owner, name, data._originals[key])
            data.gc.uninstall()
            data.installed = False
        if model is not None:
            with contextlib.suppress(Exception):  # removing a hook handle takes no lock
                model.uninstall()
        if steps is not None:
            with contextlib.suppress(Exception):
                steps.detach()
        self._data = self._model = self._cuda = self._steps = None

    def objects(self) -> WatchedObjects:
        """The live loaders (the one that fed the optimizer's steps first, then the busiest) and the
        trained model the probes saw, for measuring advice; ``optimizer``: a weak reference to the
        optimizer the step probe counted (or None), ``batch``: the copy of one training forward's
        inputs (probes.batch_capture.CapturedBatch, or None)."""
        loaders = []
        if self._data is not None:
            ranked = sorted(self._data.stats, key=lambda s: (s.steps_fed, s.wait_total + s.compute_total),
                            reverse=True)
            loaders = [s.loader for s in ranked if s.loader is not None]
        model = self._model.model() if self._model is not None else None
        optimizer = self._steps.optimizer() if self._steps is not None else None
        return {"loaders": loaders, "model": model,
                "optimizer": weakref.ref(optimizer) if optimizer is not None else None,
                "batch": self._steps.captured if self._steps is not None else None}

    def progress(self) -> tuple[int, int, float, float] | None:
        """The training loop's running totals so far: (steps, samples, wait s, loop s); None before one.

        The loop is the loader that fed the optimizer's steps (else the busiest loader); without a
        loader, the optimizer's steps (no wait measured) since the first one ended.
        """
        data = self._data
        if data is None:
            return None
        stats = list(data.stats)
        busiest = max(stats, key=lambda s: (s.steps_fed, s.wait_total + s.compute_total), default=None)
        if busiest is not None:
            return busiest.steps, busiest.samples, busiest.wait_total, busiest.wait_total + busiest.compute_total
        steps = self._steps
        if steps is None or not steps.steps:
            return None
        loop = sum(steps.step_times)
        return steps.steps, steps.steps * (steps.samples_per_step() or 0), 0.0, loop

    def facts(self, namespace: Mapping[str, Any] | None) -> WorkloadFacts:
        """WorkloadFacts as plain data: loaders, model, CUDA memory, torch version."""
        names = _names(namespace)
        facts: WorkloadFacts = {"torch": None, "loaders": [], "model": None, "cuda": None, "training": None}
        if self._data is not None:
            from gpuwidget.probes import origin

            # accelerate's prepared loader runs a plain DataLoader inside it: the user's name
            # for the wrapper names that one; Trainer and Accelerator names go into suggestions.
            for wrapped, wrapper_name in origin.wrapped_loaders(namespace).items():
                names.setdefault(wrapped, wrapper_name)
            facts["frameworks"] = origin.framework_names(namespace)
        torch = sys.modules.get("torch")
        if torch is not None:
            facts["torch"] = getattr(torch, "__version__", None)
        # Each fact on its own: one probe's failure is recorded and never empties the run.
        for key, probe, read in (("training", self._steps, lambda p: p.facts()),
                                 ("loaders", self._data, lambda p: origin.placed(p.facts(names), namespace)),
                                 ("model", self._model, lambda p: p.facts(names)),
                                 ("cuda", self._cuda, lambda p: p.facts())):
            if probe is None:
                continue
            try:
                facts[key] = read(probe)  # type: ignore[literal-required]
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{key} facts unavailable ({type(probe).__name__}): {exc!r}")
        if self._data is not None:
            facts["gc"] = self._data.gc.facts()
        if self._stack is not None:
            try:
                facts["loop_waits"], facts["stack_samples"] = self._stack.facts(namespace)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"loop_waits unavailable (StackSampler): {exc!r}")
            self.errors.extend(error for error in self._stack.errors[:1] if error not in self.errors)
        if self.errors:
            facts["probe_errors"] = list(self.errors)
        return facts


def _stack_sampler(trace: Trace) -> Any:
    """The stack sampler of a watch; None in a child process, whose span buffer is no Trace to attribute in."""
    if not isinstance(trace, Trace):
        return None
    from gpuwidget.probes.stack import StackSampler

    return StackSampler(trace)


def _names(namespace: Mapping[str, Any] | None) -> dict[int, str]:
    """id(object) -> the user's name for it; private names (IPython's ``_``, ``_i3``) are skipped."""
    names: dict[int, str] = {}
    for name, value in (namespace or {}).items():
        if not name.startswith("_"):
            names.setdefault(id(value), name)
    return names
