"""The kernels' status files (gpuwidget.kernelstatus): a killed kernel's file does not stay behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from gpuwidget.kernelstatus import StatusWriter, pid_space, read_status, status_path

# A kernel's watch writes its status, then the process is killed: no exit handler runs.
KILLED_KERNEL = textwrap.dedent("""
    import os, signal, sys
    from gpuwidget.kernelstatus import StatusWriter
    writer = StatusWriter(sys.argv[1], label="In [3]")
    writer.started()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def killed_kernels_file(directory) -> str:
    before = set(os.listdir(directory))
    done = subprocess.run([sys.executable, "-c", KILLED_KERNEL, str(directory)], check=False, timeout=60)
    assert done.returncode == -signal.SIGKILL
    (name,) = set(os.listdir(directory)) - before
    return os.path.join(directory, name)


def copy_as(source: str, pid: int, **changes) -> str:
    status = json.loads(Path(source).read_text(encoding="utf-8"))
    status.update(pid=pid, **changes)
    status = {key: value for key, value in status.items() if value is not None}
    path = status_path(os.path.dirname(source), pid)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(status, fh)
    return path


def test_the_next_kernel_removes_a_killed_kernels_status_file_and_leaves_every_other_one(tmp_path):
    dead = killed_kernels_file(tmp_path)
    assert read_status(dead)["state"] == "running"  # left behind: nothing removed it at the kill
    parent = psutil.Process(os.getppid())
    # The same pid's file from a kernel of another host or container sharing this directory, and one of
    # a version that did not say where it ran: not this process's to judge.
    other_host = copy_as(dead, parent.pid + 1_000_000, pid_space="another-boot pid:[1]")
    unsigned = copy_as(dead, parent.pid + 2_000_000, pid_space=None)
    live = copy_as(dead, parent.pid)  # a kernel that still runs (its file written after it started)

    writer = StatusWriter(str(tmp_path), label="In [1]")  # a kernel's first watch in this directory

    assert set(os.listdir(tmp_path)) == {os.path.basename(p) for p in (other_host, unsigned, live)}
    writer.started()
    status = json.loads(Path(writer.path).read_text(encoding="utf-8"))
    assert status["pid_space"] == pid_space() and read_status(writer.path)["label"] == "In [1]"


def test_a_file_whose_pid_now_runs_a_later_process_is_removed(tmp_path):
    dead = killed_kernels_file(tmp_path)
    parent = psutil.Process(os.getppid())
    # Written before the process that now has its pid started: the kernel that wrote it is gone and
    # its pid was given to another process.
    reused = copy_as(dead, parent.pid)
    os.utime(reused, (parent.create_time() - 60, parent.create_time() - 60))
    os.unlink(dead)
    StatusWriter(str(tmp_path))
    assert os.listdir(tmp_path) == []
