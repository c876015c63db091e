"""The host read by a process of its own (gpuwidget.sources.reader, ``GPUWIDGET_READER=process``): the same
readings as on the sampler's thread, a fallback that loses nothing, and no process left behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import gpuwidget
from gpuwidget.sources import reader as readers
from gpuwidget.sources.host import HostSource
from gpuwidget.sources.reader import READER_ENV, RemoteHostSource, host_source, reader_choice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_reader() -> Iterator[None]:
    """Each test starts its own reader and ends it: none is left to the next test."""
    readers.stop_shared_reader()
    yield
    readers.stop_shared_reader()


def gone(pid: int, within_s: float) -> bool:
    """Whether ``pid`` ended (a zombie counts: it runs no more) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def remote() -> RemoteHostSource:
    source = host_source("process")
    assert isinstance(source, RemoteHostSource), "the reader process did not start"
    return source


def test_the_reader_gives_the_columns_of_a_read_in_this_process_and_is_not_one_of_its_workers():
    source, local = remote(), HostSource()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for _ in range(3):
            time.sleep(0.25)
            theirs, ours = source.read(), local.read()
        assert set(theirs) == set(ours)
        assert "proc.cpu" in theirs and "cpu.util" in theirs
        # The reader is a child of this process too, but only the sleeping worker is one of its workers.
        assert readers.shared_reader() is not None
        assert theirs["proc.workers"] == ours["proc.workers"] == 1.0
        assert abs(theirs["proc.rss"] - ours["proc.rss"]) < 0.2 * ours["proc.rss"]
        assert source.machine_facts()["pid"] == os.getpid()
        assert source.remote and not source.errors
    finally:
        worker.kill()
        worker.wait()
        source.close()


def test_a_watch_read_by_the_reader_process_records_the_same_host_columns(monkeypatch):
    def watched(reader: str) -> set[str]:
        monkeypatch.setenv(READER_ENV, reader)
        with gpuwidget.watch(quiet=True) as run:
            deadline = time.monotonic() + 0.8
            while time.monotonic() < deadline:
                sum(range(1000))
        assert run.sampler["ticks"] >= 2 and not run.sampler["source_errors"]
        return {name for name in run.trace.columns if not name.startswith("gpu")}

    assert watched("process") == watched("thread")
    reader = readers.shared_reader()
    assert reader is not None and reader.alive  # kept for the next watch: started once per process


def test_a_reader_killed_mid_watch_leaves_the_host_read_in_this_process():
    source = remote()
    source.read()  # the rates' first counters
    reader = readers.shared_reader()
    assert reader is not None and reader.pid is not None
    os.kill(reader.pid, signal.SIGKILL)
    assert gone(reader.pid, 5.0)
    time.sleep(0.1)
    values = source.read()
    assert "proc.rss" in values and not source.remote
    assert any("reader process ended" in error.message and "read in this process" in error.message
               for error in source.errors)
    time.sleep(0.1)
    assert "cpu.util" in source.read()


def test_a_reader_that_stops_answering_is_ended_and_the_read_comes_from_this_process():
    source = remote()
    reader = readers.shared_reader()
    assert reader is not None and reader.pid is not None
    os.kill(reader.pid, signal.SIGSTOP)
    started = time.monotonic()
    values = source.read()
    assert time.monotonic() - started < readers.REPLY_DEADLINE_S + 2.0  # well before the sampler's 2 s watchdog
    assert "proc.rss" in values and not source.remote
    assert any("did not answer" in error.message for error in source.errors)
    assert gone(reader.pid, 5.0)  # killed, not left stopped
    fresh = readers.shared_reader()
    assert fresh is not None and fresh.pid != reader.pid


def test_the_reader_never_outlives_a_process_killed_with_sigkill():
    script = ("import os, sys, time; os.environ['GPUWIDGET_READER'] = 'process';"
              "from gpuwidget.sources.reader import host_source, shared_reader;"
              "source = host_source(); print(shared_reader().pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.strip().isdigit(), f"the reader did not start: {line!r}"
        pid = int(line)
        assert psutil.Process(pid).ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert gone(pid, 4.0), "the reader outlived its process"
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout:
            parent.stdout.close()


def _reader_in_child(queue: multiprocessing.Queue) -> None:
    queue.put((readers._shared is None, readers.host_source("thread").__class__.__name__))


def test_a_forked_child_does_not_share_its_parents_reader():
    remote()
    assert readers._shared is not None
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_reader_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=30) == (True, "HostSource")
    finally:
        child.join(30)
    assert readers._shared is not None and readers._shared.alive  # the parent's own is untouched


def test_where_the_reader_cannot_start_the_host_is_read_in_this_process(monkeypatch, tmp_path):
    broken = tmp_path / "reader.py"
    broken.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(readers, "SCRIPT", broken)
    source = host_source("process")
    assert type(source) is HostSource
    assert readers._shared is None


def test_the_reader_setting_is_checked():
    assert reader_choice("process") == "process" and reader_choice(" Thread ") == "thread"
    with pytest.raises(ValueError, match="GPUWIDGET_READER: expected one of thread, process, got 'proc'"):
        reader_choice("proc")


# A Python started with this folder on its path gets the same two fake GPUs as the test (the reader is
# started with this process's sys.path): the driver it asks answers as this process's does.
SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {tests!r})
from fakenvml import FakeNvml

_patch = FakeNvml.gpus(2).patched()
_patch.__enter__()
"""


def test_the_reader_reads_the_gpus_the_watch_opened_and_the_watch_records_the_same_columns(
        fake_nvml, monkeypatch, tmp_path):
    from gpuwidget.sources.gpu import open_gpu_sources

    from fakenvml import FakeNvml

    fake_nvml(FakeNvml.gpus(2))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tests=str(Path(__file__).parent)))
    monkeypatch.syspath_prepend(str(site))
    local = open_gpu_sources(None).sources
    host = remote()
    try:
        sources = readers.gpu_sources(local, None, "process")
        assert [type(source).__name__ for source in sources] == ["RemoteGpuSource"] * 2
        reader = readers.shared_reader()
        assert reader is not None
        exchanges = []
        ask = reader.call
        monkeypatch.setattr(reader, "call", lambda *args: exchanges.append(args[0][0]) or ask(*args))
        for _ in range(2):  # a tick reads the host, then each GPU: one exchange with the reader a tick
            host.read()
            for source in sources:
                source.read()
        assert exchanges == ["read_many", "read_many"]
        for source, mine in zip(sources, local):
            theirs, ours = source.read(), mine.read()
            assert set(theirs) == set(ours) and theirs, (sorted(theirs), sorted(ours))
            column = f"{source.describe()[0]['id']}.mem_total"
            assert source.describe() == mine.describe() and theirs[column] == ours[column]
            assert not source.errors and not source.closed and source.busy_with is None
    finally:
        host.close()
        for source in local:
            source.close()

    def watched(reader: str) -> set[str]:
        monkeypatch.setenv(READER_ENV, reader)
        with gpuwidget.watch(quiet=True) as run:
            time.sleep(0.8)
        assert run.sampler["ticks"] >= 2 and not run.sampler["source_errors"], run.sampler
        return set(run.trace.columns)

    columns = watched("process")
    assert {"gpu0.util", "gpu1.util", "gpu0.proc_mem", "cpu.util"} <= columns
    assert columns == watched("thread")


def test_gpus_the_reader_does_not_open_as_this_process_did_are_read_here(fake_nvml):
    from gpuwidget.sources.gpu import open_gpu_sources

    from fakenvml import FakeNvml

    fake_nvml(FakeNvml.gpus(2))  # in this process only: the reader finds no GPU (this machine's driver)
    local = open_gpu_sources(None).sources
    try:
        assert readers.gpu_sources(local, None, "process") == local
        assert readers.shared_reader() is not None  # the reader itself serves on (the host)
    finally:
        for source in local:
            source.close()


def test_a_watch_with_an_unknown_reader_setting_stops_before_it_starts(monkeypatch):
    from gpuwidget.options import OptionError

    monkeypatch.setenv(READER_ENV, "processes")
    refused = "GPUWIDGET_READER: expected one of thread, process, got 'processes'"
    with pytest.raises(OptionError, match=refused), gpuwidget.watch(quiet=True):
        pass
    monkeypatch.delenv(READER_ENV)
    with gpuwidget.watch(quiet=True) as run:  # nothing was left running by the refused one
        time.sleep(0.3)
    assert run.sampler["ticks"] >= 1
