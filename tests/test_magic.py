"""%%gpuwatch in an in-process IPython shell: the cell behaves as if unwatched, and the run is kept."""

from __future__ import annotations

import json

import pytest
from IPython.core.error import UsageError

import gpuwidget

from support import sampler_threads


def test_names_stay_and_last_expression_is_the_cell_result(ip):
    result = ip.run_cell("%%gpuwatch --interval 0.02\ntotal = 0\nfor i in range(4):\n    total += i\ntotal * 10\n")
    assert result.success
    assert result.result == 60
    assert ip.user_ns["total"] == 6
    assert gpuwidget.last_run().outcome == "ok"


def test_trailing_semicolon_suppresses_the_value_as_in_a_plain_cell(ip):
    result = ip.run_cell("%%gpuwatch\nx_semicolon = 5\nx_semicolon * 2;\n")
    assert result.success and result.result is None
    assert ip.user_ns["x_semicolon"] == 5


def test_user_exception_propagates_unchanged_with_one_traceback(ip, capsys):
    cell = (
        "%%gpuwatch\n"
        "class TrainingBroke(Exception):\n"
        "    pass\n"
        "raised_here = TrainingBroke('loss is nan at step 7')\n"
        "raise raised_here\n"
    )
    result = ip.run_cell(cell)
    out = capsys.readouterr()
    assert result.error_in_exec is ip.user_ns["raised_here"]
    assert not result.success
    text = out.out + out.err
    # Shown once by IPython (the panel's status line names it too: "ended with TrainingBroke: ...").
    assert text.count("Traceback (most recent call last)") == 1
    assert text.count("\nTrainingBroke: loss is nan at step 7") == 1
    # The traceback points at the user's line, numbered as in the cell.
    assert "----> 5 raise raised_here" in text
    run = gpuwidget.last_run()
    # The Run keeps the exception as data (no frames); the user got the exception itself.
    assert (run.error.type, run.error.message) == ("TrainingBroke", "loss is nan at step 7")
    assert "raise raised_here" in run.error.traceback
    assert run.outcome == "error"
    assert not sampler_threads()


def test_keyboard_interrupt_is_recorded_then_propagates(ip):
    result = ip.run_cell("%%gpuwatch --interval 0.02\nimport time\ntime.sleep(0.05)\nraise KeyboardInterrupt\n")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    run = gpuwidget.last_run()
    assert run.outcome == "interrupted"
    assert run.summary["duration_s"] >= 0.05
    assert not sampler_threads()


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("--interval -1", "--interval: must be between"),
        ("--interval abc", "--interval: expected a number of seconds, got 'abc'"),
        ("--interval nan", "--interval: must be between"),
        ("--gpus x", "--gpus: expected GPU numbers like 0,1, got 'x'"),
        ("--gpus 0,,1", "--gpus: expected GPU numbers"),
        ("--bogus", "unknown option '--bogus'"),
        ("--save run.txt", "--save: use a .json, .html or .csv file name"),
        ("--interval", "expected one argument"),
        ("--gpus '0", "cannot parse options"),
        ("--tune --budget 0", "--budget: expected seconds from 1 to 3600, got '0'"),
        ("--tune --budget soon", "--budget: expected seconds from 1 to 3600, got 'soon'"),
        ("--tune --budget inf", "--budget: expected seconds from 1 to 3600"),
    ],
)
def test_bad_options_raise_usage_error_and_run_nothing(ip, line, reason):
    ip.user_ns.pop("body_ran", None)
    before = gpuwidget.session._last_run
    result = ip.run_cell(f"%%gpuwatch {line}\nbody_ran = True\n")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert reason in message
    assert "\n" not in message
    assert "body_ran" not in ip.user_ns
    assert gpuwidget.session._last_run is before


def test_save_writes_a_run_that_loads_back(ip, tmp_path):
    target = tmp_path / "runs" / "first.json"
    result = ip.run_cell(f"%%gpuwatch --interval 0.02 --save {target}\nimport time\ntime.sleep(0.1)\n")
    assert result.success
    loaded = gpuwidget.Run.load(target)
    assert loaded.summary["duration_s"] == pytest.approx(gpuwidget.last_run().summary["duration_s"])
    assert loaded.trace.stats("cpu.util").count >= 3
    assert json.loads(target.read_text())["format"] == "gpuwidget.run/1"


def test_quiet_shows_nothing_but_still_records(ip, monkeypatch):
    shown = []
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, *a, **k: shown.append(data))
    ip.run_cell("%%gpuwatch --quiet\nquiet_value = 1\n")
    assert shown == []
    assert gpuwidget.last_run().outcome == "ok"
    ip.run_cell("%%gpuwatch\nloud_value = 1\n")
    assert any("text/html" in bundle and "gpuwidget" in bundle["text/plain"] for bundle in shown)


def test_summary_is_shown_as_html_and_text(ip, monkeypatch):
    shown = []
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, *a, **k: shown.append(data))
    ip.run_cell("%%gpuwatch --interval 0.02\nimport time\ntime.sleep(0.1)\n")
    (bundle,) = shown
    assert "class='gpuwidget-run'" in bundle["text/html"]
    assert "<img src='data:image/svg+xml,%3Csvg" in bundle["text/html"]
    assert bundle["text/plain"].startswith("gpuwidget run: ")
    # No driver on this machine: the summary says so plainly.
    assert "no GPU found" in bundle["text/plain"]


def test_a_hundred_watched_cells_leave_no_thread_or_state(ip):
    import threading

    baseline = threading.active_count()
    for i in range(100):
        ip.run_cell(f"%%gpuwatch --quiet --interval 0.01\nvalue_{i % 3} = {i}\n")
    assert threading.active_count() == baseline
    assert not sampler_threads()
    assert gpuwidget.session._active is None
    assert ip.user_ns["value_0"] == 99


def test_nested_watch_is_refused_with_a_clear_error(ip):
    result = ip.run_cell(
        "%%gpuwatch --quiet\n"
        "inner = get_ipython().run_cell('%%gpuwatch --quiet\\ninner_ran = 1\\n')\n"
    )
    assert result.success
    inner = ip.user_ns["inner"]
    assert isinstance(inner.error_in_exec, UsageError)
    assert "already running" in str(inner.error_in_exec)
    assert "inner_ran" not in ip.user_ns


def test_watch_context_manager_yields_the_run_and_reraises(ip):
    class Boom(RuntimeError):
        pass

    boom = Boom("stop")
    with pytest.raises(Boom) as caught, gpuwidget.watch(interval=0.02, quiet=True) as run:
        raise boom
    assert caught.value is boom
    assert run is gpuwidget.last_run()
    assert str(run.error) == "Boom: stop" and run.finished

    with gpuwidget.watch(interval=0.02, quiet=True) as run:
        pass
    assert run.outcome == "ok" and run.summary["duration_s"] >= 0


def test_watch_rejects_bad_options_before_starting():
    with pytest.raises(ValueError, match="--interval"), gpuwidget.watch(interval=0):
        pass
    with pytest.raises(ValueError, match="--gpus"), gpuwidget.watch(gpus="a,b"):
        pass
    with pytest.raises(TypeError), gpuwidget.watch(intervall=1):
        pass
    assert not sampler_threads()


def test_last_run_before_any_watch_explains_itself(monkeypatch):
    monkeypatch.setattr(gpuwidget.session, "_last_run", None)
    with pytest.raises(LookupError, match="%%gpuwatch"):
        gpuwidget.last_run()
