"""Run: renders itself (HTML + text), saves and loads, exports."""

from __future__ import annotations

import csv
import io
import json

import pytest

from gpuwidget import Finding, Run
from gpuwidget.figures.summary import summarize
from gpuwidget.options import make_options
from gpuwidget.run import RunError
from gpuwidget.trace import Trace


def gpu_run(error: BaseException | None = None) -> Run:
    trace = Trace()
    for i in range(50):
        trace.append(i * 0.1, {
            "gpu0.util": 90.0 if i % 10 else 0.0, "gpu0.mem_used": 40e9 + i * 1e8, "gpu0.mem_total": 80e9,
            "cpu.util": 30.0, "proc.cpu": 100.0,
        })
        if i % 10 == 0:
            trace.add_span("loader.wait", i * 0.1, i * 0.1 + 0.08)
    finding = Finding(
        rule="dataloader-starved", severity="warn", title="The loop waits for data",
        evidence={"data_wait_fraction": 0.16}, suggestion="Use worker processes.",
        change={"num_workers": 4}, code="train_loader = DataLoader(ds, batch_size=64, num_workers=4)",
        expected_speedup=1.19,
    )
    workload = {"loaders": [{
        "name": "train_loader", "dataset_name": "train_ds", "settings": {"batch_size": 64, "num_workers": 0},
        "epochs": 1, "steps": 5, "samples": 3200, "wait_total_s": 0.4, "compute_total_s": 4.0,
        "loop_time_s": 4.4, "wait_cpu_ratio": 1.0, "step_times": [0.88] * 5, "wait_times": [0.08] * 5,
    }]}
    run = Run(trace=trace, summary=summarize(trace, workload, duration_s=4.9), workload=workload,
              findings=[finding], machine={"gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1"}]},
              options={"advice": True}, error=error, label="In [7]", finished=True)
    return run


def test_summary_has_the_contract_keys_with_measured_values():
    s = gpu_run().summary
    assert s["duration_s"] == 4.9
    # Loop figures are over the loop's own time, not the cell's set-up.
    assert s["samples_per_s"] == pytest.approx(3200 / 4.4)
    assert s["gpu_busy_mean"] == pytest.approx(81.0)
    assert s["peak_gpu_mem_fraction"] == pytest.approx((40e9 + 49e8) / 80e9)
    assert s["data_wait_fraction"] == pytest.approx(0.4 / 4.4)
    assert s["cpu_util_mean"] == 30.0
    assert s["steps"] == 5
    assert s["step_time_p50"] == pytest.approx(0.88)
    assert s["time_breakdown"] == pytest.approx({"data_wait_s": 0.4, "compute_s": 4.0, "other_s": 0.5})


def test_summary_without_gpu_invents_no_gpu_figures():
    trace = Trace()
    trace.append(0.0, {"cpu.util": 10.0})
    s = summarize(trace, {}, duration_s=1.0)
    assert "gpu_busy_mean" not in s and "peak_gpu_mem_fraction" not in s
    assert s["samples_per_s"] is None and s["data_wait_fraction"] is None


def test_run_renders_the_same_content_as_html_and_text():
    bundle = gpu_run()._repr_mimebundle_()
    text, page = bundle["text/plain"], bundle["text/html"]
    for fragment in ("kernel running (nvidia-smi) 81%", "waiting for data 9%", "dataloader-starved", "up to 1.19x",
                     "main cause: The loop waits for data \u2192 up to 1.19x faster",
                     "time: waiting for data 400 ms (9% of the loop) · computing 4.0 s (91%) · other 500 ms"):
        assert fragment in text
    for fragment in ("kernel running (nvidia-smi)", "81%", "dataloader-starved", "up to 1.19x", "num_workers=4",
                     "data:image/svg+xml,%3Csvg", "class='gpuwidget-breakdown'",
                     "The loop waits for data \u2192 up to 1.19x faster"):
        assert fragment in page
    assert "GPU0 NVIDIA H200: kernel running (nvidia-smi) 81%, peak memory 56%" in text
    assert "SM active" not in text  # no GPM in this run: nothing claims SM activity


def test_report_escapes_user_text():
    run = gpu_run(error=ValueError("<script>alert(1)</script>"))
    page = run._repr_mimebundle_()["text/html"]
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_run_without_gpu_says_so_plainly():
    trace = Trace()
    trace.append(0.0, {"cpu.util": 10.0})
    trace.append(1.0, {"cpu.util": 20.0})
    run = Run(trace=trace, summary=summarize(trace), finished=True,
              machine={"gpus": [], "gpu_message": "no GPU found (no NVIDIA or AMD GPU driver)"})
    text = run._repr_mimebundle_()["text/plain"]
    assert "no GPU found (no NVIDIA or AMD GPU driver): host metrics only" in text
    assert "kernel running" not in text and "SM active" not in text


def test_json_round_trip_keeps_what_the_user_sees(tmp_path):
    run = gpu_run(error=KeyboardInterrupt())
    path = run.save(tmp_path / "run.json")
    loaded = Run.load(path)
    assert loaded.summary == json.loads(json.dumps(run.summary))
    assert loaded.findings == run.findings
    assert isinstance(loaded.error, RunError) and loaded.outcome == "interrupted"
    assert loaded.label == "In [7]"
    assert loaded.trace.stats("gpu0.util") == run.trace.stats("gpu0.util")
    assert loaded._repr_mimebundle_()["text/plain"] == run._repr_mimebundle_()["text/plain"]


def test_html_and_csv_exports(tmp_path):
    run = gpu_run()
    page = run.save(tmp_path / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "dataloader-starved" in page
    rows = list(csv.reader(io.StringIO(run.save(tmp_path / "trace.csv").read_text())))
    assert rows[0][0] == "t" and "gpu0.util" in rows[0]
    assert len(rows) == 51
    column = rows[0].index("gpu0.util")
    assert float(rows[2][column]) == 90.0


def test_saving_with_an_unknown_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.json, \.html or \.csv"):
        gpu_run().save(tmp_path / "run.pickle")
    assert not list(tmp_path.iterdir())


def test_loading_something_else_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "notebook"}))
    with pytest.raises(ValueError, match="not a saved gpuwidget run"):
        Run.load(path)


def test_finding_validates_severity_and_speedup():
    with pytest.raises(ValueError, match="severity"):
        Finding(rule="x", severity="fatal", title="t")
    with pytest.raises(ValueError, match="expected_speedup"):
        Finding(rule="x", severity="info", title="t", expected_speedup=0.5)
    finding = gpu_run().findings[0]
    assert Finding.from_dict(finding.to_dict()) == finding
    assert "num_workers=4" in finding._repr_mimebundle_()["text/plain"]


def test_run_options_are_watch_options_saved_as_plain_data(tmp_path):
    options = make_options(interval=0.5, gpus="0,1", advice=False)
    trace = Trace()
    trace.append(0.0, {"cpu.util": 10.0})
    run = Run(trace=trace, options=options, finished=True)
    assert run.to_dict()["options"] == {"interval": 0.5, "gpus": [0, 1], "live": True, "view": "auto",
                                        "advice": False, "tune": False, "save": None, "quiet": False,
                                        "price": None, "budget": None}
    loaded = Run.load(run.save(tmp_path / "run.json"))
    assert loaded.options == options
    assert "main cause: advice off (--no-advice)" in loaded._repr_mimebundle_()["text/plain"]
