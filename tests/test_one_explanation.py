"""One explanation per measured second: a loop wait that periodic stalls hold, or that a straggling
rank spends while the others wait for it, is named by periodic-stall or rank-straggler, not again by
loop-waits (the real scripts' Lightning sampling callback, nanoGPT's evaluation, the DDP straggler)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwidget.advice.rules.periodic_stall import IN_MODEL_SHARE, wait_kind


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


@pytest.mark.parametrize(("in_model", "theirs"), [(IN_MODEL_SHARE, "Block.forward"), (0.49, "get_batch")])
def test_the_model_run_between_steps_is_the_stalls_evaluation_beside_a_larger_wait_of_every_step(in_model, theirs):
    """nanoGPT's estimate_loss() every N steps samples as the model's own forward: with most of its samples
    inside torch's work it is the stall's evaluation, and get_batch() (every step, more samples) is still
    named; below that share its name says nothing, and the stall holds the largest wait instead."""
    from test_rule_loop_waits import rules_of, stalled_facts

    from gpuwidget.advice.rules import loop_waits, periodic_stall

    forward = {"function": "Block.forward", "name": None, "line": 50, "samples": 30, "in_model": in_model}
    workload = stalled_facts(forward, {"samples": 40})
    stall = periodic_stall.find(workload)
    assert stall is not None
    assert [wait["function"] for wait in loop_waits.stall_waits(workload["loop_waits"], stall, 200)] == [theirs]
    if theirs == "Block.forward":
        found = rules_of(workload)
        assert found["periodic-stall"].change["stall"] == "evaluation"
        assert found[loop_waits.RULE].evidence["function"] == "get_batch"


def straggling_job(with_stack: bool) -> list[dict[str, Any]]:
    """Two DDP ranks stepping together every 12 ms: rank 0 waits 9 ms of each in the all-reduce, rank 1
    1 ms; rank 1's stack samples (when ``with_stack``) put 70% of its steps in a sleep of its loop."""
    from test_rules_ranks import ddp_rank

    ranks = [ddp_rank(0, 12.0, 9.0), ddp_rank(1, 12.0, 1.0)]
    if with_stack:
        ranks[1]["loop_waits"] = [{"function": "Trainer._run_epoch", "file": "multigpu_torchrun.py", "line": 81,
                                   "cell": None, "share": 0.7, "source": "time.sleep(self.delay)"}]
    return ranks


def test_a_ranks_own_time_outside_the_all_reduce_is_a_straggler_where_its_stack_samples_confirm_it():
    from gpuwidget.advice.rules import loop_waits, rank_straggler

    ranks = straggling_job(with_stack=True)
    found = rank_straggler.check({}, {"ranks": ranks}, {})  # type: ignore[arg-type, typeddict-item]
    assert found is not None and found.evidence["straggler"] == 1
    assert found.evidence["measured"] == rank_straggler.OWN_TIME
    assert found.evidence["extra_ms"] == pytest.approx(8.0, abs=0.3)
    assert found.evidence["others_waited_ms"] == pytest.approx(9.0)
    assert found.change["cause"] == "it waits in Trainer._run_epoch() (multigpu_torchrun.py, line 81)"
    assert found.expected_speedup == pytest.approx(12.0 / 4.0, rel=0.05)  # the job's step less the measured extra
    exec(found.code, {})
    # The same wait in the workload (the busiest child's) is not named again by loop-waits.
    workload = {"ranks": ranks, "loop_waits": [{**ranks[1]["loop_waits"][0], "seconds": 1.0, "samples": 50,
                                                "in_loader": 0.0}],
                "stack_samples": {"steps": 100, "loop_samples": 70, "loop_s": 1.2, "basis": "train.between"}}
    assert loop_waits.check({}, workload, {}) is None  # type: ignore[arg-type]


def test_a_straggler_whose_extra_exceeds_the_others_wait_by_the_noise_of_their_medians_is_named_for_the_wait():
    """Fresh-check run 40's in-cell job beside a CPU hog, as ``benchmarks/ddp_straggler.py`` measured it:
    lockstep ranks whose step medians read 14.5 and 13.0 ms (noise: they meet every step), rank 0 waiting
    11 ms of each in the all-reduce, rank 1 sleeping outside the model's work. Rank 1's own time then
    exceeds rank 0's by 12 ms, more than rank 0 was measured waiting; the 11 ms that reached rank 0 are
    the straggler's (this job was named no straggler when the larger figure had to be under the wait)."""
    from test_rules_ranks import ddp_rank

    from gpuwidget.advice.rules import rank_straggler

    ranks = [ddp_rank(0, 13.0, 11.0), ddp_rank(1, 14.5, 0.5)]
    ranks[1]["loop_waits"] = [{"function": "Trainer._run_epoch", "file": "multigpu_torchrun.py", "line": 81,
                               "cell": None, "share": 0.7, "source": "time.sleep(self.delay)"}]
    judged = rank_straggler.own_time(ranks, [0.013, 0.0145], [0.00026, 0.00029], 0.0145)
    assert judged is not None and judged.extra_s > judged.waited_s  # what the old gate refused
    found = rank_straggler.check({}, {"ranks": ranks}, {})  # type: ignore[arg-type, typeddict-item]
    assert found is not None and found.evidence["straggler"] == 1
    assert found.evidence["extra_ms"] == found.evidence["others_waited_ms"] == pytest.approx(11.0)
    assert found.expected_speedup == pytest.approx(14.5 / 3.5, rel=0.01)
    # The same job whose other rank waited too little for it to be more than noise is no straggler's.
    ranks[0] = ddp_rank(0, 13.0, 0.8)
    assert rank_straggler.check({}, {"ranks": ranks}, {}) is None  # type: ignore[arg-type, typeddict-item]


def test_ddp_figures_alone_name_no_straggler_on_own_time():
    # Which rank reaches the all-reduce last varies from step to step on a symmetric job: DDP's sampled
    # figures can show this difference by chance, and without the stack's evidence it is not a straggler.
    from gpuwidget.advice.rules import rank_straggler

    assert rank_straggler.check({}, {"ranks": straggling_job(with_stack=False)}, {}) is None  # type: ignore[arg-type]
