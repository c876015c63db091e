"""The cause is right on a busy host: kernel counters per process, CPU contention from others, warm-up, pressure.

The busy host is real: two ``while True: pass`` processes that are not ours (not children of
the test process, as another user's jobs would not be), started and killed by the test and
bounded in time should the test die first.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import gpuwidget
from gpuwidget.advice.advisor import advise
from gpuwidget.advice.loader import diagnose
from gpuwidget.advice.rules import cpu_contention
from gpuwidget.probes.torch_data import loader_kwargs
from gpuwidget.sources import host
from gpuwidget.sources.host import HostSource, psi_some_total

import workloads
from support import burn_cpu, hogs

TESTS = Path(__file__).resolve().parent
# A hog ends by itself after this long, whatever happens to the test that started it.
HOG_LIFETIME_S = 60
LOADER_RULES = {"dataloader-starved", "dataloader-cpu-bound", "io-bound"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def two_hogs() -> Iterator[list[int]]:
    """Two busy processes outside this process tree and session."""
    with hogs(2, HOG_LIFETIME_S) as pids:
        assert not set(pids) & {c.pid for c in multiprocessing.active_children()}
        yield pids


def watched(workload: workloads.Workload, loader: DataLoader | None = None) -> gpuwidget.Run:
    train_loader = loader if loader is not None else workload.loader
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        workload.train(train_loader)
    return run


def loop_seconds(workload: workloads.Workload, loader: DataLoader) -> float:
    started = time.perf_counter()
    workload.train(loader)
    return time.perf_counter() - started


def rules(run: gpuwidget.Run) -> dict[str, Any]:
    return {f.rule: f for f in run.findings}


# ---------------------------------------------------------------- real loops, real load


def test_storage_bound_loader_on_a_busy_host_is_io_bound_with_contention_and_workers_beyond_the_cores(two_hogs):
    # 30 steps of 96 ms on "storage": long enough that starting the workers on cores the hogs (and
    # whatever else runs) hold is not most of the loop they are to speed up.
    workload = workloads.slow_storage(items=480, latency=0.006)
    run = watched(workload)
    found = rules(run)
    assert "io-bound" in found and "dataloader-cpu-bound" not in found, [dict(f.evidence) for f in run.findings]
    assert run.summary["cpu_util_mean"] >= 85  # the host is saturated, and still: storage
    change = found["io-bound"].change
    assert change["num_workers"] > run.machine["usable_cpus"]
    assert "cpu-contention" in found, dict(found["io-bound"].evidence)
    contention = found["cpu-contention"]
    assert contention.evidence["other_cpu_cores"] >= 1.0  # the two hogs, at least half a core each
    assert 0.0 <= contention.evidence["run_delay_fraction"] < 1.0
    # Each stands where its gain puts it; the machine's is marked as such (report.MACHINE_LABEL).
    assert run.findings == sorted(run.findings, key=lambda f: -(f.expected_speedup or 0.0))
    assert contention.machine_level and not found["io-bound"].machine_level
    assert contention.expected_speedup == contention.evidence["speedup_without_contention"]
    # The workers beyond the cores pay, hogs and all (1.35-2x on a loop of 20 steps, where starting
    # 8 workers on contended cores is a good part of the time; 2.5-4x on longer ones).
    before = run.summary["loop_time_s"]
    after = loop_seconds(workload, DataLoader(**loader_kwargs(workload.loader, change)))
    assert after < 0.85 * before, f"{before:.2f}s -> {after:.2f}s with {change}"


def test_a_fed_loop_beside_two_busy_processes_gets_contention_with_its_bound(two_hogs):
    """The held-out case: a loop running 3.5x slower beside two busy processes, its main thread
    waiting for a core 65% of the time, got "no cause of idle time found" as it was not starved."""
    # In-memory tensors: never starved. 32 steps: a cause needs 16 steady ones (advice.evidence), and
    # beside the hogs a first step preempted for long counts as warm-up (16 steps in all read
    # "watch longer" when it did).
    run = watched(workloads.healthy(items=2048))
    found = rules(run)
    if "process_run_delay_mean" not in run.summary:
        pytest.skip("no /proc/<pid>/schedstat on this kernel")
    assert not found.keys() & LOADER_RULES and run.summary["data_wait_fraction"] < 0.1
    assert "cpu-contention" in found, (run.summary["process_run_delay_mean"], run.summary.get("other_cpu_mean"))
    contention = found["cpu-contention"]
    lost = contention.evidence["loop_run_delay_fraction"]
    assert lost >= 0.1 and contention.evidence["other_cpu_cores"] >= 1.0
    bound = contention.evidence["speedup_without_contention"]
    assert bound == pytest.approx(1 / (1 - lost), rel=0.01) and f"at most {bound:.2f}x faster" in contention.suggestion


def test_cpu_heavy_loader_is_cpu_work_not_storage():
    run = watched(workloads.cpu_heavy_transform(items=640))  # 40 batches, 1.6 s: past the evidence gate
    d = diagnose(run.summary, run.workload, run.machine)
    assert d is not None and d.cause == "cpu", d
    assert "io-bound" not in rules(run)
    assert rules(run).keys() & {"dataloader-starved", "dataloader-cpu-bound"}


FIRST_CELL = """
import sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import gpuwidget
from gpuwidget.advice.loader import diagnose
import workloads

for _ in range(2):
    workload = workloads.slow_storage(items=320, latency=0.004)  # 20 steps, 1.3 s: enough to name a cause
    train_loader = workload.loader
    with gpuwidget.watch(quiet=True) as run:
        workload.train(train_loader)
    d = diagnose(run.summary, run.workload, run.machine)
    io = next((f for f in run.findings if f.rule == "io-bound"), None)
    print(d.cause, io.change.get("num_workers") if io else None, run.machine["usable_cpus"])
"""


def test_first_watched_cell_in_a_fresh_process_reaches_the_same_diagnosis_as_the_next():
    """Warm-up (first batch, lazy imports, the sampler's first ticks) must not flip a
    storage-bound loader to "unknown" and cap its workers at the cores."""
    out = subprocess.run([sys.executable, "-c", FIRST_CELL.format(tests=str(TESTS))], capture_output=True,
                         text=True, timeout=120, cwd=TESTS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = (line.split() for line in out.stdout.strip().splitlines()[-2:])
    assert first[0] == second[0] == "io", out.stdout
    assert int(first[1]) > int(first[2]) and int(second[1]) > int(second[2]), out.stdout


def test_spawned_workers_importing_torch_are_not_taken_for_batch_building():
    """A spawned worker (macOS, Windows) spends seconds of CPU importing torch before its first
    batch, and tearing it down after the last: neither is how it builds batches."""
    workload = workloads.slow_storage(items=480, latency=0.006)  # 30 steps: 1.4 s after the spawn
    loader = DataLoader(**loader_kwargs(workload.loader, {"num_workers": 2, "multiprocessing_context": "spawn"}))
    run = watched(workload, loader)
    d = diagnose(run.summary, run.workload, run.machine)
    assert d is not None and d.cause == "io", (d.workers_busy, d.builder_delay)
    assert "io-bound" in rules(run)


# ---------------------------------------------------------------- the rule at its edges


def facts(wait: float = 3.0, compute: float = 1.0, workers: int = 0, wait_cpu: float | None = 0.05,
          wait_delay: float | None = 0.05) -> dict[str, Any]:
    return {"loaders": [{
        "name": "train_loader", "dataset_name": "train_ds", "epochs": 1, "steps": 100, "samples": 3200,
        "wait_total_s": wait, "compute_total_s": compute, "loop_time_s": wait + compute,
        "wait_cpu_ratio": wait_cpu, "wait_delay_ratio": wait_delay,
        "step_times": [(wait + compute) / 100] * 100, "wait_times": [wait / 100] * 100,
        "settings": {"batch_size": 32, "num_workers": workers, "pin_memory": False, "shuffle": True,
                     "prefetch_factor": 2 if workers else None, "persistent_workers": False,
                     "default_collate": True},
    }]}


def busy_host(loop_delay: float = 20.0, others: float = 150.0, **extra: Any) -> dict[str, Any]:
    return {"cpu_util_mean": 99.0, "process_cpu_mean": 10.0, "workers_cpu_mean": 0.0,
            "process_run_delay_mean": loop_delay, "other_cpu_mean": others, "psi_cpu_some_mean": 90.0, **extra}


MACHINE = {"gpus": [], "usable_cpus": 2}


def test_contention_needs_a_tenth_of_the_time_lost_waiting_for_a_core():
    # Others on 0.6 of the 2 cores: not most of them, so the time lost decides.
    at = cpu_contention.check(busy_host(loop_delay=10.0, others=60.0), facts(wait_delay=0.02), MACHINE)
    assert at is not None and at.evidence["run_delay_fraction"] == 0.1 and at.severity == "warn"
    assert at.evidence["speedup_without_contention"] == pytest.approx(1 / 0.9, rel=0.01)
    # Its bound is its gain, as for any finding (it ranks by it), and it is marked as the machine's.
    assert at.expected_speedup == at.evidence["speedup_without_contention"] and at.machine_level
    assert cpu_contention.check(busy_host(loop_delay=9.9, others=60.0), facts(wait_delay=0.02), MACHINE) is None
    assert cpu_contention.check(busy_host(loop_delay=40.0), facts(), MACHINE).severity == "critical"


def test_others_holding_most_of_the_cores_are_information_even_before_time_is_lost():
    # A storage-bound loop with one reader seldom queues; the workers it is told to add will.
    found = cpu_contention.check(busy_host(loop_delay=3.0, others=100.0), facts(wait_delay=0.01), MACHINE)
    assert found is not None and found.severity == "info"
    assert cpu_contention.check(busy_host(loop_delay=3.0, others=99.0), facts(wait_delay=0.01), MACHINE) is None


def test_contention_needs_other_processes_on_the_cores_not_our_own_workers():
    # Eight CPU-bound workers queue for each other on 2 cores: too many workers, not contention.
    workload = facts(workers=8, wait_cpu=None)
    own = busy_host(others=20.0, workers_cpu_mean=180.0, workers_run_delay_mean=600.0)
    assert cpu_contention.check(own, workload, MACHINE) is None
    assert cpu_contention.check({**own, "other_cpu_mean": 50.0}, workload, MACHINE) is not None
    assert cpu_contention.check({**own, "other_cpu_mean": 49.0}, workload, MACHINE) is None


def test_contention_is_named_for_a_loop_that_is_not_starved_when_its_thread_waits_for_a_core():
    # The loop waits for data 5% of the time, and its thread queued for a core 20% of it.
    fed = facts(wait=0.05, compute=1.0)
    found = cpu_contention.check(busy_host(loop_delay=20.0), fed, MACHINE)
    assert found is not None and found.severity == "warn" and found.evidence["loop_run_delay_fraction"] == 0.2
    assert found.evidence["speedup_without_contention"] == pytest.approx(1.25)
    assert "at most 1.25x faster" in found.suggestion and found.expected_speedup == 1.25
    assert cpu_contention.check(busy_host(loop_delay=9.9), fed, MACHINE) is None
    # Others holding most of the cores is worth saying only to a starved loop (told to add workers).
    assert cpu_contention.check(busy_host(loop_delay=3.0, others=200.0), fed, MACHINE) is None


def test_contention_is_named_for_a_loop_without_a_dataloader_from_its_main_thread():
    # A loop that fetches its own batches: the optimizer's step times and the thread's run delay.
    own_batches = {"training": {"optimizer_steps": 200, "step_times": [0.01] * 200}}
    found = cpu_contention.check(busy_host(loop_delay=65.0), own_batches, MACHINE)
    assert found is not None and found.severity == "critical"
    assert found.evidence["speedup_without_contention"] == pytest.approx(1 / 0.35, rel=0.01)
    # The same loop over 0.5 s: too short to name a cause.
    short = {"training": {"optimizer_steps": 50, "step_times": [0.01] * 50}}
    assert cpu_contention.check(busy_host(loop_delay=65.0), short, MACHINE) is None


def test_contention_without_counters_is_not_claimed():
    no_counters = {k: v for k, v in busy_host().items() if k not in ("process_run_delay_mean", "other_cpu_mean")}
    assert cpu_contention.check(no_counters, facts(wait_delay=None), MACHINE) is None
    assert cpu_contention.check(no_counters, facts(wait=0.05, compute=1.0, wait_delay=None), MACHINE) is None


def test_a_sleeping_builder_on_a_saturated_host_keeps_its_storage_advice_beside_the_contention():
    found = {f.rule: f for f in advise(busy_host(), facts(wait_cpu=0.03, wait_delay=0.3), MACHINE)}
    assert {"io-bound", "cpu-contention"} <= found.keys() and "dataloader-cpu-bound" not in found
    assert found["io-bound"].change["num_workers"] > MACHINE["usable_cpus"]
    assert "io-bound" in found["cpu-contention"].suggestion


def test_a_builder_queued_for_cores_others_hold_is_cpu_work_with_contention_beside_it():
    # On a core 20% of the time, queued 70%, asleep 10%: CPU work on cores other processes
    # hold (1.5 of 2). More workers would not win it a larger share of them: cheaper batches.
    found = {f.rule: f for f in advise(busy_host(), facts(wait_cpu=0.2, wait_delay=0.7), MACHINE)}
    assert {"dataloader-cpu-bound", "cpu-contention"} <= found.keys()
    assert not found.keys() & {"io-bound", "dataloader-starved"}
    assert "cheaper" in found["cpu-contention"].suggestion


def test_a_loader_that_saturates_the_cores_itself_needs_cheaper_batches_and_is_no_contention():
    own = busy_host(others=40.0, process_cpu_mean=100.0, workers_cpu_mean=90.0)
    found = {f.rule for f in advise(own, facts(wait_cpu=0.6, wait_delay=0.3), MACHINE)}
    assert "dataloader-cpu-bound" in found and not found & {"dataloader-starved", "cpu-contention"}


def test_a_pod_at_its_cpu_quota_is_saturated_on_an_idle_node():
    # 4 CPU-bound workers using the pod's 4-CPU quota on a 64-core node that is 7% busy.
    pod = {"gpus": [], "usable_cpus": 4, "cpu_limit": 4.0, "cpu_count": 64}
    at_quota = {"cpu_util_mean": 7.0, "process_cpu_mean": 15.0, "workers_cpu_mean": 370.0,
                "workers_run_delay_mean": 20.0, "other_cpu_mean": 40.0}
    found = {f.rule: f for f in advise(at_quota, facts(workers=4, wait_cpu=None), pod)}
    assert "dataloader-cpu-bound" in found and "dataloader-starved" not in found
    assert found["dataloader-cpu-bound"].evidence["cpus_busy_percent"] == pytest.approx(96.2, abs=0.1)
    assert "96% busy (4 cores)" in found["dataloader-cpu-bound"].suggestion
    # The same figures with the node's 64 cores to use: not saturated, more workers help.
    node = {"gpus": [], "usable_cpus": 64, "cpu_limit": None, "cpu_count": 64}
    found = {f.rule: f for f in advise(at_quota, facts(workers=4, wait_cpu=None), node)}
    assert "dataloader-cpu-bound" not in found and found["dataloader-starved"].change["num_workers"] > 4


def test_contention_code_runs_as_pasted_and_lists_processes():
    finding = cpu_contention.check(busy_host(), facts(), MACHINE)
    namespace: dict[str, Any] = {}
    exec(compile(finding.code, "<finding>", "exec"), namespace)  # noqa: S102 - the user's paste, here


# ---------------------------------------------------------------- the host source's figures


def test_pressure_totals_are_read_from_the_some_line(tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=1.00 avg60=2.00 avg300=3.00 total=2500000\nfull avg10=0 avg60=0 avg300=0 total=7\n")
    assert psi_some_total(str(psi)) == pytest.approx(2.5)
    assert psi_some_total(str(tmp_path / "absent")) is None
    (tmp_path / "odd").write_text("some avg10=1.00\n")
    assert psi_some_total(str(tmp_path / "odd")) is None


def test_pressure_is_a_percent_of_wall_time_between_reads_and_absent_without_psi(tmp_path, monkeypatch):
    cpu, io = tmp_path / "cpu", tmp_path / "io"
    cpu.write_text("some avg10=0 avg60=0 avg300=0 total=1000000\n")
    monkeypatch.setattr(host, "PSI_FILES", {"psi.cpu_some": str(cpu), "psi.io_some": str(io)})
    source = HostSource()
    values: dict[str, float] = {}
    source._read_pressure(values, 10.0)
    assert values == {}  # one reading: no interval yet
    cpu.write_text("some avg10=0 avg60=0 avg300=0 total=1250000\n")  # 0.25 s stalled...
    source._read_pressure(values, 10.5)  # ...in 0.5 s
    assert values == {"psi.cpu_some": pytest.approx(50.0)}  # no io file: absent, not 0


def test_process_rates_need_a_long_enough_interval_and_stay_within_the_usable_cores():
    source = HostSource()
    source.read()
    last = time.perf_counter()
    assert "proc.cpu" not in source.read()  # microseconds apart: no rate from 10 ms clock ticks
    source._usable = 1  # judge the tree against one core: two busy children exceed it
    children = [multiprocessing.get_context("fork").Process(target=burn_cpu, args=(0.6,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join()
    time.sleep(0.06)
    reported = 0.0
    for _ in range(15):  # what is over the cap comes in later ticks, not never
        values = source.read()
        now = time.perf_counter()
        assert values.get("proc.workers_cpu", 0.0) <= 100.0 and values.get("proc.cpu", 0.0) <= 100.0
        reported += values.get("proc.workers_cpu", 0.0) / 100 * (now - last)
        last = now
        time.sleep(0.1)
    assert reported == pytest.approx(1.2, rel=0.35)


def test_children_are_listed_every_tick_in_a_watchs_first_seconds_then_once_a_second(monkeypatch):
    scans = []
    original = host._descendants
    monkeypatch.setattr(host, "_descendants", lambda pid: scans.append(1) or original(pid))
    clock = [100.0]
    monkeypatch.setattr(host, "now", lambda: clock[0])
    source = HostSource()
    for _ in range(20):  # 2 s at 10 Hz: a loader starting its workers is seen at once
        source.read()
        clock[0] += 0.1
    assert len(scans) == 20
    for _ in range(20):  # the next 2 s
        source.read()
        clock[0] += 0.1
    assert len(scans) == 22


def test_a_one_millisecond_cell_shows_no_impossible_process_cpu():
    with gpuwidget.watch(quiet=True) as run:
        pass
    cpu = run.summary["process_cpu_mean"]
    assert cpu is None or cpu <= 100 * run.machine["usable_cpus"]


def test_run_delay_of_a_process_queued_behind_others_is_measured(two_hogs):
    source = HostSource()
    source.read()
    time.sleep(0.05)
    burn_cpu(0.3)  # this thread wants a core all the time; two hogs want the other two
    values = source.read()
    if "proc.run_delay" not in values:
        pytest.skip("no /proc/<pid>/schedstat on this kernel")
    assert values["proc.run_delay"] > 5.0
    assert values["cpu.others"] >= 50.0


def test_the_kernel_counters_reach_the_summary():
    run = watched(workloads.slow_storage(items=160, latency=0.003))
    if host.read_schedstat(host.schedstat_path(os.getpid())) is None:
        pytest.skip("no /proc/<pid>/schedstat on this kernel")
    for key in ("process_run_delay_mean", "other_cpu_mean"):
        assert run.summary[key] >= 0.0, key
    assert 0.0 <= run.workload["loaders"][0]["wait_delay_ratio"] <= 1.0
