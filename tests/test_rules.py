"""Each rule at the edges of its thresholds, on synthetic figures (GPU cases cannot run here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpuwidget.advice.advisor import advise, rank
from gpuwidget.advice.code import loader_code
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules import (
    RULES,
    dataloader_starved,
    fp32_math,
    gpu_imbalance,
    gpu_throttled,
    gpu_unused,
    io_bound,
    launch_bound,
    memory_pressure,
    pageable_transfer,
    periodic_stall,
    small_batch,
)
from gpuwidget.probes.torch_data import loader_kwargs, loader_settings

STABLE_IDS = {"dataloader-starved", "dataloader-cpu-bound", "io-bound", "small-batch", "memory-pressure",
              "fp32-math", "launch-bound", "periodic-stall", "pageable-transfer", "gpu-throttled", "gpu-unused",
              "gpu-imbalance", "cpu-contention", "rank-straggler", "ddp-communication", "data-parallel",
              "watch-longer", "loop-waits"}
H100 = {"gpus": [{"index": 0, "name": "NVIDIA H100"}], "usable_cpus": 8}
NO_GPU = {"gpus": [], "usable_cpus": 8}


def loader_facts(wait: float = 0.0, compute: float = 1.0, steps: int = 100, workers: int = 0,
                 wait_cpu: float | None = 1.0, epochs: int = 1, pin: bool = False, batch: int = 32,
                 step_times: list[float] | None = None, wait_times: list[float] | None = None) -> dict[str, Any]:
    return {
        "name": "train_loader", "dataset_name": "train_ds", "epochs": epochs, "steps": steps,
        "samples": steps * batch, "wait_total_s": wait, "compute_total_s": compute, "loop_time_s": wait + compute,
        "wait_cpu_ratio": wait_cpu,
        "step_times": step_times or [(wait + compute) / steps] * steps,
        "wait_times": wait_times or [wait / steps] * steps,
        "settings": {"batch_size": batch, "num_workers": workers, "pin_memory": pin, "shuffle": True,
                     "prefetch_factor": 2 if workers else None, "persistent_workers": False,
                     "default_collate": True},
    }


def summary(busy: float | None = None, memory: float | None = None, process: float = 50.0,
            host: float = 30.0, wait_fraction: float = 0.0, workers_cpu: float | None = None,
            **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"process_cpu_mean": process, "cpu_util_mean": host,
                           "data_wait_fraction": wait_fraction, "workers_cpu_mean": workers_cpu}
    if busy is not None:
        out["gpu_busy_mean"] = busy
    if memory is not None:
        out["peak_gpu_mem_fraction"] = memory
    out.update(extra)
    return out


def cuda_model(dtype: str = "float32", autocast: bool = False, precision: str = "highest",
               compiled: bool = False) -> dict[str, Any]:
    return {"name": "net", "param_devices": ["cuda"], "param_dtypes": {dtype: 1000}, "compiled": compiled,
            "autocast": {"enabled": autocast}, "float32_matmul_precision": precision}


def cuda(capability: tuple[int, int] = (9, 0), allocated: int = 10, reserved: int = 10,
         total: int = 100) -> dict[str, Any]:
    return {"devices": [{"index": 0, "capability": list(capability), "total_memory": total,
                         "peak_allocated": allocated, "peak_reserved": reserved}]}


def test_rule_ids_are_the_stable_ones():
    assert set(RULES) == STABLE_IDS


# ------------------------------------------------------------------ loader diagnosis


def test_starved_threshold_is_ten_percent_of_the_loop():
    below = {"loaders": [loader_facts(wait=0.099, compute=0.901)]}
    at = {"loaders": [loader_facts(wait=0.1, compute=0.9)]}
    assert dataloader_starved.check(summary(), below, NO_GPU) is None
    finding = dataloader_starved.check(summary(), at, NO_GPU)
    assert finding is not None and finding.evidence["upper_bound_speedup"] == pytest.approx(1 / 0.9, rel=0.01)
    # One worker takes the 1 ms wait off each step but hands each batch over (1 ms): no gain to expect.
    assert finding.expected_speedup == finding.evidence["expected_gain"] == 1.0


def test_worker_count_comes_from_production_and_consumption_times():
    # 20 ms to build a batch, 5 ms to use it: 1.2 * 20 / 5 = 4.8 -> 5 workers (8 cores here),
    # on a loop long enough that starting them is nothing next to it.
    workload = {"loaders": [loader_facts(wait=200.0, compute=50.0, steps=10_000)]}
    finding = dataloader_starved.check(summary(), workload, NO_GPU)
    assert finding.change == {"num_workers": 5}
    # The same loop on 2 usable cores is capped at 2: more would only contend for CPU.
    finding = dataloader_starved.check(summary(), workload, {**NO_GPU, "usable_cpus": 2})
    assert finding.change == {"num_workers": 2}


def test_starved_workers_are_scaled_from_their_observed_rate():
    # 2 workers, 10 ms wait + 5 ms compute per step: each worker needs 2 * 15 ms per batch.
    workload = {"loaders": [loader_facts(wait=100.0, compute=50.0, workers=2, wait_cpu=None, steps=10_000)]}
    finding = dataloader_starved.check(summary(workers_cpu=190.0), workload, NO_GPU)
    assert finding.change["num_workers"] == 8  # ceil(1.2 * 30 / 5) = 8, the 8 usable cores


def test_saturated_cpus_get_cheaper_batches_not_more_workers():
    workload = {"loaders": [loader_facts(wait=1.0, compute=1.0, workers=8, wait_cpu=None)]}
    busy = summary(host=95.0, workers_cpu=760.0)
    found = {f.rule: f for f in advise(busy, workload, NO_GPU)}
    assert "dataloader-starved" not in found
    assert found["dataloader-cpu-bound"].change == {}
    assert "transforms" in found["dataloader-cpu-bound"].suggestion


def test_sleeping_loader_is_io_bound_with_workers_beyond_the_cores():
    workload = {"loaders": [loader_facts(wait=300.0, compute=50.0, wait_cpu=0.05, steps=10_000)]}
    found = {f.rule: f for f in advise(summary(), workload, {**NO_GPU, "usable_cpus": 2})}
    assert "dataloader-starved" not in found  # io-bound carries the change
    assert found["io-bound"].change["num_workers"] == 8  # 4 per core, 2 cores


def test_workers_queued_for_cores_on_a_saturated_host_do_cpu_work_on_cores_others_hold():
    # Two workers on a core 15% of the time and queued for one 70% while other programs
    # kept 1.5 of the 2 cores busy: CPU work (hardly asleep), on cores taken from outside.
    workload = {"loaders": [loader_facts(wait=2.0, compute=0.5, workers=2, wait_cpu=None)]}
    busy = summary(host=97.0, workers_cpu=30.0, workers_run_delay_mean=140.0, other_cpu_mean=150.0)
    found = {f.rule for f in advise(busy, workload, {**NO_GPU, "usable_cpus": 2})}
    assert {"dataloader-cpu-bound", "cpu-contention"} <= found and "io-bound" not in found
    # The same workers saturating the cores themselves: cheaper batches, no contention.
    own = summary(host=97.0, workers_cpu=170.0, workers_run_delay_mean=20.0, other_cpu_mean=20.0)
    found = {f.rule for f in advise(own, workload, {**NO_GPU, "usable_cpus": 2})}
    assert "dataloader-cpu-bound" in found and "cpu-contention" not in found


def test_idle_workers_on_a_saturated_host_without_run_delay_counters_are_not_called_storage_bound():
    # Without schedstat (not Linux) a worker queued for a core looks like one asleep.
    workload = {"loaders": [loader_facts(wait=2.0, compute=0.5, workers=2, wait_cpu=None)]}
    found = {f.rule for f in advise(summary(host=97.0, workers_cpu=30.0), workload, {**NO_GPU, "usable_cpus": 2})}
    assert not found & {"io-bound", "dataloader-cpu-bound", "cpu-contention"}


def test_persistent_workers_and_prefetch_when_the_measurement_calls_for_them():
    waits = [0.001] * 90 + [0.2] * 10  # bursty
    workload = {"loaders": [loader_facts(wait=sum(waits), compute=1.0, workers=2, wait_cpu=None, epochs=3,
                                         wait_times=waits)]}
    finding = dataloader_starved.check(summary(workers_cpu=100.0), workload, NO_GPU)
    assert finding.change["persistent_workers"] is True
    assert finding.change["prefetch_factor"] == 4


def test_pin_memory_only_when_the_model_is_on_cuda():
    starved = {"loaders": [loader_facts(wait=1.0, compute=1.0)]}
    assert "pin_memory" not in dataloader_starved.check(summary(), starved, NO_GPU).change
    on_gpu = {**starved, "model": cuda_model()}
    assert dataloader_starved.check(summary(busy=40.0), on_gpu, H100).change["pin_memory"] is True
    # ... and its batches in host memory: a dataset already on the GPU has nothing to pin.
    held_there = {"loaders": [{**loader_facts(wait=1.0, compute=1.0), "batch_device": "cuda"}],
                  "model": cuda_model()}
    assert "pin_memory" not in dataloader_starved.check(summary(busy=40.0), held_there, H100).change


def test_every_suggested_change_builds_a_valid_dataloader():
    data = TensorDataset(torch.randn(64, 4), torch.zeros(64))
    for original in (DataLoader(data, batch_size=8), DataLoader(data, batch_size=8, shuffle=True, num_workers=2)):
        facts = loader_facts(wait=1.0, compute=0.2, workers=original.num_workers, wait_cpu=0.05, epochs=2,
                             wait_times=[0.001] * 90 + [0.5] * 10)
        facts["settings"] = loader_settings(original)
        workload = {"loaders": [facts]}
        for finding in advise(summary(workers_cpu=10.0), workload, NO_GPU):
            if not finding.change:
                continue
            rebuilt = DataLoader(**loader_kwargs(original, finding.change))
            assert rebuilt.batch_size == 8
            assert rebuilt.num_workers == finding.change.get("num_workers", original.num_workers)
    # Turning workers off drops the settings torch rejects without workers.
    rebuilt = DataLoader(**loader_kwargs(DataLoader(data, num_workers=2, prefetch_factor=4), {"num_workers": 0}))
    assert rebuilt.num_workers == 0 and rebuilt.prefetch_factor is None


def test_changes_to_a_loader_over_an_iterable_dataset_stay_valid():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.zeros(10, 2))

    rebuilt = DataLoader(**loader_kwargs(DataLoader(Stream(), batch_size=5), {"num_workers": 1}))
    assert rebuilt.num_workers == 1 and sum(len(batch) for batch in rebuilt) == 10


def test_loader_code_keeps_sampling_and_collation_in_the_users_names():
    data = TensorDataset(torch.randn(64, 4))
    custom = DataLoader(data, batch_size=4, collate_fn=lambda items: items, drop_last=True)
    facts = {"name": "val_loader", "dataset_name": None, "settings": loader_settings(custom)}
    code = loader_code(facts, {"num_workers": 3, "persistent_workers": True})
    assert code == ("from torch.utils.data import DataLoader\n"
                    "val_loader = DataLoader(val_loader.dataset, batch_size=4, drop_last=True, "
                    "collate_fn=val_loader.collate_fn, num_workers=3, persistent_workers=True)")


# ------------------------------------------------------------------ GPU rules at their edges


def test_gpu_rules_never_fire_without_gpu_evidence():
    workload = {"loaders": [loader_facts(wait=0.0, compute=1.0)], "model": cuda_model(), "cuda": cuda()}
    everything = summary(busy=1.0, memory=0.99, process=99.0, gpu_throttle_fraction=1.0)
    assert advise(everything, workload, NO_GPU) == []
    # A GPU listed but no utilisation measured is no evidence either.
    no_util = {k: v for k, v in everything.items() if k != "gpu_busy_mean"}
    assert advise(no_util, workload, H100) == []


@pytest.mark.parametrize(("busy", "memory", "fires"), [(59.9, 0.49, True), (60.0, 0.49, False), (40.0, 0.5, False)])
def test_small_batch_edges(busy, memory, fires):
    workload = {"loaders": [loader_facts()], "model": cuda_model()}
    finding = small_batch.check(summary(busy=busy, memory=memory), workload, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.change["batch_size"] == 32 * 2 and finding.expected_speedup == pytest.approx(100 / busy, 0.01)


@pytest.mark.parametrize(("busy", "process", "fires"), [(49.9, 90.0, True), (50.0, 95.0, False), (30.0, 89.9, False)])
def test_launch_bound_edges(busy, process, fires):
    workload = {"loaders": [loader_facts()], "model": cuda_model()}
    finding = launch_bound.check(summary(busy=busy, process=process), workload, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.code == "import torch\nnet = torch.compile(net)"


@pytest.mark.parametrize(
    ("capability", "model", "fires"),
    [((8, 0), cuda_model(), True), ((7, 5), cuda_model(), False), ((9, 0), cuda_model(autocast=True), False),
     ((9, 0), cuda_model(precision="high"), False), ((9, 0), cuda_model(dtype="bfloat16"), False)],
)
def test_fp32_math_edges(capability, model, fires):
    workload = {"model": model, "cuda": cuda(capability)}
    finding = fp32_math.check(summary(busy=80.0), workload, H100)
    assert (finding is not None) is fires
    if finding:
        assert 'torch.set_float32_matmul_precision("high")' in finding.code
        assert finding.expected_speedup == pytest.approx(1 / (1 - 0.8 * 7 / 8), rel=0.01)


@pytest.mark.parametrize(("memory", "reserved", "fires"), [(0.92, 10, True), (0.919, 10, False), (0.5, 40, True)])
def test_memory_pressure_edges(memory, reserved, fires):
    finding = memory_pressure.check(summary(busy=90.0, memory=memory), {"cuda": cuda(reserved=reserved)}, H100)
    assert (finding is not None) is fires


@pytest.mark.parametrize(("share", "ratio", "fires"), [(0.2, None, True), (0.19, 0.95, False), (0.0, 0.7, True)])
def test_gpu_throttled_edges(share, ratio, fires):
    found = summary(busy=90.0, gpu_throttle_fraction=share, gpu_clock_ratio_busy=ratio)
    assert (gpu_throttled.check(found, {}, H100) is not None) is fires


@pytest.mark.parametrize(("busy", "devices", "fires"),
                         [(1.9, ["cpu"], True), (2.0, ["cpu"], False), (0.0, ["cuda"], False)])
def test_gpu_unused_edges(busy, devices, fires):
    workload = {"model": {"name": "net", "param_devices": devices}}
    finding = gpu_unused.check(summary(busy=busy, process=100.0), workload, H100)
    assert (finding is not None) is fires
    if finding:
        assert 'net = net.to("cuda")' in finding.code


def test_pageable_transfer_only_when_the_loop_is_not_already_starved():
    workload = {"loaders": [loader_facts()], "model": cuda_model()}
    assert pageable_transfer.check(summary(busy=70.0), workload, H100).change == {"pin_memory": True}
    pinned = {"loaders": [loader_facts(pin=True)], "model": cuda_model()}
    assert pageable_transfer.check(summary(busy=70.0), pinned, H100) is None
    assert pageable_transfer.check(summary(busy=70.0, wait_fraction=0.3), workload, H100) is None



def test_a_loader_whose_batches_are_already_on_the_gpu_is_never_told_to_pin_them():
    # A dataset held on the GPU (benchmarks/_gpu_workloads.py's small_batch, as recorded on an H200)
    # copies nothing, and pin_memory=True on its CUDA tensors would raise in the loader's pin thread.
    on_gpu = {"loaders": [{**loader_facts(), "batch_device": "cuda"}], "model": cuda_model()}
    assert pageable_transfer.check(summary(busy=70.0), on_gpu, H100) is None
    host = {"loaders": [{**loader_facts(), "batch_device": "cpu"}], "model": cuda_model()}
    assert pageable_transfer.check(summary(busy=70.0), host, H100).change == {"pin_memory": True}


def test_periodic_stall_needs_a_regular_period():
    regular = [0.01] * 100
    for i in range(9, 100, 10):
        regular[i] = 0.2
    workload = {"loaders": [loader_facts(step_times=regular, compute=sum(regular))]}
    finding = periodic_stall.check(summary(), workload, NO_GPU)
    assert finding.evidence["period_steps"] == 10 and finding.evidence["stalls"] == 10
    # One spurious slow step next to the pattern does not shift the period.
    noisy = list(regular)
    noisy[30] = 0.2
    assert periodic_stall.check(summary(), {"loaders": [loader_facts(step_times=noisy)]}, NO_GPU) \
        .evidence["period_steps"] == 10
    irregular = [0.01] * 100
    for i in (3, 4, 50, 97):
        irregular[i] = 0.2
    assert periodic_stall.check(summary(), {"loaders": [loader_facts(step_times=irregular)]}, NO_GPU) is None


def test_findings_rank_by_gain_then_severity():
    low = Finding("a", "critical", "a", expected_speedup=1.2)
    high = Finding("b", "info", "b", expected_speedup=3.0)
    unbounded = Finding("c", "critical", "c")
    assert rank([unbounded, low, high]) == [high, low, unbounded]


def test_a_broken_rule_is_skipped_not_fatal(monkeypatch):
    def broken(*_: Any) -> None:
        raise ZeroDivisionError

    monkeypatch.setitem(RULES, "dataloader-starved", broken)
    workload = {"loaders": [loader_facts(wait=3.0, compute=0.5, wait_cpu=0.05)]}
    assert [f.rule for f in advise(summary(), workload, NO_GPU)] == ["io-bound"]



# ------------------------------------------------------------------ expected gain of a loader change


@pytest.mark.parametrize(("wait_cpu", "machine", "workers", "expected_ms"), [
    # Each step waited 9 ms for a batch the loop built itself and computed 1 ms (10x if no
    # waiting were left), 100 steps. Storage: 4 workers deliver a batch every 2.25 ms (the
    # step's 1 ms compute and 1 ms hand-over take 2); they start (25 ms each) and fill the
    # pipe. The steady-state 11 would start 7 more for almost nothing on a loop this short.
    (0.0, NO_GPU, 4, 100 * 2.25 + 9 + 4 * 25),
    # CPU work on 2 cores (no GPU: the loop computes on one): 2 workers, a step every 5 ms,
    # as the 9 ms batch and the 1 ms compute share the 2 cores.
    (1.0, {**NO_GPU, "usable_cpus": 2}, 2, 100 * 5 + 9 + 2 * 25),
])
def test_expected_gain_is_that_of_the_change_below_the_no_wait_bound(wait_cpu, machine, workers, expected_ms):
    from gpuwidget.advice.loader import diagnose

    workload = {"loaders": [loader_facts(wait=0.9, compute=0.1, wait_cpu=wait_cpu)]}
    d = diagnose(summary(wait_fraction=0.9), workload, machine)
    assert d is not None and d.change["num_workers"] == workers
    assert d.evidence["upper_bound_speedup"] == pytest.approx(10.0)
    assert d.evidence["expected_gain"] == pytest.approx(1000 / expected_ms, abs=0.01)


def test_a_larger_batch_without_a_name_to_rebind_says_the_batch(tmp_path):
    # As the H200 run's small-batch finding showed it: a loader built in a function, held by no
    # variable. The instruction must carry the batch, not only the loader's speed settings.
    settings = loader_settings(DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=8))
    facts = {"name": None, "owner": None, "built_at": None, "settings": settings}
    code = loader_code(facts, {"batch_size": 512})
    assert code == "# No variable of yours holds this loader: in the code that builds this DataLoader, pass\n" \
                   "#     batch_size=512"
    exec(code, {})
    script = tmp_path / "build.py"
    script.write_text("from torch.utils.data import DataLoader\n\ndef make(data):\n"
                      "    return DataLoader(data, batch_size=8, shuffle=True)\n")
    site = {"file": str(script), "function": "make", "line": 4}
    code = loader_code({**facts, "built_at": site}, {"batch_size": 512})
    line = code.splitlines()[-1].removeprefix("#     ")
    assert line == "DataLoader(data, shuffle=True, batch_size=512)", code
    data = TensorDataset(torch.zeros(1024, 2))
    rebuilt = eval(line, {"DataLoader": DataLoader, "data": data})  # the line as the user's function would build it
    assert rebuilt.batch_size == 512 and len(next(iter(rebuilt))[0]) == 512
    hf = loader_code({**facts, "owner": "transformers"}, {"batch_size": 512}, {"frameworks": {"training_args": "args"}})
    assert "args.per_device_train_batch_size = 512" in hf
    exec(hf, {"args": type("Args", (), {})()})


@pytest.mark.parametrize(("facts", "frameworks", "says"), [
    ({"name": None, "owner": None, "built_at": None}, {}, "No variable of yours holds this loader"),
    ({"name": None, "owner": "lightning", "built_at": None}, {}, "train_dataloader"),
    ({"name": None, "owner": "lightning", "built_at": {"file": "/nowhere/m.py", "function": "f", "line": 3}}, {},
     "f() (/nowhere/m.py, line 3): pass it"),  # outside the working directory: its whole path
    ({"name": "dl", "owner": "accelerate", "built_at": None}, {}, "prepared by accelerate"),
    ({"name": None, "owner": "transformers", "built_at": None}, {"training_args": "args"},
     "args.dataloader_num_workers = 3"),
    ({"name": None, "owner": "transformers", "built_at": None}, {}, "TrainingArguments(..., dataloader_num_workers=3"),
])
def test_loader_code_without_a_name_to_rebind_is_an_instruction_that_runs(facts, frameworks, says):
    settings = loader_settings(DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4))
    code = loader_code({**facts, "settings": settings}, {"num_workers": 3}, {"frameworks": frameworks})
    assert says in code
    namespace: dict[str, Any] = {"args": type("Args", (), {})()}
    exec(code, namespace)  # raises nothing, and uses no name the user lacks


def test_expected_gain_shrinks_when_other_processes_hold_cores():
    from gpuwidget.advice.loader import diagnose

    workload = {"loaders": [loader_facts(wait=90.0, compute=10.0, wait_cpu=0.0, steps=10_000)]}
    alone = diagnose(summary(wait_fraction=0.9), workload, NO_GPU)
    # Others kept 4 of the 8 cores busy: start-up and hand-over take 1.5x as long.
    shared = diagnose(summary(wait_fraction=0.9, other_cpu_mean=400.0), workload, NO_GPU)
    assert alone is not None and shared is not None and shared.change == alone.change == {"num_workers": 11}
    assert shared.gain == pytest.approx(100_000 / (10_000 * 2.5 + 9 + 1.5 * 11 * 25), abs=0.01)
    assert shared.gain < alone.gain


def test_a_short_loop_gets_the_workers_that_pay_for_their_start_up():
    # 30 ms to read a batch, 5 ms to use it, 2 cores: 8 workers in steady state. Over 32 steps
    # (1.1 s, just long enough to name a cause) starting 8 workers (0.2 s) costs more than the
    # last three save: 5 do best.
    long_loop = {"loaders": [loader_facts(wait=300.0, compute=50.0, wait_cpu=0.05, steps=10_000)]}
    short_loop = {"loaders": [loader_facts(wait=0.96, compute=0.16, wait_cpu=0.05, steps=32)]}
    two_cores = {**NO_GPU, "usable_cpus": 2}
    assert io_bound.check(summary(), long_loop, two_cores).change["num_workers"] == 8
    short = io_bound.check(summary(), short_loop, two_cores)
    assert short.change["num_workers"] == 5
    assert short.expected_speedup == pytest.approx(1120 / (32 * 6 + 30 + 5 * 25), abs=0.01)


def _model_findings(name: str | None) -> dict[str, Any]:
    """One finding of each rule whose code acts on the model, for a model the user calls ``name``
    (None: no variable of theirs holds it, as inside a Trainer)."""
    stalls = [0.01] * 100
    for i in range(9, 100, 10):
        stalls[i] = 0.2
    loop = {"loaders": [loader_facts(step_times=stalls, compute=sum(stalls))]}
    on_cuda = {**cuda_model(), "name": name}
    parallel = {**on_cuda, "class": "DataParallel"}
    found = {
        "launch-bound": launch_bound.check(summary(busy=30.0, process=95.0), {**loop, "model": on_cuda}, H100),
        "gpu-unused": gpu_unused.check(summary(busy=0.0, process=100.0),
                                       {"model": {"name": name, "param_devices": ["cpu"]}}, H100),
        "fp32-math": fp32_math.check(summary(busy=80.0), {"model": on_cuda, "cuda": cuda((8, 0))}, H100),
        "gpu-imbalance": gpu_imbalance.check(
            summary(busy=90.0, gpus_used=[0, 1], gpus_unused_idle=[2, 3],
                    gpu_busy_by_gpu={"0": 92.0, "1": 88.0, "2": 0.0, "3": 0.0}), {"model": parallel}, H100),
        "periodic-stall": periodic_stall.check(summary(), {**loop, "model": on_cuda}, NO_GPU),
    }
    assert all(found.values()), {rule: finding is not None for rule, finding in found.items()}
    return found


@pytest.mark.parametrize("name", ["net", None])
def test_model_findings_code_runs_as_pasted_and_names_only_the_users_model(name, monkeypatch):
    import torch

    # The CPU build cannot move a module to CUDA; the findings only fire where a GPU is.
    moved: list[Any] = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, *args, **kwargs: moved.append(args) or module)
    legacy = torch.get_float32_matmul_precision()  # fp32-math's code sets it process-wide
    try:
        for rule, finding in _model_findings(name).items():
            user = torch.nn.DataParallel(torch.nn.Linear(2, 2)) if rule == "gpu-imbalance" else torch.nn.Linear(2, 2)
            namespace: dict[str, Any] = {} if name is None else {name: user}
            exec(compile(finding.code, f"<{rule} code>", "exec"), namespace)
            if name is None:
                assert "No variable of yours holds the model" in finding.code or rule in ("fp32-math",
                                                                                          "periodic-stall")
            elif rule in ("launch-bound", "gpu-imbalance"):
                assert namespace[name] is not user, f"{rule}: the user's name was not rebound"
    finally:
        torch.set_float32_matmul_precision(legacy)
    assert (moved == [("cuda",)]) is (name is not None)  # gpu-unused moved the user's model, once


# ------------------------------------------------------------------ periodic-stall: steady steps, periods, what it is


def stalled(steps: int, period: int, stall: float = 0.5, median: float = 0.0012, first: int | None = None,
            warmup: list[float] | None = None) -> list[float]:
    times = list(warmup or []) + [median] * steps
    start = len(warmup or []) + (period - 1 if first is None else first)
    for i in range(start, len(times), period):
        times[i] = stall
    return times


def stall_check(times: list[float], **workload: Any) -> Finding | None:
    return periodic_stall.check(summary(), {"loaders": [loader_facts(step_times=times, compute=sum(times),
                                                                     steps=len(times))], **workload}, NO_GPU)


def test_warm_up_steps_are_not_stalls_and_do_not_break_the_period():
    # 8 first steps of 18-28 ms (torch's own, on this machine) before a 0.5 s pause every 25 steps.
    warm = [0.028, 0.024, 0.021, 0.019, 0.018, 0.022, 0.020, 0.018]
    finding = stall_check(stalled(142, 25, warmup=warm))
    assert finding is not None and finding.evidence["period_steps"] == 25 and finding.evidence["stalls"] == 5
    assert finding.evidence["warmup_steps"] == 8 and finding.evidence["period_agreement"] == 1.0


def test_a_noisy_burst_is_not_a_period():
    times = [0.01] * 200
    for i in [*range(60, 76), 77, 80]:
        times[i] = 0.45
    assert stall_check(times) is None
    # Regular within the burst, but only there: not "every 2 steps" over a 200-step run.
    times = [0.01] * 200
    for i in range(60, 82, 2):
        times[i] = 0.45
    assert stall_check(times) is None
    # Consecutive slow steps are one stall: a 3-step evaluation every 20 steps is "every 20".
    times = [0.01] * 200
    for start in range(19, 200, 20):
        times[start:start + 3] = [0.3] * len(times[start:start + 3])
    finding = stall_check(times)
    assert finding is not None and finding.evidence["period_steps"] == 20 and finding.evidence["stalls"] == 10


@pytest.mark.parametrize(("stalls", "fires"), [(9, False), (10, True)])
def test_a_period_must_recur_over_the_run(stalls, fires):
    # Every 10 steps over 200 steady steps: at least PERIOD_COVERAGE (half) of the 20 stalls it puts there.
    times = [0.01] * 200
    for i in range(9, 9 + 10 * stalls, 10):
        times[i] = 0.2
    assert (stall_check(times) is not None) is fires


def test_gaps_agree_within_a_tenth_of_the_period():
    times = [0.01] * 200
    for i in (10, 34, 60, 85, 112, 136, 163, 187):  # gaps 24, 26, 25, 27, 24, 27, 24
        times[i] = 0.3
    assert stall_check(times).evidence["period_steps"] == 25  # the median of the agreeing gaps
    # Within one step is no slack for a period of 4: gaps 3, 4, 5 do not make "every 4".
    times = [0.01] * 60
    for i in (3, 6, 10, 15, 18, 22, 27, 30, 34, 39, 42, 46, 51, 54, 58):  # gaps 3, 4, 5 in turn
        times[i] = 0.3
    assert stall_check(times) is None


def test_spikes_of_a_loaded_host_beside_the_stalls_do_not_hide_the_period():
    times = stalled(150, 25, median=0.0006)
    for i in (5, 13, 31, 40, 66, 81, 97, 120, 133):  # 25-45 ms spikes beside 0.5 s stalls
        times[i] = 0.025 + 0.0025 * (i % 9)
    finding = stall_check(times)
    assert finding is not None and finding.evidence["period_steps"] == 25 and finding.evidence["stalls"] == 6
    # One spike between stalls leaves the period agreeing 67% of the time: the stalls alone agree
    # always, and the spike is not counted as a stall.
    times = stalled(150, 25, median=0.0006)
    times[61] = 0.03
    finding = stall_check(times)
    assert finding.evidence["stalls"] == 6 and finding.evidence["period_agreement"] == 1.0


def loop_waits(**seconds: float) -> list[dict[str, Any]]:
    files = {"generate": "transformers/generation/utils.py", "save": "torch/serialization.py",
             "train_step": "/home/me/samples/train.py"}
    return [{"function": function, "file": files[function], "line": 1, "cell": None, "share": 0.1,
             "seconds": value} for function, value in seconds.items()]


def test_a_stall_that_is_mostly_evaluation_gets_evaluation_code_that_runs():
    # 23 s of sampling with generate() and 0.08 s of torch.save, every 25 steps.
    finding = stall_check(stalled(150, 25), model=cuda_model(), loop_waits=loop_waits(generate=23.0, save=0.08))
    assert finding.change["stall"] == "evaluation" and finding.evidence["evaluation_s"] == 23.0
    assert "evaluation" in finding.suggestion and "save_in_background" not in finding.code
    assert "torch.inference_mode()" in finding.code
    net = torch.nn.Linear(4, 2)
    namespace: dict[str, Any] = {"net": net}
    exec(compile(finding.code, "<periodic-stall code>", "exec"), namespace)  # as pasted
    out = namespace["evaluate_without_grad"](net, net, torch.zeros(3, 4))
    assert out.shape == (3, 2) and not out.requires_grad and net.training


def test_a_stall_that_is_mostly_a_checkpoint_gets_the_background_save():
    finding = stall_check(stalled(150, 25), loop_waits=loop_waits(generate=0.2, save=9.0, train_step=3.0))
    assert finding.change["stall"] == "checkpoint" and "save_in_background" in finding.code
    namespace: dict[str, Any] = {}
    exec(compile(finding.code, "<periodic-stall code>", "exec"), namespace)
    assert callable(namespace["save_in_background"])


def test_without_stack_samples_forward_passes_without_grad_say_evaluation():
    times = stalled(150, 25)
    evaluating = stall_check(times, training={"forward_calls": 150 + 6 * 20, "eval_forwards": 120,
                                              "optimizer_steps": 150})
    assert evaluating.change["stall"] == "evaluation" and evaluating.evidence["eval_forwards"] == 120
    # Gradient accumulation's extra forwards are training forwards: no evaluation.
    unknown = stall_check(times, training={"forward_calls": 600, "eval_forwards": 0, "optimizer_steps": 150})
    assert unknown.change["stall"] == "unknown" and "a checkpoint, an evaluation" in unknown.suggestion
    # Every forward seen: one per stall is needed; seen in windows at ticks: one is enough.
    once = {"forward_calls": 151, "eval_forwards": 1, "optimizer_steps": 150}
    assert stall_check(times, training=once).change["stall"] == "unknown"
    assert stall_check(times, training={**once, "forwards_sampled": True}).change["stall"] == "evaluation"
    assert stall_check(times).change["stall"] == "unknown"
