"""Prefetcher ahead of a reader whose arguments advance: ``get_batch(source, i)`` with ``i`` moving by
``bptt`` (PyTorch's word-language-model example) is fetched one call ahead at ``i + bptt``, with the
same batches as without it, and a call off the step is answered as asked."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import torch

from gpuwidget.prefetch import Prefetcher, _Call, next_call

SOURCE = torch.arange(400).reshape(100, 4)


def make_reader(latency: float, calls: list[tuple[int, int]]):
    def get_batch(source, i, bptt=5):
        calls.append((i, bptt))
        time.sleep(latency)
        return source[i:i + bptt], source[i + 1:i + 1 + bptt]
    return get_batch


def test_a_constant_step_of_an_integer_argument_is_predicted_other_arguments_kept():
    calls = deque([_Call((SOURCE, 0), {"bptt": 5}), _Call((SOURCE, 5), {"bptt": 5}), _Call((SOURCE, 10), {"bptt": 5})])
    predicted = next_call(calls)
    assert predicted.args[0] is SOURCE and predicted.args[1] == 15 and predicted.kwargs == {"bptt": 5}
    calls.append(_Call((SOURCE, 12), {"bptt": 5}))  # the step changed: 5 then 2
    assert next_call(calls).args[1] == 12
    other = torch.zeros(3)
    calls.extend([_Call((SOURCE, 20), {}), _Call((SOURCE, 25), {}), _Call((other, 30), {})])  # another tensor
    assert next_call(calls).args == (other, 30)
    flags = deque([_Call((False,), {}), _Call((True,), {}), _Call((False,), {})])
    assert next_call(flags).args == (False,)  # booleans are no step


@pytest.mark.serial  # judges the overlap's time
def test_a_reader_advancing_by_bptt_is_fetched_ahead_with_the_same_batches_and_faster():
    plain_calls: list[tuple[int, int]] = []
    plain = make_reader(0.01, plain_calls)
    expected = [plain(SOURCE, i) for i in range(0, 95, 5)]
    ahead_calls: list[tuple[int, int]] = []
    reader = Prefetcher(make_reader(0.01, ahead_calls))
    started = time.perf_counter()
    got = []
    for i in range(0, 95, 5):
        got.append(reader(SOURCE, i))
        time.sleep(0.01)  # the step computes while the next batch is read
    elapsed = time.perf_counter() - started
    evaluation = reader(SOURCE, 50, bptt=3)  # off the step: answered as asked
    reader.close()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    assert torch.equal(evaluation[0], SOURCE[50:53])
    # Serially 19 reads and 19 steps take 0.38 s; from the third call on, each read overlaps a step.
    assert elapsed < 0.8 * 19 * 0.02
    assert (95, 5) in ahead_calls  # read ahead past the last call, then dropped
    assert not [t for t in threading.enumerate() if t.name.startswith("gpuwidget-prefetch")]
