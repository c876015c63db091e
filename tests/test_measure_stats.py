"""The measurement's statistics and its change keys, without running a model: the sign-test interval's
coverage at its edges, the verdict from the interval alone, and every bad key or value refused."""

from __future__ import annotations

import math
import random

import pytest

from gpuwidget.measure.ab import DECIDE_BLOCKS, TARGET_HALF_WIDTH
from gpuwidget.measure.changes import check_change, finding_changes
from gpuwidget.measure.stats import NEGLIGIBLE, Interval, may_stop, median_interval, verdict


def test_six_blocks_are_the_fewest_with_a_95_percent_interval():
    five = median_interval([1.0, 1.1, 1.2, 1.3, 1.4])
    six = median_interval([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    assert five is not None and six is not None
    assert five.coverage == pytest.approx(1 - 2 / 32) and five.coverage < 0.95
    assert six.coverage == pytest.approx(1 - 2 / 64) and six.coverage >= 0.95
    assert (six.low, six.high) == (1.0, 1.5)  # the range: k = 1


def test_more_blocks_drop_the_extremes_from_the_interval():
    ratios = [1.0 + i / 100 for i in range(30)]
    interval = median_interval(ratios)
    assert interval is not None
    # n = 30: the 10th and 21st order statistics (P(B <= 9) = 0.021, P(B <= 10) = 0.049 > 0.025).
    assert interval.low == pytest.approx(1.09) and interval.high == pytest.approx(1.20)
    assert interval.coverage >= 0.95


def test_the_interval_covers_the_true_median_at_least_95_percent_of_the_time():
    rng = random.Random(7)
    misses = 0
    trials = 2000
    for _ in range(trials):
        ratios = [math.exp(rng.gauss(0.1, 0.2)) for _ in range(12)]
        interval = median_interval(ratios)
        assert interval is not None
        misses += not (interval.low <= math.exp(0.1) <= interval.high)
    assert misses / trials <= 0.05 + 0.012  # binomial slack for 2000 trials


def test_one_wild_block_moves_the_interval_by_one_rank_only():
    calm = [1.20, 1.21, 1.22, 1.23, 1.24, 1.25, 1.26, 1.27, 1.28, 1.29]
    wild = calm[:-1] + [40.0]  # a neighbour's burst during one block
    assert median_interval(wild).low == median_interval(calm).low


@pytest.mark.parametrize(("low", "high", "expected"), [
    (1.001, 1.0 + NEGLIGIBLE + 0.001, "faster"),  # all above 1, reaching past a negligible gain
    (1.001, 1.0 + NEGLIGIBLE - 0.001, "no difference"),  # excludes 1 but all of it negligible
    (0.999, 1.30, "no difference"),  # straddles 1: not decided
    (1.0 - NEGLIGIBLE - 0.001, 0.999, "slower"),
    (1.0 - NEGLIGIBLE + 0.001, 0.999, "no difference"),
    (0.5, 0.9, "slower"),
])
def test_the_verdict_reads_the_interval_at_its_edges(low, high, expected):
    assert verdict(Interval(math.sqrt(low * high), low, high, 0.96, 8)) == expected


def test_fewer_than_six_blocks_decide_nothing_however_far_from_one():
    five = median_interval([1.5, 1.6, 1.7, 1.8, 1.9])
    assert five is not None and five.low > 1.0 + NEGLIGIBLE
    assert verdict(five) == "no difference"
    assert verdict(median_interval([1.5, 1.6, 1.7, 1.8, 1.9, 2.0])) == "faster"


def test_a_median_above_one_with_an_interval_across_it_is_no_difference():
    interval = median_interval([0.9, 1.5, 1.6, 1.7, 1.8, 1.9])
    assert interval is not None and interval.median > 1.5
    assert verdict(interval) == "no difference"
    assert verdict(None) == "no difference"


@pytest.mark.parametrize(("change", "message"), [
    ({"autocast": "fp8"}, "autocast must be one of 'bfloat16', 'float16'"),
    ({"colour": "blue"}, "unknown change key 'colour'"),
    ({"tf32": "yes"}, "tf32 must be True or False"),
    ({"compile": "fast"}, "compile must be True or a mode"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"batch_size": True}, "batch_size must be a positive integer"),
    ({"num_workers": -1}, "num_workers must be an integer >= 0"),
    ({"prefetch_factor": 4, "num_workers": 0}, "prefetch_factor needs num_workers > 0"),
    ({}, "the change is empty"),
    ("autocast", "a change is a dict"),
])
def test_bad_changes_are_refused_with_the_reason(change, message):
    with pytest.raises(ValueError, match=message):
        check_change(change)


def test_each_rules_change_maps_to_the_keys_that_try_it():
    assert finding_changes("fp32-math", {"float32_matmul_precision": "high", "autocast_dtype": "bfloat16"}) == [
        {"tf32": True}, {"autocast": "bfloat16"}]
    assert finding_changes("launch-bound", {"torch_compile": True}) == [{"compile": True}]
    assert finding_changes("launch-bound", {"compile_mode": "reduce-overhead"}) == [{"compile": "reduce-overhead"}]
    assert finding_changes("small-batch", {"batch_size": 256}) == [{"batch_size": 256}]
    assert finding_changes("dataloader-starved", {"num_workers": 4, "persistent_workers": True}) == [
        {"num_workers": 4, "persistent_workers": True}]
    assert finding_changes("pageable-transfer", {"pin_memory": True}) == [{"pin_memory": True}]
    # Not a step's change: a launcher, an allocator setting, the machine's.
    assert finding_changes("data-parallel", {"launcher": "torchrun", "nproc_per_node": 2}) == []
    assert finding_changes("memory-pressure", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == []
    assert finding_changes("cpu-contention", {}) == []


def simulated_verdict(rng: random.Random, true_ratio: float, noise: float, budget_blocks: int) -> str:
    """The verdict of one simulated measurement: a block's ratio is ``true_ratio`` times log-normal noise,
    looked at after every block as Run.measure does, stopped early where may_stop says, else at the budget."""
    ratios: list[float] = []
    while len(ratios) < budget_blocks:
        ratios.append(true_ratio * math.exp(rng.gauss(0.0, noise)))
        if may_stop(ratios, DECIDE_BLOCKS, TARGET_HALF_WIDTH):
            break
    return verdict(median_interval(ratios))


@pytest.mark.parametrize("noise", [0.02, 0.05, 0.10])
def test_a_change_that_does_nothing_is_called_faster_or_slower_at_most_one_time_in_twenty(noise):
    rng = random.Random(11)
    trials = 2000
    wrong = sum(simulated_verdict(rng, 1.0, noise, budget_blocks=40) != "no difference" for _ in range(trials))
    assert wrong / trials <= 0.05 + 0.012  # binomial slack for 2000 trials


def test_a_real_gain_still_stops_early_and_is_called_faster():
    rng = random.Random(12)
    ratios: list[float] = []
    while not may_stop(ratios, DECIDE_BLOCKS, TARGET_HALF_WIDTH):
        ratios.append(1.3 * math.exp(rng.gauss(0.0, 0.03)))
    assert DECIDE_BLOCKS <= len(ratios) <= 12
    assert verdict(median_interval(ratios)) == "faster"


class _ClockedSide:
    """A side whose every run takes ``run_s`` of a fake clock at a rate within ±50% (noise that never decides)."""

    loader = None

    def __init__(self, clock: list[float], run_s: float, seed: int) -> None:
        self.clock, self.run_s, self.rng = clock, run_s, random.Random(seed)

    def run(self, steps: int, lead: bool = True) -> tuple[float, float]:
        self.clock[0] += self.run_s
        return 100.0 * self.run_s * self.rng.uniform(0.5, 1.5), self.run_s


@pytest.mark.parametrize(("budget_s", "run_s", "blocks", "ends_by"), [
    (10.0, 0.3, 8, 10.0),   # 1.2 s blocks: the ninth would end at 10.8 s, so eight, done by 9.6 s
    (5.0, 0.4, 6, 9.6),     # 1.6 s blocks: the six blocks that give an interval run past the budget
    (3.0, 1.0, 1, 4.0),     # 4 s blocks: a second would end past twice the budget, so not even six
])
def test_blocks_end_within_the_budget_once_six_are_done_and_never_past_twice_it(monkeypatch, budget_s, run_s,
                                                                               blocks, ends_by):
    from gpuwidget.measure import ab

    clock = [0.0]
    monkeypatch.setattr(ab, "now", lambda: clock[0])
    a, b = _ClockedSide(clock, run_s, 1), _ClockedSide(clock, run_s, 2)
    done = ab._Progress()
    # (a wide noise keeps the interval from deciding early: only the budget ends the blocks)
    ab._blocks(a, b, [1, 1], [0.1, 0.1], 0.0, budget_s, budget_s, None, done)
    assert len(done.ratios) == blocks
    assert clock[0] <= ends_by + 1e-9
