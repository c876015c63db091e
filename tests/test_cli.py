"""``gpuwatch -- COMMAND``: the command runs watched, as a cell under %%gpuwatch; its exit status is
gpuwatch's, Ctrl-C reaches it and still leaves a report, and bad options stop before it runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwidget import Run
from gpuwidget.cli import main, split_command, status_text
from gpuwidget.options import OptionError
from gpuwidget.probes import FLUSH_EVERY_S

# Times real commands and signals under gpuwatch: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
GPUWATCH = [sys.executable, "-m", "gpuwidget.cli"]

# A storage-bound loop (2 ms per sample, no workers): 3 epochs of 25 batches by default.
TRAIN = textwrap.dedent("""\
    import sys, time, torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 200

        def __getitem__(self, index):
            time.sleep(0.002)
            return torch.randn(16)

    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Slow(), batch_size=8)
    epochs, status = int(sys.argv[1]), int(sys.argv[2])
    try:
        for epoch in range(epochs):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            print("epoch", epoch, flush=True)
    except KeyboardInterrupt:
        print("the script saw KeyboardInterrupt", flush=True)
        raise
    sys.exit(status)
""")


def gpuwatch(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUWATCH, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT, **kwargs)


@pytest.fixture
def train_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return script


def test_a_training_script_is_watched_saved_and_its_status_returned(train_script, tmp_path):
    saved = tmp_path / "run.json"
    result = gpuwatch("--interval", "0.1", "--save", str(saved), "--", sys.executable, str(train_script), "3", "3")
    assert result.returncode == 3, result.stderr
    assert "epoch 2" in result.stdout  # the script's own output, untouched
    assert "gpuwidget run:" in result.stdout and "exited with status 3" in result.stdout
    assert "Findings (largest expected gain first):" in result.stdout
    assert f"run saved to {saved}" in result.stderr
    run = Run.load(saved)
    assert run.error is not None and run.error.type == "CommandExit"
    assert run.summary["steps"] == 75  # the script's own loop, seen by the probes in its process
    assert run.options.interval == 0.1
    assert {f.rule for f in run.findings} & {"io-bound", "dataloader-starved"}
    script_pids = [rank["pid"] for rank in run.ranks]
    assert len(script_pids) == 1 and script_pids[0] != os.getpid()
    assert run.ranks[0]["steps"] == 75


def test_success_is_status_zero_and_quiet_prints_nothing(tmp_path):
    result = gpuwatch("--quiet", "--", sys.executable, "-c", "print('hello')")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello\n" and result.stderr == ""
    loud = gpuwatch("--no-advice", "--", sys.executable, "-c", "pass")
    assert loud.returncode == 0 and "gpuwidget run:" in loud.stdout and "finished" in loud.stdout
    assert "Findings" not in loud.stdout


def test_a_command_killed_by_a_signal_exits_as_a_shell_reports_it():
    result = gpuwatch("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert result.returncode == 128 + signal.SIGTERM
    assert "killed by SIGTERM" in result.stdout


def test_ctrl_c_reaches_the_command_and_still_yields_a_report(train_script, tmp_path):
    saved = tmp_path / "interrupted.json"
    process = subprocess.Popen([*GPUWATCH, "--save", str(saved), "--", sys.executable, "-u", str(train_script),
                                "1000", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # the first epoch ended: the loop is running
        assert first.startswith("epoch 0"), first
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert "the script saw KeyboardInterrupt" in out
    assert "gpuwidget run:" in out and "interrupted" in out
    run = Run.load(saved)
    assert run.outcome == "interrupted" and run.summary["steps"] >= 25


@pytest.mark.parametrize(("args", "message"), [
    (["--interval", "0", "--"], "--interval: must be between"),
    (["--save", "run.txt", "--"], "--save: use a .json, .html or .csv file name"),
    (["--bogus", "--"], "unknown option '--bogus'"),
    (["--gpus", "x", "--"], "--gpus: expected GPU numbers"),
    (["--view", "bogus", "--"], "--view: expected one of auto, bokeh, static, none"),
    (["--gpus", "99", "--"], "--gpus: there is no GPU 99 here"),  # found when the watch starts
])
def test_bad_options_exit_2_with_one_line_before_the_command_runs(args, message, tmp_path):
    marker = tmp_path / "ran"
    result = gpuwatch(*args, sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert result.returncode == 2
    assert result.stderr.startswith("gpuwatch: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""
    assert not marker.exists()


def test_no_command_and_an_unknown_command(capsys):
    assert main([]) == 2
    assert "no command given" in capsys.readouterr().err
    assert main(["--", "no-such-command-gpuwatch"]) == 127
    assert "command not found: no-such-command-gpuwatch" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "usage: gpuwatch" in capsys.readouterr().out


def test_options_end_where_the_command_begins():
    assert split_command(["--interval", "1", "python", "train.py", "--lr", "3"]) == (
        ["--interval", "1"], ["python", "train.py", "--lr", "3"])
    assert split_command(["--quiet", "--", "torchrun", "--nproc_per_node=2", "t.py"]) == (
        ["--quiet"], ["torchrun", "--nproc_per_node=2", "t.py"])
    assert split_command(["--save=run.json", "python"]) == (["--save=run.json"], ["python"])
    with pytest.raises(OptionError, match="unknown option '--nope'"):
        split_command(["--nope", "python"])


def test_the_console_script_is_declared_and_resolves():
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject[pyproject.index("[project.scripts]"):].split("\n[", 1)[0]
    assert 'gpuwatch = "gpuwidget.cli:main"' in section
    from importlib.metadata import EntryPoint

    assert EntryPoint("gpuwatch", "gpuwidget.cli:main", "console_scripts").load() is main


def test_a_status_line_goes_to_stderr_while_the_command_runs():
    # Not a terminal: one plain line after the first second (then one per LOG_STATUS_EVERY_S).
    result = gpuwatch("--", sys.executable, "-c", "import time; time.sleep(1.8)")
    assert result.returncode == 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("gpuwatch ")]
    assert lines and " s · " in lines[0] and "CPU" in lines[0]
    for off in ("--no-live", "--view=none"):
        assert gpuwatch(off, "--", sys.executable, "-c", "import time; time.sleep(1.5)").stderr == ""


def test_the_status_line_counts_steps_and_data_wait_from_the_live_trace():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import gpuwidget

    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    with gpuwidget.watch(quiet=True) as run:
        for (x,) in loader:
            x.sum()
        # A sampler tick moves the probes' spans into the trace: the first at once, then once a second.
        # The host's CPU share needs two reads a clock tick apart: a tick at the watch's start has none.
        expected = "gpuwatch 2 s · 16 steps (8.0/s) · data wait "
        deadline = time.monotonic() + 3 * FLUSH_EVERY_S
        while time.monotonic() < deadline:
            line = status_text(run, 2.0)
            if line.startswith(expected) and "CPU" in line:
                break
            time.sleep(0.05)
    assert line.startswith(expected) and "CPU" in line


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash for a shell with job control")
def test_at_a_terminal_ctrl_z_fg_and_ctrl_c_work_as_if_unwatched(train_script):
    """An interactive bash on a pseudo-terminal runs gpuwatch as a job: the command holds the terminal,
    so Ctrl-Z stops it (and gpuwatch: bash says Stopped and nothing trains), fg continues both, Ctrl-C
    interrupts the command, not gpuwatch; the status line is redrawn in place and the report follows."""
    import pty
    import select

    master, slave = pty.openpty()
    shell = subprocess.Popen(["bash", "--norc", "--noprofile", "-i"], stdin=slave, stdout=slave, stderr=slave,
                             start_new_session=True, cwd=ROOT, env={**os.environ, "PS1": "PROMPT$ "})
    os.close(slave)
    output = b""

    def read_until(done: Any, timeout: float) -> bool:
        nonlocal output
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not done():
            if select.select([master], [], [], 0.2)[0]:
                try:
                    output += os.read(master, 65536)
                except OSError:  # the terminal closed
                    break
        return bool(done())

    def epochs() -> int:
        return output.count(b"epoch ")

    try:
        assert read_until(lambda: b"PROMPT$ " in output, 30)
        command = " ".join([*GPUWATCH, "--", sys.executable, "-u", str(train_script), "1000", "0"])
        os.write(master, command.encode() + b"\n")
        assert read_until(lambda: epochs() >= 2, 90), output[-500:]
        os.write(master, b"\x1a")  # Ctrl-Z
        assert read_until(lambda: b"Stopped" in output, 30), output[-500:]
        read_until(lambda: False, 1.0)
        stopped_at = epochs()
        read_until(lambda: False, 1.5)
        assert epochs() == stopped_at  # stopped: no epoch ends
        os.write(master, b"fg\n")
        assert read_until(lambda: epochs() > stopped_at + 1, 60), output[-500:]
        os.write(master, b"\x03")  # Ctrl-C
        assert read_until(lambda: output.rstrip().endswith(b"PROMPT$"), 90), output[-500:]
        os.write(master, b"echo status=$?\n")
        assert read_until(lambda: b"status=130" in output, 30), output[-500:]
    finally:
        os.write(master, b"exit\n")
        try:
            shell.wait(timeout=10)
        except subprocess.TimeoutExpired:
            shell.kill()
        os.close(master)
    text = output.decode(errors="replace")
    assert "the script saw KeyboardInterrupt" in text and "interrupted" in text
    assert "\r\x1b[2K" in text and " steps (" in text  # the status line, redrawn in place
    report = text.split("the script saw KeyboardInterrupt", 1)[1]
    assert "gpuwidget run:" in report and "Traceback" not in report.split("gpuwidget run:")[1]


# The training process's own CPU: 150 steps each burning 4 ms of CPU, then 0.4 s asleep after the loop.
BURN = textwrap.dedent("""\
    import time, torch
    from torch.utils.data import DataLoader, TensorDataset

    def burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    for (x,) in DataLoader(TensorDataset(torch.randn(600, 4)), batch_size=4):
        burn(0.004)
    time.sleep(0.4)
""")


def test_this_process_is_the_training_process_and_its_time_split_adds_up(tmp_path):
    script, saved = tmp_path / "burn.py", tmp_path / "run.json"
    script.write_text(BURN)
    result = gpuwatch("--save", str(saved), "--", sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    run = Run.load(saved)
    summary, (entry,) = run.summary, run.workload["ranks"]
    assert entry["steps"] == 150 and summary["process_cpu_processes"] == 1
    # "This process" is the script's CPU (all its threads, from its start), not gpuwatch's own.
    used = summary["process_cpu_mean"] / 100 * summary["duration_s"]
    assert used == pytest.approx(entry["cpu"]["process_s"])
    assert used >= 150 * 0.004
    assert "training process " in result.stdout and "this process" not in result.stdout
    # The script's time split: every part measured, summing to the run's duration.
    parts = summary["time_breakdown"]
    assert sum(parts.values()) == pytest.approx(summary["duration_s"])
    assert parts == entry["time_breakdown"]
    assert parts["compute_s"] >= 150 * 0.004 * 0.9
    assert parts["before_loop_s"] > 0  # the interpreter's start and torch's import
    assert parts["after_loop_s"] >= 0.4
    assert f"time (pid {entry['pid']}): waiting for data" in result.stdout
