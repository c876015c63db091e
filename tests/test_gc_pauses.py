"""Python's garbage collections during a watch (gpuwidget.probes.gc_pauses): recorded through
gc.callbacks, and taken out of the DataLoader waits they fell in, so that a collection inside
``next()`` is not read as a loader that cannot keep up."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gpuwidget
from gpuwidget.probes.gc_pauses import KEEP_S, MIN_PAUSE_S, GcPauses
from gpuwidget.probes.torch_data import CPU_SAMPLE_EVERY, DataLoaderProbe
from gpuwidget.trace import Trace

PAUSE_S = 0.3  # a full collection of a large heap on this machine (the test suite's: 0.2-0.3 s)


class SlowToCollect:
    """Garbage only a collection finds (a cycle), whose finalizer makes that collection last PAUSE_S."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(PAUSE_S)


def collect_slowly() -> None:
    SlowToCollect()
    gc.collect()


def test_a_collection_is_counted_and_a_long_one_kept_with_its_times_until_uninstalled():
    pauses = GcPauses()
    pauses.install()
    try:
        before = time.perf_counter()
        collect_slowly()
        after = time.perf_counter()
    finally:
        pauses.uninstall()
    assert pauses.collections >= 1 and pauses.seconds >= PAUSE_S
    (start, end), = [pause for pause in pauses.pauses if pause[1] - pause[0] >= PAUSE_S]
    assert before <= start < end <= after
    assert pauses._on_collection not in gc.callbacks
    counted = pauses.collections
    gc.collect()
    assert pauses.collections == counted  # nothing recorded once uninstalled
    pauses.uninstall()  # twice is harmless


def test_a_forked_process_records_nothing_of_its_own_collections():
    """A DataLoader's workers are forked with the watched process's callbacks: their collections are
    theirs, and the watched process's figures are not moved by them."""
    pauses = GcPauses()
    pauses.install()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: collect slowly, report what its copy recorded, leave at once
            try:
                collect_slowly()
                os.write(write, str(pauses.collections).encode())
            finally:
                os._exit(0)
        os.close(write)
        child_counted = int(os.read(read, 64) or b"-1")
        os.close(read)
        os.waitpid(pid, 0)
    finally:
        pauses.uninstall()
    assert child_counted == 0 and pauses.longest < PAUSE_S  # (the parent may have made quick ones meanwhile)


def test_the_overlap_is_what_the_pauses_cover_of_each_interval_and_stale_pauses_go():
    pauses = GcPauses()
    assert pauses.overlap(np.array([1.0]), np.array([2.0])) is None  # no pause: nothing made
    pauses.pauses = [(0.0, 0.5), (100.0, 100.3), (100.5, 100.6)]
    starts, ends = np.array([99.0, 100.1, 100.55, 101.0]), np.array([100.2, 100.55, 100.7, 102.0])
    covered = pauses.overlap(starts, ends)
    assert covered is not None and covered.tolist() == pytest.approx([0.2, 0.2 + 0.05, 0.05, 0.0])
    assert pauses.pauses == [(100.0, 100.3), (100.5, 100.6)]  # the first ended more than KEEP_S before
    assert 99.0 - KEEP_S > 0.5
    assert pauses.overlap(np.array([200.0]), np.array([201.0])) is None
    assert MIN_PAUSE_S <= 0.001  # the young generations' collections are not kept one by one


class Items(Dataset):
    """In-memory items; a slow collection falls due while the loop's thread builds batch ``stall_batch``."""

    def __init__(self, count: int, stall_batch: int | None, batch_size: int) -> None:
        self.data = torch.randn(count, 8)
        self.stall_at = None if stall_batch is None else stall_batch * batch_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.stall_at:
            collect_slowly()
        return self.data[index]


@pytest.mark.serial
def test_a_collection_inside_next_is_the_loops_own_time_not_a_starved_loader():
    """32 in-memory batches, 40 ms of work each: a 0.3 s collection inside one next() read as 19% of
    the loop waiting for data, and the loader as starved. It is the loop's own time: the loader's
    waits are what it made the loop wait, and its facts say how much collection was taken out."""
    def watched(stall_batch: int | None) -> gpuwidget.Run:
        loader = DataLoader(Items(256, stall_batch=stall_batch, batch_size=8), batch_size=8)
        with gpuwidget.watch(quiet=True) as run:
            for _ in loader:
                time.sleep(0.04)
        return run

    next(iter(DataLoader(Items(8, None, 8), batch_size=8)))  # a DataLoader's one-off first costs, paid here
    # The same loop without the collection, in the same run: what building 32 batches made the loop wait
    # on this machine now (0.01 s on a quiet one; 0.1 s beside a neighbour on a slow host, fresh-check run 93).
    (control,) = watched(None).workload["loaders"]
    run = watched(12)
    (facts,) = run.workload["loaders"]
    assert facts["steps"] == 32 and facts["gc_wait_s"] >= PAUSE_S
    # Counted as a wait, the collection would add PAUSE_S: it adds nothing beyond the machine's noise.
    assert facts["wait_total_s"] < control["wait_total_s"] + 0.2 * PAUSE_S, (facts["wait_times"],
                                                                              control["wait_times"])
    assert max(facts["wait_times"]) < PAUSE_S / 2  # the batch the collection fell in waited no longer
    assert sum(facts["step_times"]) == pytest.approx(facts["loop_time_s"], rel=0.05)  # the steps kept their time
    assert "dataloader-starved" not in [finding.rule for finding in run.findings]
    assert run.workload["gc"]["collections"] >= 1 and run.workload["gc"]["longest_s"] >= PAUSE_S
    assert all(callback.__qualname__ != GcPauses._on_collection.__qualname__ for callback in gc.callbacks)


def probed_loop(stall_batch: int) -> tuple[Trace, Any]:
    """Five batches of 8 items under the DataLoader probe alone, a slow collection in batch ``stall_batch``:
    the trace and the loader's stats."""
    trace = Trace()
    probe = DataLoaderProbe(trace)
    probe.install()
    try:
        for _ in DataLoader(Items(40, stall_batch=stall_batch, batch_size=8), batch_size=8):
            pass
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    return trace, stats


def test_the_probe_takes_a_collection_out_of_the_wait_it_fell_in_only():
    trace, stats = probed_loop(stall_batch=2)
    facts = stats.facts({})
    assert facts["gc_wait_s"] >= PAUSE_S and facts["wait_total_s"] < PAUSE_S / 2
    assert facts["compute_total_s"] >= PAUSE_S  # counted as the loop's own time
    waits = trace.spans("loader.wait")
    assert len(waits) == 5 and max(span.end - span.start for span in waits) < PAUSE_S / 2


def test_a_collection_inside_a_sampled_wait_is_out_of_its_time_and_its_cpu():
    """The second next() is read for its CPU and run delay (torch_data.sampled): a collection inside it is
    the loop's own time there too, so its sampled wait is the wait the loader's figures show, and the
    collection's CPU (0.3 s of a finalizer's sleep here, no CPU) is not read as the loader's."""
    trace, stats = probed_loop(stall_batch=1)
    facts = stats.facts({})
    assert stats.sampled_calls >= 1 and facts["gc_wait_s"] >= PAUSE_S
    sampled = facts["wait_times"][1::CPU_SAMPLE_EVERY]
    assert facts["wait_sampled_s"] == pytest.approx(sum(sampled)) and facts["wait_sampled_s"] < PAUSE_S / 2
    assert 0.0 <= stats.wait_cpu_total <= facts["wait_sampled_s"] + 0.01


def test_the_cpu_a_collection_takes_is_kept_by_the_thread_that_ran_it():
    pauses = GcPauses()
    pauses.install()
    try:
        cpu_before = time.thread_time()
        garbage = [[index] for index in range(300_000)]
        for item in garbage:
            item.append(item)  # cycles: a full collection has 300,000 of them to find (tens of ms)
        del garbage, item
        gc.collect()
        cpu = time.thread_time() - cpu_before
    finally:
        pauses.uninstall()
    assert pauses.kept >= MIN_PAUSE_S
    assert set(pauses.kept_cpu) == {threading.get_ident()}
    assert 0.0 < pauses.kept_cpu[threading.get_ident()] <= cpu
