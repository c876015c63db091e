"""One explanation per measured second: a loop wait that periodic stalls hold, or that a straggling
rank spends while the others wait for it, is named by periodic-stall or rank-straggler, not again by
loop-waits (the real scripts' Lightning sampling callback, nanoGPT's evaluation, the DDP straggler)."""

from __future__ import annotations

import pytest

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules.periodic_stall import STALL_HOLDS, explains, wait_kind


def stall(kind: str, stall_s: float = 0.2, stalls: int = 5) -> Finding:
    return Finding(rule="periodic-stall", severity="critical", title="",
                   evidence={"stall_s": stall_s, "stalls": stalls}, suggestion="", change={"stall": kind}, code="",
                   expected_speedup=2.0)


@pytest.mark.parametrize(("wait", "kind"), [
    ({"function": "Block.forward", "in_model": 0.9}, "evaluation"),  # the model ran between steps
    ({"function": "Block.forward", "in_model": 0.4}, None),
    ({"function": "estimate_loss"}, None),
    ({"function": "ImageSampler._sample"}, "evaluation"),
    ({"function": "save_checkpoint", "in_model": 0.9}, "checkpoint"),
    ({"function": "write", "file": "torch/serialization.py"}, "checkpoint"),
])
def test_what_a_loop_wait_is_from_its_name_or_from_torchs_work_between_steps(wait, kind):
    assert wait_kind(wait) == kind


def test_a_wait_is_the_stalls_when_it_fits_in_their_seconds_and_is_their_kind():
    evaluation = {"function": "Block.forward", "in_model": 0.9}
    assert explains({**evaluation, "seconds": STALL_HOLDS * 1.0}, stall("evaluation"))
    assert not explains({**evaluation, "seconds": STALL_HOLDS * 1.0 + 0.01}, stall("evaluation"))
    assert not explains({**evaluation, "seconds": 0.5}, stall("checkpoint"))
    assert explains({"function": "get_batch", "seconds": 0.5}, stall("unknown"))  # kind not measured
    assert not explains({"function": "get_batch", "seconds": 0.5}, stall("evaluation"))
