"""One story per run: the headline is the first finding's cause and gain in its own words, findings
rank by one gain (a machine's cause where its gain puts it, marked), nothing to gain is no headline,
one figure shows one rounding, counts agree with their nouns, and locations are in the user's terms."""

from __future__ import annotations

import os
import tempfile

import pytest

from gpuwidget.advice.advisor import rank
from gpuwidget.advice.finding import NOTHING_TO_GAIN, Finding
from gpuwidget.options import WatchOptions
from gpuwidget.probes.origin import location, place
from gpuwidget.report import (
    MACHINE_LABEL,
    NOTHING_TO_GAIN_CAUSE,
    breakdown,
    cause_line,
    finding_html,
    finding_text,
    fmt_count,
    fmt_fraction,
    fmt_gain,
    gain_text,
    headline,
    main_cause,
    run_html,
    run_text,
)
from gpuwidget.run import Run
from gpuwidget.trace import Trace
from gpuwidget.ui.static import fit_parts


def run_of(findings: list[Finding], summary: dict | None = None) -> Run:
    return Run(trace=Trace(), summary=summary or {"duration_s": 5.0, "steps": 100}, findings=findings,
               options=WatchOptions(), finished=True)


LOADER = Finding("dataloader-starved", "warn", "The loop waits for data 19% of the time (train_loader)",
                 evidence={"upper_bound_speedup": 1.23}, change={"num_workers": 1}, expected_speedup=1.12)
CONTENTION = Finding("cpu-contention", "critical", "Other processes hold the cores (65% of the time lost)",
                     evidence={"speedup_without_contention": 2.89}, expected_speedup=2.89)
CPU_BOUND = Finding("dataloader-cpu-bound", "critical", "Building batches saturates the CPU (train_loader)",
                    evidence={"upper_bound_speedup": 1.68}, expected_speedup=1.68)
UNBOUNDED = Finding("gpu-unused", "critical", "A GPU is here but the cell ran on the CPU")


# ------------------------------------------------------------------ one gain, one order


def test_findings_rank_by_their_gain_and_a_machines_cause_stands_where_its_gain_puts_it():
    assert rank([CPU_BOUND, UNBOUNDED, LOADER, CONTENTION]) == [CONTENTION, CPU_BOUND, LOADER, UNBOUNDED]
    smaller = Finding("cpu-contention", "critical", "Other processes hold the cores", expected_speedup=1.05)
    assert rank([smaller, CPU_BOUND]) == [CPU_BOUND, smaller]  # critical, but its gain is smaller


def test_nothing_to_gain_ranks_last_at_the_edge_of_what_shows_as_1_00x():
    nothing = Finding("dataloader-starved", "critical", "The loop waits",
                      expected_speedup=round(NOTHING_TO_GAIN - 0.001, 3))
    barely = Finding("io-bound", "info", "Batches wait on storage", expected_speedup=NOTHING_TO_GAIN)
    assert nothing.nothing_to_gain and not barely.nothing_to_gain
    assert rank([nothing, UNBOUNDED, barely]) == [barely, UNBOUNDED, nothing]


def test_the_headline_is_the_first_findings_cause_and_gain_in_its_own_words():
    run = run_of(rank([LOADER, CONTENTION, CPU_BOUND]))
    assert main_cause(run) == cause_line(CONTENTION) == (
        f"Other processes hold the cores (65% of the time lost) \u2192 up to 2.89x faster ({MACHINE_LABEL})")
    run = run_of([LOADER])
    # The gain with its bound, the same words in the headline and in the finding's own card.
    assert main_cause(run) == ("The loop waits for data 19% of the time (train_loader) \u2192 about 1.12x faster "
                               "(at most 1.23x if no waiting remained)")
    assert gain_text(LOADER) in finding_html(LOADER) and f"expected gain: {gain_text(LOADER)}" in finding_text(LOADER)
    assert f"main cause: {main_cause(run)}" in run_text(run) and "gpuwidget-cause" in run_html(run)


def test_a_gain_whose_bound_rounds_the_same_says_one_figure():
    assert fmt_gain(1.03, 1.034) == "up to 1.03x faster"
    assert fmt_gain(1.03, 1.04) == "about 1.03x faster (at most 1.04x if no waiting remained)"
    assert fmt_gain(1.68, None) == "up to 1.68x faster"


def test_a_cause_with_nothing_to_gain_is_not_the_headline():
    nothing = Finding("dataloader-starved", "warn", "The loop waits for data 11% of the time (train_loader)",
                      change={"num_workers": 5}, expected_speedup=1.0)
    assert main_cause(run_of([nothing])) == NOTHING_TO_GAIN_CAUSE
    assert "5 workers" not in main_cause(run_of([nothing]))


def test_a_machines_cause_is_marked_in_text_and_html_and_a_codes_is_not():
    assert MACHINE_LABEL in finding_text(CONTENTION) and MACHINE_LABEL in finding_html(CONTENTION)
    assert MACHINE_LABEL not in finding_text(LOADER) and "gpuwidget-machine" not in finding_html(LOADER)
    throttled = Finding("gpu-throttled", "warn", "The GPU slowed its clocks", expected_speedup=1.2)
    assert throttled.machine_level and MACHINE_LABEL in cause_line(throttled)


def test_a_finding_without_a_gain_says_none_of_none():
    assert gain_text(UNBOUNDED) is None
    assert "None" not in finding_text(UNBOUNDED) and "expected gain" not in finding_text(UNBOUNDED)
    assert main_cause(run_of([UNBOUNDED])) == UNBOUNDED.title


# ------------------------------------------------------------------ one figure, one rounding


@pytest.mark.parametrize(("wait", "compute", "before"), [(2.0, 3.0, 0.122), (0.183, 1.45, 0.6), (0.4, 4.0, 0.0)])
def test_the_headlines_wait_is_the_breakdowns_share_of_the_loop(wait, compute, before):
    # Once 40% beside "2.3 s (39%)": the breakdown's shares were of the cell, the headline's of the loop.
    parts = {"data_wait_s": wait, "compute_s": compute, "before_loop_s": before, "after_loop_s": 0.0,
             "other_s": 0.1}
    run = run_of([], {"duration_s": wait + compute + before + 0.1, "steps": 50, "time_breakdown": parts,
                      "data_wait_fraction": wait / (wait + compute)})
    shown = dict(headline(run))["waiting for data"]
    (_, _, share, _), *_ = breakdown(run)
    assert shown == fmt_fraction(share) == fmt_fraction(wait / (wait + compute))
    assert f"({shown} of the loop)" in run_text(run) and f"({shown} of the loop)" in run_html(run)
    assert dict((part[0], part[2]) for part in breakdown(run))["before the first step"] is None


def test_counts_agree_with_their_nouns():
    assert [fmt_count(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert fmt_count(1, "worker process", "worker processes") == "1 worker process"


# ------------------------------------------------------------------ locations in the user's terms


def test_a_cells_code_is_named_by_its_cell_and_a_file_relative_to_the_working_directory(tmp_path, monkeypatch):
    assert location({"file": "/tmp/ipykernel_4242/1675912219.py", "line": 26, "cell": 7}) == "cell In [7], line 26"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    inside = str(tmp_path / "data" / "loaders.py")
    assert location({"file": inside, "line": 12}) == f"{os.path.join('data', 'loaders.py')}, line 12"
    assert location({"file": "/elsewhere/m.py", "line": 3}) == "/elsewhere/m.py, line 3"
    # A cell file whose number this kernel does not know (a run recorded by another): never its hash.
    cell_file = os.path.join(tempfile.gettempdir(), "ipykernel_4242", "1675912219.py")
    assert location({"file": cell_file, "line": 26}) == "a notebook cell, line 26"
    assert place({"file": inside, "function": "Photos.__getitem__", "line": 26}).startswith("in Photos.__getitem__() (")
    assert place({"file": cell_file, "function": "<module>", "line": 3, "cell": 5}) == "at line 3 of cell In [5]"


# ------------------------------------------------------------------ the live header


def test_the_static_header_keeps_every_figure_and_shortens_at_a_word():
    parts = ["gpuwidget · watching In [3] · 1.2 s",
             "no NVIDIA GPU found (NVML library not found: no NVIDIA driver installed): host metrics only",
             "CPU 100%"]
    line = fit_parts(parts, 108)
    assert len(line) <= 108 and line.endswith(" | CPU 100%")
    shortened = line.split(" | ")[1]
    assert shortened.endswith("…") and shortened[:-1] in parts[1] and parts[1][len(shortened) - 1] == " "
    assert fit_parts(["a", "CPU 5%"], 108) == "a | CPU 5%"  # what fits is left whole


def test_the_live_header_keeps_a_label_with_its_value():
    from gpuwidget.ui.live import LiveView

    view = LiveView.__new__(LiveView)
    view.label, view._gpus, view._gpu_message, view._sm = "In [3]", [], "no NVIDIA GPU found", set()
    header = view._header_html(1.0, {"cpu.util": 100.0})
    assert "<span style='white-space:nowrap'>CPU 100%</span>" in header
