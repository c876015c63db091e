"""The host source's /proc readers (gpuwidget.sources.procfs) give psutil's figures, at a third of the cost."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from gpuwidget.sources import host, procfs
from gpuwidget.sources.host import HostSource

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc here: psutil is read instead")


def _file(path: str) -> bytes | None:
    return procfs.ProcFile(path).read()


def test_the_readers_give_the_figures_psutil_gives():
    cores = procfs.cpu_times(_file("/proc/stat"))
    expected = [host._cpu_split(times) for times in psutil.cpu_times(percpu=True)]
    assert cores is not None and len(cores) == len(expected) == psutil.cpu_count()
    for ours, theirs in zip(cores, expected):  # ours in clock ticks, psutil's in seconds
        seconds = tuple(ticks / procfs.CLOCK_TICKS for ticks in ours)
        assert seconds == pytest.approx(theirs, abs=0.2)  # the counters move on (100 ticks a second) between the reads
    own, reaped, rss = procfs.process_times(_file(f"/proc/{os.getpid()}/stat"))
    process = psutil.Process()
    times = process.cpu_times()
    assert own == pytest.approx(times.user + times.system, abs=0.05)
    assert reaped == pytest.approx(times.children_user + times.children_system, abs=0.05)
    assert rss == pytest.approx(process.memory_info().rss, abs=2**22)
    used, total = procfs.memory(_file("/proc/meminfo"))
    memory = psutil.virtual_memory()
    assert total == memory.total
    assert used == pytest.approx(memory.total - memory.available, abs=2**26)
    disk = psutil.disk_io_counters()
    if disk is not None:
        read, written = procfs.disk_bytes(_file("/proc/diskstats"), procfs.whole_disks())
        assert read == pytest.approx(disk.read_bytes, rel=1e-3)
        assert written == pytest.approx(disk.write_bytes, rel=1e-3)
    received, sent = procfs.net_bytes(_file("/proc/net/dev"))
    net = psutil.net_io_counters()
    assert received == pytest.approx(net.bytes_recv, rel=1e-3, abs=2**20)
    assert sent == pytest.approx(net.bytes_sent, rel=1e-3, abs=2**20)


def test_a_file_kept_open_reads_what_the_kernel_says_now():
    stat = procfs.ProcFile(f"/proc/{os.getpid()}/stat")
    before = procfs.process_times(stat.read())[0]
    deadline = time.thread_time() + 0.15
    while time.thread_time() < deadline:
        pass
    after = procfs.process_times(stat.read())[0]
    assert after - before >= 0.1
    stat.close()
    assert procfs.process_times(stat.read())[0] >= after  # opened again after a close


def test_a_file_longer_than_one_chunk_is_read_whole_and_a_missing_one_is_none(tmp_path):
    long = tmp_path / "long"
    long.write_bytes(b"x" * (2 * procfs.CHUNK + 10))
    assert len(procfs.ProcFile(str(long)).read()) == 2 * procfs.CHUNK + 10
    assert procfs.ProcFile(str(tmp_path / "absent")).read() is None


def test_a_command_name_with_spaces_and_brackets_does_not_shift_the_fields():
    fields = " ".join(["S", *["0"] * 10, "150", "50", "30", "20", *["0"] * 6, "1000"])
    data = f"4242 (evil) name (x) {fields}\n".encode()
    assert procfs.process_times(data) == (2.0 * 100 / procfs.CLOCK_TICKS, 0.5 * 100 / procfs.CLOCK_TICKS,
                                          1000.0 * procfs.PAGE_BYTES)


def test_only_whole_disks_count_and_partitions_are_not_counted_twice():
    data = (b"   8       0 sda 10 0 100 0 20 0 200 0 0 0 0 0 0 0 0 0 0\n"
            b"   8       1 sda1 10 0 100 0 20 0 200 0 0 0 0 0 0 0 0 0 0\n"
            b" 259       0 nvme0n1 1 0 4 0 2 0 8 0 0 0 0\n")  # 2.6-4.17: 14 fields
    assert procfs.disk_bytes(data, frozenset({"sda", "nvme0n1"})) == (104 * 512.0, 208 * 512.0)
    assert procfs.disk_bytes(b"   8       1 sda1 1 2 3 4\n", frozenset({"sda"})) is None  # psutil reads that layout


def test_the_host_source_falls_back_to_psutil_where_proc_cannot_be_read(tmp_path):
    source = HostSource()
    for file in source._files.values():
        file.path = str(tmp_path / "absent")
        file.close()
    source._last_cores = None
    source.read()
    time.sleep(0.1)
    values = source.read()
    for name in ("cpu.util", "cpu.core0.util", "proc.rss", "proc.cpu", "mem.used", "mem.total"):
        assert name in values, name
    assert values["mem.total"] == psutil.virtual_memory().total
    assert values["proc.rss"] == pytest.approx(psutil.Process().memory_info().rss, abs=2**24)
    assert source.errors == []
    source.close()


def test_a_core_busy_all_the_time_reads_exactly_100_percent(tmp_path):
    """Shares of whole clock ticks: 100 %, never 100.0000000018 % (seconds made of ticks round)."""
    stat = tmp_path / "stat"

    def write(busy: int, idle: int) -> None:
        line = f"{busy} 0 0 {idle} 0 0 0 0 0 0"
        stat.write_text(f"cpu  {line}\ncpu0 {line}\nintr 0\n")

    write(1_234_567, 89)
    source = HostSource(process=False)
    source._files["stat"].path = str(stat)
    source._files["stat"].close()
    source._last_cores = None
    source._read_cpu({})
    write(1_234_567 + 333, 89)
    values: dict[str, float] = {}
    source._read_cpu(values)
    assert values["cpu.util"] == 100.0 and values["cpu.core0.util"] == 100.0 and values["cpu.iowait"] == 0.0
    write(1_234_567 + 333, 89 + 111)
    source._read_cpu(values)
    assert values["cpu.util"] == 0.0
    source.close()
