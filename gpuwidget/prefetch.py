"""Prefetcher: the user's own batch function, run one call ahead on a background thread.

``get_batch = Prefetcher(get_batch)`` is what the ``loop-waits`` finding offers when the loop
waits in a function of the user's between steps: each call returns the batch fetched while the
previous step computed, and starts fetching the next one with the same arguments, or, where the
last three calls moved integer arguments by the same step (``get_batch(train_data, i)`` with ``i``
advancing by ``bptt``, as PyTorch's word-language-model example reads its data), with those
arguments moved by that step once more. Storage
reads, network, ``time.sleep`` and torch's C code release the GIL, so the fetch overlaps the
loop's step; Python work inside the function shares the interpreter with the loop and overlaps
less. A generator function (``for x, y in batches():``) gets an iterator that pulls one item ahead.

The same batches, in the same order, as without it:

* the function runs one call at a time, in the order the loop asks for batches, so a function
  that draws its indices from torch's, NumPy's or Python's global generator (nanoGPT's
  ``get_batch`` with ``torch.randint``) draws the same numbers;
* a call with other arguments than the one prefetched (``get_batch("val")`` in an evaluation,
  after ``get_batch("train")`` was fetched ahead) waits for the call ahead, puts the generators
  back as they were before it and drops its batch, then runs as asked: the next
  ``get_batch("train")`` draws again what it would have drawn. Where the call ahead drew nothing
  (a function that reads the next chunk of a file), its batch is kept for the next call with
  those arguments instead, so no chunk is skipped;
* :meth:`Prefetcher.close` does the same for the call still ahead: the generators end as they
  would have without prefetching.

This holds when nothing else draws from the same generators between two calls. A model with
dropout on the CPU draws from torch's CPU generator while the next batch is fetched, so the
draws interleave differently: each batch is still the function's own random batch, not the one
the unprefetched loop would have drawn (on a GPU, dropout draws from the CUDA generator and the
order is kept). A generator function's iterator is pulled one item ahead, which cannot be put
back if the loop stops early.
"""

from __future__ import annotations

import functools
import inspect
import random
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

THREAD_NAME = "gpuwidget-prefetch"
# Batches fetched ahead for other arguments and kept (functions that draw nothing, e.g. sequential
# readers, one per split); the oldest goes beyond this.
MAX_SPARES = 8
# Argument types compared by value to tell whether a call is the one fetched ahead; others by identity.
_PLAIN = (str, bytes, int, float, bool, complex, type(None))


class Prefetcher:
    """``function`` run one call ahead on a background thread, same results in the same order."""

    def __init__(self, function: Callable[..., Any]) -> None:
        if isinstance(function, Prefetcher):  # the snippet pasted twice prefetches once
            function.close()
            function = function.function
        self.function: Callable[..., Any] = function
        functools.update_wrapper(self, function)  # its name and docstring; attributes it lacks are skipped
        self._generator = inspect.isgeneratorfunction(function)
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: _Ahead | None = None
        self._spares: list[tuple[_Call, _Outcome]] = []
        self._calls: deque[_Call] = deque(maxlen=3)  # the latest calls, for an argument's step
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._generator:
            return _AheadIterator(self.function(*args, **kwargs), self._worker)
        call = _Call(args, kwargs)
        with self._lock:
            outcome = self._take(call)
            self._calls.append(call)
            if outcome.error is None and not self._closed:
                following = next_call(self._calls)
                self._ahead = _Ahead(following, self._worker().submit(_run, self.function, following))
        return outcome.result()

    def close(self) -> None:
        """Stop fetching ahead: the call ahead is put back where it drew from the generators."""
        with self._lock:
            self._closed = True
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                self._settle(ahead)
            self._spares.clear()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return self._executor

    def _take(self, call: _Call) -> _Outcome:
        """The result for ``call``: the one fetched ahead, a spare, or the function run now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.call == call:
                return ahead.future.result()
            self._settle(ahead)
        for index, (spare, outcome) in enumerate(self._spares):
            if spare == call:
                del self._spares[index]
                return outcome
        return _Outcome(self.function(*call.args, **call.kwargs))

    def _settle(self, ahead: _Ahead) -> None:
        """A call ahead that is not wanted now: undo its draws where nothing drew after it, else keep it."""
        outcome = ahead.future.result()
        if outcome.before is not None and outcome.after is not None and not outcome.before.same(outcome.after) \
                and outcome.after.same(_RandomState.capture()):
            outcome.before.restore()
            return
        if outcome.error is None:
            self._spares.append((ahead.call, outcome))
            del self._spares[:-MAX_SPARES]


class _AheadIterator:
    """An iterator read one item ahead on the prefetcher's thread."""

    def __init__(self, iterator: Iterator[Any], worker: Callable[[], ThreadPoolExecutor]) -> None:
        self._iterator = iterator
        self._worker = worker
        self._ahead: Future[Any] | None = None

    def __iter__(self) -> _AheadIterator:
        return self

    def __next__(self) -> Any:
        ahead, self._ahead = self._ahead, None
        item = ahead.result() if ahead is not None else next(self._iterator)
        self._ahead = self._worker().submit(next, self._iterator)
        return item


class _Call:
    """The arguments of one call, compared as the prefetcher needs (plain values by value)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Call):
            return NotImplemented
        return _same(self.args, other.args) and self.kwargs.keys() == other.kwargs.keys() and all(
            _same(value, other.kwargs[key]) for key, value in self.kwargs.items())

    __hash__ = None  # type: ignore[assignment]


def next_call(calls: deque[_Call]) -> _Call:
    """The call expected after the latest of ``calls``: the same arguments, or, where the last three calls
    moved integer arguments by the same step and kept every other one, those moved by it once more."""
    latest = calls[-1]
    if len(calls) < 3:
        return latest
    first, second = _step(calls[-3], calls[-2]), _step(calls[-2], latest)
    if first is None or first != second:
        return latest
    args = tuple(value + first[0][index] if index in first[0] else value for index, value in enumerate(latest.args))
    kwargs = {key: value + first[1][key] if key in first[1] else value for key, value in latest.kwargs.items()}
    return _Call(args, kwargs)


def _step(a: _Call, b: _Call) -> tuple[dict[int, int], dict[str, int]] | None:
    """How ``b``'s integer arguments differ from ``a``'s (by position, by keyword), where every other
    argument is the same and at least one integer moved; else None."""
    if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return None
    moved: tuple[dict[int, int], dict[str, int]] = ({}, {})
    pairs: list[tuple[int, Any, Any, Any]] = [(0, index, x, b.args[index]) for index, x in enumerate(a.args)]
    pairs += [(1, key, x, b.kwargs[key]) for key, x in a.kwargs.items()]
    for where, key, x, y in pairs:
        if _same(x, y):
            continue
        if type(x) is not int or type(y) is not int:  # bool is not a step
            return None
        moved[where][key] = y - x  # type: ignore[index]
    return moved if moved[0] or moved[1] else None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(a, _PLAIN) and a == b


@dataclass(frozen=True)
class _Ahead:
    call: _Call
    future: Future[_Outcome]


@dataclass(frozen=True)
class _Outcome:
    """A call's result or exception, and the generators' state before and after it (calls ahead)."""

    value: Any = None
    error: BaseException | None = None
    before: _RandomState | None = None
    after: _RandomState | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def _run(function: Callable[..., Any], call: _Call) -> _Outcome:
    """One call ahead, on the prefetcher's thread."""
    before = _RandomState.capture()
    try:
        value = function(*call.args, **call.kwargs)
    except Exception as exc:  # noqa: BLE001 - raised on the loop's thread, at the call it belongs to
        return _Outcome(error=exc, before=before, after=_RandomState.capture())
    return _Outcome(value, before=before, after=_RandomState.capture())


@dataclass(frozen=True)
class _RandomState:
    """The global random generators a batch function may draw from: Python's, NumPy's, torch's (CPU,
    and CUDA's where CUDA started), each only where its module is imported."""

    python: Any
    numpy: Any
    torch: Any
    cuda: Any

    @classmethod
    def capture(cls) -> _RandomState:
        numpy = sys.modules.get("numpy")
        torch = sys.modules.get("torch")
        cuda = None
        if torch is not None and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return cls(random.getstate(), numpy.random.get_state() if numpy is not None else None,
                   torch.get_rng_state() if torch is not None else None, cuda)

    def same(self, other: _RandomState) -> bool:
        return (self.python == other.python and _same_numpy(self.numpy, other.numpy)
                and _same_tensors(self.torch, other.torch) and _same_tensors(self.cuda, other.cuda))

    def restore(self) -> None:
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None:
            torch.set_rng_state(self.torch)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)


def _same_numpy(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    import numpy

    return len(a) == len(b) and all(numpy.array_equal(x, y) if isinstance(x, numpy.ndarray) else x == y
                                    for x, y in zip(a, b))


def _same_tensors(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    import torch

    if isinstance(a, list):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))

