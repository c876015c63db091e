"""Runs recorded by benchmarks/gpu_check.py, replayed through today's summary, advisor, panel and sidebar.

``tests/fixtures/gpu/NAME.json`` are real runs from an NVIDIA GPU (``gpu_check.py --out DIR`` writes them
to ``DIR/fixtures/``; commit them here), ``tests/fixtures/gpu-fake/NAME.json`` the same workloads from
the check's dry run against the fake NVML. ``NAME`` is the workload, and ``benchmarks/_gpu_workloads.py``'s
``EXPECTED`` says what the advisor must find in it, for the check and for these tests alike.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gpu_workloads import EXPECTED, judge_rules  # noqa: E402
from gpu_check import FIXTURE_MAX_BYTES  # noqa: E402

from gpuwidget.advice.advisor import advise  # noqa: E402
from gpuwidget.figures.summary import summarize  # noqa: E402
from gpuwidget.report import chart_svg, html_document, run_html, run_text  # noqa: E402
from gpuwidget.run import Run  # noqa: E402
from gpuwidget.sources.replay import ReplaySource  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
REAL = sorted((FIXTURES / "gpu").glob("*.json"))
FAKE = sorted((FIXTURES / "gpu-fake").glob("*.json"))
NO_REAL_FIXTURE = ("no real-GPU fixture recorded yet: run benchmarks/gpu_check.py on an NVIDIA GPU "
                   "(README, 'GPU check') and commit its DIR/fixtures/*.json to tests/fixtures/gpu/")


def fixtures() -> list[Any]:
    real = [pytest.param(path, id=f"gpu/{path.stem}") for path in REAL] or [
        pytest.param(None, id="gpu/none-yet", marks=pytest.mark.skip(reason=NO_REAL_FIXTURE))]
    return real + [pytest.param(path, id=f"gpu-fake/{path.stem}") for path in FAKE]


def replayed(path: Path) -> Run:
    """The saved Run with its summary and findings made again by today's code from its trace and facts."""
    run = Run.load(path)
    run.summary = summarize(run.trace, run.workload, run.summary.get("duration_s"), run.machine)
    run.findings = advise(run.summary, run.workload, run.machine)
    return run


def test_the_fake_fixtures_cover_every_workload_and_the_real_ones_are_named_after_one():
    assert sorted(path.stem for path in FAKE) == sorted(EXPECTED)
    assert [path.name for path in REAL if path.stem not in EXPECTED] == []


@pytest.mark.parametrize("path", fixtures())
def test_replayed_advice_names_the_workloads_known_cause_and_no_rival(path):
    run = replayed(path)
    ok, detail = judge_rules(path.stem, [finding.rule for finding in run.findings])
    assert ok, f"{path.parent.name}/{path.name}: {detail}"
    assert path.stat().st_size <= FIXTURE_MAX_BYTES
    assert run.machine["gpus"] and run.summary.get("gpu_busy_mean") is not None


@pytest.mark.parametrize("path", fixtures())
def test_replayed_run_renders_its_findings_in_the_panels_text_and_html(path):
    run = replayed(path)
    text, page, document = run_text(run), run_html(run), html_document(run)
    for finding in run.findings:
        assert finding.title in text
        assert html.escape(finding.title) in page
    if not run.findings:
        assert "No findings" in text
    gpu = run.machine["gpus"][0]["name"]
    assert gpu in text and html.escape(gpu) in document
    assert chart_svg(run).startswith("<svg")


class _ReplayGpus(ReplaySource):
    """The fixture's GPU columns as the sidebar's GPU source: its devices, no process table."""

    def __init__(self, run: Run) -> None:
        super().__init__(run.trace, columns=[c for c in run.trace.columns if c.startswith("gpu")])
        self._gpus = run.machine["gpus"]

    def describe(self) -> list[Any]:  # type: ignore[override]
        return list(self._gpus)

    busy_with = None

    def processes(self) -> dict[str, list[tuple[int, int | None]]]:
        return {}


class _ReplayHost(ReplaySource):
    def __init__(self, run: Run) -> None:
        super().__init__(run.trace, columns=[c for c in run.trace.columns if not c.startswith("gpu")])

    def describe(self) -> dict[str, Any]:
        return {"cpu_count": 16, "mem_total": 2**40}


@pytest.mark.parametrize("path", fixtures())
def test_replayed_trace_feeds_the_sidebars_hello_history_and_samples(path):
    from gpuwidget.server.monitor import Monitor, MonitorSources
    from gpuwidget.sources.gpu import GpuSources

    run = Run.load(path)
    monitor = Monitor(interval=0.1, history_s=3600.0,
                      sources=lambda: MonitorSources(_ReplayHost(run), GpuSources([_ReplayGpus(run)])))
    try:
        for _ in range(len(run.trace.window().t) - 1):  # the first reading takes two rows
            monitor.read_once()
        hello = json.loads(monitor.hello_text())
        history = json.loads(monitor.history_text())
        latest = monitor.latest()
    finally:
        monitor.close()
    assert hello["devices"]["gpu_found"] and hello["devices"]["devices"][0]["name"] == run.machine["gpus"][0]["name"]
    recorded = run.trace.window(columns=["gpu0.util"]).mean["gpu0.util"]
    shown = [value for value in history["columns"]["gpu0.util"] if value is not None]
    assert shown and abs(sum(shown) / len(shown) - float(recorded[~(recorded != recorded)].mean())) <= 1.0
    assert "gpu0.mem_used" in history["columns"] and "gpu0.util" in latest["values"]
    if "gpu0.sm_active" in run.trace.columns:
        assert latest["values"].get("gpu0.sm_active") is not None
