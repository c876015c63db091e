"""Measure continues the finding: the tuner times the finding's own suggestion and its neighbours,
says how the suggestion fared, chooses a row of its own table, announces the time it then takes,
and shows its code with the panel's Copy button.

Real loaders over a dataset that sleeps per item (a storage wait): its timings hold on a host whose
cores other processes take. The wording and choice rules are also pinned on fixed trials.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gpuwidget
from gpuwidget.measure.tuner import (
    ESTIMATE_MARGIN,
    MEASURE_BATCHES,
    Trial,
    TuneResult,
    _choose,
    suggestion_plan,
    timed_batches,
    tune_for_run,
    tune_loader,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Storage(Dataset):
    """Items that take ``latency`` seconds each, asleep (as reads from slow storage)."""

    def __init__(self, items: int, latency: float) -> None:
        self.items, self.latency = items, latency

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.latency)
        return torch.full((3,), float(index))


def result(trials: list[Trial], chosen: Trial, target: float | None = None) -> TuneResult:
    return TuneResult(None, "train_loader", trials, chosen, target, 20.0, 1.0,
                      {"name": "train_loader", "dataset_name": "train_ds",
                       "settings": {"batch_size": 8, "num_workers": 0}})


# ------------------------------------------------------------------ the plan


def test_the_plan_is_the_loader_as_it_is_then_the_suggestion_and_its_neighbours():
    plan = suggestion_plan(0, {"num_workers": 5, "prefetch_factor": 4, "persistent_workers": True}, cap=8)
    # The suggestion first: where the budget ends early, what is left out is a neighbour.
    assert plan.changes == [{}, {"num_workers": 5, "prefetch_factor": 4}, {"num_workers": 4, "prefetch_factor": 4},
                            {"num_workers": 6, "prefetch_factor": 4}]
    assert plan.suggested == {"num_workers": 5, "prefetch_factor": 4}  # persistence is not timed


def test_a_neighbour_that_is_the_loader_as_it_is_is_not_timed_twice_and_none_without_workers_prefetches():
    assert suggestion_plan(0, {"num_workers": 1}, cap=2).changes == [{}, {"num_workers": 1}, {"num_workers": 2}]
    plan = suggestion_plan(2, {"num_workers": 1, "prefetch_factor": 4}, cap=2)
    assert plan.changes == [{}, {"num_workers": 1, "prefetch_factor": 4}, {"num_workers": 0},
                            {"num_workers": 2, "prefetch_factor": 4}]
    # At the cap, no count above it; a suggestion above the cap (storage waits) is still timed.
    assert [c.get("num_workers") for c in suggestion_plan(0, {"num_workers": 2}, cap=2).changes] == [None, 2, 1]
    assert [c.get("num_workers") for c in suggestion_plan(0, {"num_workers": 6}, cap=4).changes] == [None, 6, 5]


def test_timed_batches_are_whole_rounds_of_the_workers():
    assert [timed_batches(w) for w in (0, 1, 2, 5, 7, 16)] == [MEASURE_BATCHES, MEASURE_BATCHES, 12, 15, 14, 16]


# ------------------------------------------------------------------ the verdict against the suggestion


def trials(*rates: tuple[int | None, float], suggested: int) -> list[Trial]:
    made = [Trial({} if w is None else {"num_workers": w}, batches_per_s=rate) for w, rate in rates]
    for trial in made:
        trial.suggested = trial.workers == suggested
    return made


def test_the_suggestion_confirmed_is_said_with_its_rate_and_gain():
    tried = trials((None, 38.0), (4, 50.0), (5, 57.7), (6, 56.9), suggested=5)
    chosen = _choose(tried, None, max(tried, key=lambda t: t.batches_per_s), tried[2])
    assert chosen is tried[2]
    assert result(tried, chosen).verdict() == ("num_workers=5: 57.7 batches/s, 1.52x the loader as it is; "
                                              "the suggested 5 confirmed")


def test_a_neighbour_faster_than_the_suggestion_is_chosen_and_said_so():
    tried = trials((None, 38.0), (4, 57.7), (5, 38.0), (6, 40.0), suggested=5)
    chosen = _choose(tried, None, tried[1], tried[2])
    assert chosen is tried[1]
    assert result(tried, chosen).verdict() == ("num_workers=4: 57.7 batches/s, 1.52x the loader as it is; "
                                              "4 was faster than the suggested 5 (57.7 against 38.0 batches/s)")


def test_the_suggestion_within_timing_noise_of_the_fastest_is_kept():
    tried = trials((None, 38.0), (4, 55.0), (5, 56.0), (6, 58.5), suggested=5)  # 58.5 < 1.05 x 56
    assert _choose(tried, None, tried[3], tried[2]) is tried[2]
    tried = trials((None, 38.0), (4, 55.0), (5, 56.0), (6, 58.9), suggested=5)  # 58.9 > 1.05 x 56
    assert _choose(tried, None, tried[3], tried[2]) is tried[3]


def test_fewer_workers_that_feed_the_loop_as_well_are_chosen_and_said_so():
    tried = trials((None, 10.0), (4, 40.0), (5, 45.0), (6, 46.0), suggested=5)
    chosen = _choose(tried, 30.0, tried[3], tried[2])  # 1.2 x 30 = 36: four are enough
    assert chosen is tried[1]
    assert result(tried, chosen, 30.0).verdict().endswith(
        "; 4 feed the loop as well as the suggested 5 (the loop takes 30.0 batches/s), with 1 worker fewer")


def test_the_loader_as_it_is_chosen_says_nothing_to_change_and_adds_no_setting():
    tried = trials((None, 60.0), (1, 40.0), (2, 41.0), suggested=1)
    chosen = _choose(tried, None, tried[0], tried[1])
    assert chosen is tried[0]
    made = result(tried, chosen)
    assert made.verdict().startswith("The loader as it is was the fastest: none of the settings timed beat it")
    assert made.change == {} and "nothing to change" in made.code


def test_the_chosen_row_is_a_row_of_the_table_as_labelled_there():
    tried = trials((None, 38.0), (4, 57.7), (5, 38.0), (6, 40.0), suggested=5)
    made = result(tried, tried[1])
    text = made._repr_mimebundle_()["text/plain"]
    chosen_rows = [line for line in text.splitlines() if line.rstrip().endswith("chosen")]
    assert len(chosen_rows) == 1 and chosen_rows[0].startswith("num_workers=4 ")
    assert text.startswith("num_workers=4: ")  # the verdict names that row's label
    suggested_rows = [line for line in text.splitlines() if line.rstrip().endswith("suggested")]
    assert len(suggested_rows) == 1 and suggested_rows[0].startswith("num_workers=5 ")
    assert "None" not in text and "1 workers" not in text


def test_the_table_aligns_figures_right_and_its_code_has_the_panels_copy_button():
    tried = trials((None, 8.0), (1, 9.5), (2, 120.25), suggested=1)
    page = result(tried, tried[2])._repr_mimebundle_()["text/html"]
    assert "class='gpuwidget-copy' data-copy='code'" in page and "data-gpuwidget='measure'" in page
    assert "<style>" in page  # the stylesheet that shows the Copy button in trusted output
    heads = re.findall(r"<th scope='col' style='[^']*text-align:(\w+)[^']*'>([^<]*)</th>", page)
    assert dict((name, align) for align, name in heads) == {
        "setting": "left", "batches/s": "right", "vs as it is": "right", "CPU": "right", "memory": "right",
        "first batch": "right", "": "left"}
    assert "overflow-wrap:anywhere" not in page and "white-space:pre;" in page  # code lines are not broken
    text = result(tried, tried[2])._repr_mimebundle_()["text/plain"].splitlines()
    table = text[text.index("") + 1:]
    header, first = table[0], table[1]
    assert first.index("8.0") + len("8.0") == header.index("batches/s") + len("batches/s")  # right-aligned


# ------------------------------------------------------------------ on real loaders: the plan, the time it takes


@pytest.mark.parametrize("with_batch_time", [True, False])
def test_the_time_announced_is_the_time_it_takes(with_batch_time):
    loader = DataLoader(Storage(4000, latency=0.003), batch_size=8)
    planned: list[tuple[float, int]] = []

    class Progress:
        def planned(self, estimate_s: float, settings: int) -> None:
            planned.append((estimate_s, settings))

        def __call__(self, trial: Trial, elapsed_s: float) -> None:
            pass

    made = tune_loader(loader, suggestion={"num_workers": 3}, io_bound=True, budget_s=20,
                       batch_s=8 * 0.003 if with_batch_time else None, progress=Progress())
    assert [t.label for t in made.trials] == ["as it is", "num_workers=3", "num_workers=2", "num_workers=4"]
    # Timed the suggestion first, read by worker count.
    assert [row[0] for row in made._rows()] == ["as it is", "num_workers=2", "num_workers=3", "num_workers=4"]
    assert planned == [(made.announced_s, 4)]
    # Within ESTIMATE_MARGIN of the estimate (a 20 s promise for a 2 s measurement was 10x off).
    assert abs(made.elapsed_s - made.announced_s) <= ESTIMATE_MARGIN * made.announced_s, (
        made.announced_s, made.elapsed_s)
    assert f"announced: about {made.announced_s:.1f} s" in made._summary()


def test_a_budget_that_ends_early_leaves_out_a_neighbour_and_never_the_suggestion_untold(monkeypatch):
    loader = DataLoader(Storage(400, latency=0.001), batch_size=8)
    clock = [0.0]

    def timed(loader: object, change: dict, deadline: float) -> Trial:  # each trial a second on this clock
        clock[0] += 1.0
        return Trial(change, batches_per_s=10.0 + change.get("num_workers", 0))

    monkeypatch.setattr("gpuwidget.measure.tuner.now", lambda: clock[0])
    monkeypatch.setattr("gpuwidget.measure.tuner._trial", timed)
    made = tune_loader(loader, suggestion={"num_workers": 3}, io_bound=True, budget_s=1.5)  # two trials
    assert [t.label for t in made.trials] == ["as it is", "num_workers=3"]
    assert made.suggested is made.trials[1] and made.verdict().endswith("the suggested 3 confirmed")
    # Ended after the loader as it is: the verdict says the suggestion was not timed, and why.
    made = tune_loader(loader, suggestion={"num_workers": 3}, io_bound=True, budget_s=0.5)
    assert [t.label for t in made.trials] == ["as it is"]
    assert made.verdict() == ("Chosen for the loader: as it is: 10.0 batches/s; the suggested 3 was not timed "
                              "within the budget of 500 ms")


def test_measure_of_a_watched_run_continues_its_findings_suggestion():
    ds = Storage(192, latency=0.004)
    train_loader = DataLoader(ds, batch_size=8)
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(2):
            for _batch in train_loader:
                time.sleep(0.004)  # the step's own work
    finding = next(f for f in run.findings if "num_workers" in f.change)
    made = tune_for_run(run, train_loader, budget_s=20)
    assert made.suggested is not None and made.suggested.workers == finding.change["num_workers"]
    assert made.announced_s is not None  # from the run's own time per batch, before the first trial
    assert made.verdict().startswith(made.chosen.label)
    assert f"the suggested {finding.change['num_workers']}" in made.verdict()
    assert made.trials[0].label == "as it is"
