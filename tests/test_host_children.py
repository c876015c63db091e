"""Descendants where the kernel keeps no children lists: each process's parent from /proc/<pid>/stat,
kept between listings, so a listing after the first reads new pids and the last descendants only."""

from __future__ import annotations

from pathlib import Path

from gpuwidget.sources.host import ProcScan, _descendants_by_scan


def write_stat(proc: Path, pid: int, name: str, parent: int) -> None:
    folder = proc / str(pid)
    folder.mkdir(exist_ok=True)
    (folder / "stat").write_text(f"{pid} ({name}) S {parent} {pid} {pid} 0 -1 4194560 100 0 0 0\n")


def test_a_scan_follows_parents_and_rereads_only_what_can_have_changed(tmp_path):
    proc = tmp_path
    write_stat(proc, 1, "init", 0)
    write_stat(proc, 100, "python", 1)  # the watched process
    write_stat(proc, 101, "pt_data_worker (0) x", 100)  # a command name with spaces and parentheses
    write_stat(proc, 102, "sleep", 101)
    write_stat(proc, 200, "other", 1)
    (proc / "self").mkdir()  # not a pid
    scan = ProcScan(str(proc))
    assert sorted(scan.descendants(100)) == [101, 102]
    assert scan.stat_reads == 5
    # Nothing new: only the descendants are read again (their parent changes when theirs ends).
    assert sorted(scan.descendants(100)) == [101, 102] and scan.stat_reads == 7
    write_stat(proc, 103, "worker", 100)
    assert sorted(scan.descendants(100)) == [101, 102, 103] and scan.stat_reads == 10
    # 101 ended; its child was handed to init: neither is ours any more.
    (proc / "101" / "stat").unlink()
    (proc / "101").rmdir()
    write_stat(proc, 102, "sleep", 1)
    assert sorted(scan.descendants(100)) == [103]
    assert 101 not in scan.parents and scan.parents[102] == 1


def test_without_proc_there_is_nothing_to_scan(tmp_path):
    assert ProcScan(str(tmp_path / "missing")).descendants(1) is None
    assert _descendants_by_scan(1, str(tmp_path / "missing")) is None
