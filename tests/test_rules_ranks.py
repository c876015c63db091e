"""Rules for many processes: rank-straggler, ddp-communication, data-parallel and gpu-imbalance's GPUs no
rank uses, on real gloo DDP ranks (CPU, torch.multiprocessing spawn), real nn.DataParallel on the CPU, and
synthetic rank figures at the thresholds' edges (and for the GPU-only causes: a throttled GPU)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpuwidget
from gpuwidget.advice.rules import data_parallel, ddp_communication, gpu_imbalance, rank_straggler
from gpuwidget.advice.rules.rank_straggler import RELATIVE_SCORE
from gpuwidget.probes.torch_model import ddp_logging_facts

# Times real gloo ranks (who straggles): alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

NO_GPU: dict[str, Any] = {"gpus": [], "usable_cpus": 2}
FOUR_GPUS: dict[str, Any] = {"gpus": [{"index": i, "name": "NVIDIA H100"} for i in range(4)], "usable_cpus": 32}
SLOW_ITEM_S = 0.002  # the straggler's loader: 2 ms per sample, 4 per batch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Items(Dataset):
    """Tensors; ``delay_s`` per item makes a slow loader (storage or decoding)."""

    def __init__(self, count: int, width: int, delay_s: float = 0.0) -> None:
        self.data = torch.randn(count, width)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[index]


def rank_entry(run: Any, rank: int, world: int) -> dict[str, Any]:
    """One process's figures as the watch lists them in ``workload["ranks"]``."""
    summary, workload = run.summary, run.workload
    return {"rank": rank, "local_rank": rank, "world_size": world, "pid": os.getpid(), "gpu": None,
            "steps": summary["steps"], "samples_per_s": summary["samples_per_s"],
            "data_wait_fraction": summary["data_wait_fraction"], "step_time_p50_s": summary["step_time_p50"],
            "step_time_p95_s": summary["step_time_p95"], "loaders": workload["loaders"], "model": workload["model"]}


def train_ranks(rank: int, world: int, port: int, results: Any) -> None:
    """Each rank trains twice, watched by gpuwidget in its own process: (1) a DDP model whose buckets
    are far too small, (2) a small DDP model where rank 1's loader is slow."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        wide = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(12)])
        model = torch.nn.parallel.DistributedDataParallel(wide, bucket_cap_mb=0.01)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(TensorDataset(torch.randn(1280, 128)), batch_size=32)
        with gpuwidget.watch(quiet=True) as tiny_buckets:
            for (x,) in loader:
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        small = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        optimizer = torch.optim.SGD(small.parameters(), lr=0.01)
        slow = DataLoader(Items(160, 16, SLOW_ITEM_S if rank == 1 else 0.0), batch_size=4)
        with gpuwidget.watch(quiet=True) as straggling:
            for x in slow:
                small(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        results.put((rank, rank_entry(tiny_buckets, rank, world), rank_entry(straggling, rank, world)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_ranks() -> dict[str, list[dict[str, Any]]]:
    """Two real gloo ranks (spawned, as torch.multiprocessing does in a notebook), their facts per phase."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(train_ranks, args=(2, free_port(), results), nprocs=2, start_method="spawn")
    entries = sorted((results.get() for _ in range(2)), key=lambda item: item[0])
    return {"tiny_buckets": [entry[1] for entry in entries], "straggling": [entry[2] for entry in entries]}


# ------------------------------------------------------------------ DDP facts


def test_ddp_facts_keep_torchs_numeric_fields_and_bucket_lists(gloo_ranks):
    ddp = gloo_ranks["tiny_buckets"][0]["model"]["ddp"]
    assert gloo_ranks["tiny_buckets"][0]["model"]["class"] == "DistributedDataParallel"
    assert ddp["world_size"] == 2 and ddp["rank"] == 0
    assert ddp["bucket_cap_bytes"] == int(0.01 * 2**20)
    assert len(ddp["rebuilt_bucket_sizes"]) == 12  # one (128x128 + 128) * 4 bytes layer per bucket
    assert all(size == (128 * 128 + 128) * 4 for size in ddp["rebuilt_bucket_sizes"])
    assert ddp["avg_backward_comm_time"] > 0 and ddp["avg_backward_compute_time"] > 0
    assert ddp["gradient_as_bucket_view"] is False and ddp["static_graph"] is False
    assert not any(key.endswith(("_start", "_end")) for key in ddp)
    assert all(isinstance(value, (int, float, bool, list)) for value in ddp.values())


def test_ddp_logging_facts_parse_torchs_strings():
    facts = ddp_logging_facts({"bucket_sizes": "100, 200", "gradient_as_bucket_view": 1, "master_addr": "h",
                               "forward_compute_time_start": 5, "avg_forward_compute_time": 7})
    assert facts == {"bucket_sizes": [100, 200], "gradient_as_bucket_view": True, "avg_forward_compute_time": 7}


# ------------------------------------------------------------------ ddp-communication


def test_tiny_ddp_buckets_are_named_with_the_bucket_cap_and_accumulation(gloo_ranks):
    workload = {"model": None, "loaders": [], "ranks": gloo_ranks["tiny_buckets"]}
    finding = ddp_communication.check({}, workload, NO_GPU)
    assert finding is not None and finding.rule == "ddp-communication"
    evidence = finding.evidence
    assert evidence["buckets"] == 12 and evidence["world_size"] == 2
    assert evidence["exposed_comm_share"] >= ddp_communication.EXPOSED_COMM_SHARE
    assert finding.change["bucket_cap_mb"] == 25 and finding.change["gradient_as_bucket_view"] is True
    assert finding.change["static_graph"] is True and finding.change["no_sync_accumulation_steps"] >= 2
    assert "bucket_cap_mb=25" in finding.suggestion and "no_sync()" in finding.suggestion
    step, exposed = evidence["step_time_ms"], evidence["exposed_comm_ms"]
    assert finding.expected_speedup == pytest.approx(step / (step - exposed), rel=0.02)


def test_ddp_communication_judges_the_rank_that_waited_least():
    def entry(rank: int, comm_ms: float) -> dict[str, Any]:
        ddp = {"world_size": 2, "rank": rank, "avg_backward_comm_time": int(comm_ms * 1e6),
               "avg_backward_compute_comm_overlap_time": 0, "avg_forward_compute_time": 1_000_000,
               "avg_backward_compute_time": 2_000_000, "bucket_cap_bytes": 25 * 2**20,
               "rebuilt_bucket_sizes": [4_000_000], "gradient_as_bucket_view": True, "static_graph": True}
        return {"rank": rank, "steps": 50, "step_time_p50_s": 0.010, "model": {"name": "model", "ddp": ddp}}

    # Rank 0 waited 5 ms for a straggler; rank 1 (the straggler) paid only 0.9 ms of transfer: 9% < 10%.
    assert ddp_communication.check({}, {"ranks": [entry(0, 5.0), entry(1, 0.9)]}, NO_GPU) is None
    finding = ddp_communication.check({}, {"ranks": [entry(0, 5.0), entry(1, 1.0)]}, NO_GPU)
    assert finding is not None and finding.evidence["judged"] == "rank 1"
    assert "bucket_cap_mb" not in finding.change  # buckets already at the default
    # Every DDP setting is already as advised: the code is the accumulation pattern only, no re-wrap.
    assert set(finding.change) == {"no_sync_accumulation_steps"}
    assert all(line.startswith("#") for line in finding.code.splitlines())
    exec(finding.code, {})


@pytest.fixture
def single_process_group():
    """A gloo group of one in this process, as a notebook that wraps its model in DDP has."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_communication_code_runs_as_pasted_and_rewraps_the_users_model(single_process_group):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
    ddp = {"world_size": 1, "avg_backward_comm_time": 4_000_000, "avg_backward_compute_comm_overlap_time": 0,
           "avg_forward_compute_time": 1_000_000, "avg_backward_compute_time": 1_000_000,
           "bucket_cap_bytes": 104, "rebuilt_bucket_sizes": [288, 40], "total_parameter_size_bytes": 328}
    finding = ddp_communication.check({"step_time_p50": 0.008}, {"model": {"name": "model", "ddp": ddp}}, NO_GPU)
    assert finding is not None
    namespace = {"model": model}
    exec(finding.code, namespace)
    rewrapped = namespace["model"]
    assert rewrapped is not model and rewrapped.module is net
    assert rewrapped.bucket_bytes_cap == 25 * 2**20 and rewrapped.gradient_as_bucket_view
    assert rewrapped.static_graph
    assert "With a world size of 1 there is no other rank" in finding.suggestion
    rewrapped(torch.randn(4, 8)).sum().backward()  # it trains
    assert net[0].weight.grad is not None
    unnamed = ddp_communication.check({"step_time_p50": 0.008}, {"model": {"name": None, "ddp": ddp}}, NO_GPU)
    assert unnamed is not None
    exec(unnamed.code, {})  # only the import and comments: nothing to rebind, nothing raises
    assert unnamed.code.count("\n# model = DistributedDataParallel(model.module") == 1


# ------------------------------------------------------------------ rank-straggler


def test_a_rank_with_a_slow_loader_is_named_as_the_straggler(gloo_ranks):
    ranks = gloo_ranks["straggling"]
    finding = rank_straggler.check({}, {"model": None, "loaders": [], "ranks": ranks}, NO_GPU)
    assert finding is not None and finding.rule == "rank-straggler", ranks
    assert finding.evidence["straggler"] == 1 and finding.change == {"rank": 1, "cause": "its data loader"}
    assert finding.title.startswith("Rank 1 is a straggler")
    # Its own loader waits a batch's worth of sleeps per step (4 x 2 ms); rank 0 hardly waits for data.
    assert finding.evidence["data_wait_ms"] >= 4 * SLOW_ITEM_S * 1e3 * 0.8
    assert finding.evidence["others_data_wait_ms"] < finding.evidence["data_wait_ms"] / 2
    assert finding.evidence["relative_score"] < RELATIVE_SCORE
    assert finding.expected_speedup is not None and finding.expected_speedup > 1.5
    exec(finding.code, {})  # instructions only: they raise nothing


def ddp_rank_with_a_slow_loader(rank: int, world: int, port: int) -> None:
    """A plain DDP rank, unaware of gpuwidget: the watch around torch.multiprocessing reaches it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in DataLoader(Items(160, 16, SLOW_ITEM_S if rank == 1 else 0.0), batch_size=4):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def test_a_watch_around_spawned_ranks_names_the_straggler():
    with gpuwidget.watch(display=False) as run:
        mp.spawn(ddp_rank_with_a_slow_loader, args=(2, free_port()), nprocs=2, join=True)
    assert sorted(entry["rank"] for entry in run.ranks) == [0, 1]
    assert all(entry["model"]["ddp"]["world_size"] == 2 for entry in run.workload["ranks"])
    finding = next(f for f in run.findings if f.rule == "rank-straggler")
    assert finding.evidence["straggler"] == 1 and finding.change["cause"] == "its data loader"
    assert finding.evidence["pid"] == next(entry["pid"] for entry in run.ranks if entry["rank"] == 1)


def synthetic_rank(rank: int, step_ms: float, wait_fraction: float = 0.0, gpu: int | None = None,
                   run_delay: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "pid": 1000 + rank, "gpu": gpu, "steps": 100,
                             "step_time_p50_s": step_ms / 1e3, "data_wait_fraction": wait_fraction,
                             "loaders": [{"name": "loader", "settings": {"num_workers": 2}}], "model": {}}
    if run_delay is not None:
        entry["host"] = {"run_delay_fraction": run_delay}
    return entry


@pytest.mark.parametrize(("slow_ms", "fires"), [(10 / RELATIVE_SCORE * 0.999, False),
                                                (10 / RELATIVE_SCORE * 1.01, True)])
def test_unsynchronised_ranks_compare_their_step_times_at_the_threshold(slow_ms, fires):
    ranks = [synthetic_rank(0, 10.0), synthetic_rank(1, 10.2), synthetic_rank(2, 9.9), synthetic_rank(3, slow_ms)]
    finding = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["straggler"] == 3 and finding.evidence["lockstep"] is False
        assert finding.expected_speedup == pytest.approx(slow_ms / 10.0, rel=0.01)  # current / median step


def test_lockstep_ranks_without_ddp_data_charge_the_slowest_loaders_wait():
    # All step 20 ms (they meet in an all-reduce); rank 2 waits 12 ms of it for data, the others 1 ms.
    ranks = [synthetic_rank(0, 20.0, 0.05), synthetic_rank(1, 20.1, 0.05), synthetic_rank(2, 20.0, 0.6)]
    finding = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None and finding.evidence["straggler"] == 2 and finding.change["cause"] == "its data loader"
    assert finding.evidence["lockstep"] is True
    assert finding.expected_speedup == pytest.approx(20.1 / (20.1 - 11.0), rel=0.02)


def test_waiting_for_the_others_to_start_is_not_straggling():
    """DDP's averages include the first iterations, where rank 0 also waited for rank 1's process to
    start; its latest sample (iteration 10 on) shows both ranks waiting alike."""
    def entry(rank: int, avg_comm_ms: float, latest_comm_ms: float) -> dict[str, Any]:
        ddp = {"avg_backward_comm_time": int(avg_comm_ms * 1e6), "avg_backward_compute_comm_overlap_time": 0,
               "backward_comm_time": int(latest_comm_ms * 1e6), "backward_compute_comm_overlap_time": 0}
        return {**synthetic_rank(rank, 4.0), "model": {"ddp": ddp}}

    ranks = [entry(0, 30.0, 1.0), entry(1, 1.1, 1.0)]
    assert rank_straggler.check({}, {"ranks": ranks}, NO_GPU) is None
    late = [entry(0, 30.0, 3.0), entry(1, 1.1, 0.2)]  # rank 0 still waits 3 ms a step: rank 1 lags
    finding = rank_straggler.check({}, {"ranks": late}, NO_GPU)
    assert finding is not None and finding.evidence["straggler"] == 1
    assert finding.evidence["own_time_ms_by_rank"] == {"rank 0": 1.0, "rank 1": 3.8}


def test_a_fraction_of_a_millisecond_is_no_straggler_whatever_the_ratio():
    ranks = [synthetic_rank(0, 1.0), synthetic_rank(1, 1.0), synthetic_rank(2, 1.09)]
    for rank in ranks:  # all in lockstep on a 1 ms step, DDP's wait leaving 0.05 ms own work on two
        rank["model"] = {"ddp": {"avg_backward_comm_time": 950_000 if rank["rank"] < 2 else 1_000_000}}
    # 0.04 ms more than the others: under 10% of its step.
    assert rank_straggler.check({}, {"ranks": ranks}, NO_GPU) is None


def test_equal_ranks_have_no_straggler():
    ranks = [synthetic_rank(0, 20.0, 0.1), synthetic_rank(1, 20.5, 0.12)]
    assert rank_straggler.check({}, {"ranks": ranks}, NO_GPU) is None
    assert rank_straggler.check({}, {"ranks": ranks[:1]}, NO_GPU) is None


def test_a_straggler_on_a_throttled_gpu_is_blamed_on_its_gpu():
    ranks = [synthetic_rank(0, 10.0, gpu=0), synthetic_rank(1, 10.0, gpu=1), synthetic_rank(2, 16.0, gpu=2)]
    summary = {"gpu_busy_mean": 90.0, "gpu_throttle_fraction_by_gpu": {"0": 0.0, "1": 0.0, "2": 0.45}}
    finding = rank_straggler.check(summary, {"ranks": ranks}, FOUR_GPUS)
    assert finding is not None and finding.change["cause"] == "its GPU 2 slowed its clocks"
    assert finding.evidence["gpu_throttle_fraction"] == 0.45 and "CUDA_VISIBLE_DEVICES" in finding.suggestion
    exec(finding.code, {})


def test_a_straggler_whose_process_waited_for_a_core_is_blamed_on_its_host():
    ranks = [synthetic_rank(0, 10.0, run_delay=0.01), synthetic_rank(1, 10.0, run_delay=0.02),
             synthetic_rank(2, 16.0, run_delay=0.3)]
    finding = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None and finding.change["cause"] == "its host process waited for a CPU"
    assert finding.evidence["run_delay_fraction"] == 0.3
    exec(finding.code, {})
    unexplained = rank_straggler.check({}, {"ranks": ranks[:2] + [synthetic_rank(2, 16.0)]}, NO_GPU)
    assert unexplained is not None and unexplained.change["cause"] == "cause not measured"
    exec(unexplained.code, {})


# ------------------------------------------------------------------ data-parallel


def test_data_parallel_on_the_cpu_is_seen_and_named_with_the_launcher_line():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model = torch.nn.DataParallel(net)  # without CUDA it runs the module as it is
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)
    with gpuwidget.watch(quiet=True) as run:
        for (x,) in loader:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    facts = run.workload["model"]
    assert facts["name"] == "model" and facts["class"] == "DataParallel" and facts["data_parallel"] is True
    finding = next(f for f in run.findings if f.rule == "data-parallel")
    assert "torchrun --nproc_per_node=gpu train.py" in finding.code  # no GPU here: torchrun's own "gpu"
    assert "DistributedDataParallel(model.module.to(local_rank)" in finding.code
    assert finding.expected_speedup is None  # no GPU measured, no bound
    namespace = {"model": model}
    exec(finding.code, namespace)
    assert namespace["model"] is model


def test_data_parallel_on_four_gpus_gives_the_process_count_and_a_bound():
    summary = {"gpu_busy_mean": 50.0, "gpus_used": [0, 1, 2, 3],
               "gpu_busy_by_gpu": {"0": 80.0, "1": 40.0, "2": 40.0, "3": 40.0}}
    workload = {"model": {"name": "net", "class": "DataParallel", "data_parallel": True, "data_parallel_gpus": 4}}
    finding = data_parallel.check(summary, workload, FOUR_GPUS)
    assert finding is not None and finding.change["nproc_per_node"] == "4"
    assert "torchrun --nproc_per_node=4 train.py" in finding.code
    assert "notebook_launcher(train, num_processes=4)" in finding.code
    assert finding.expected_speedup == 2.0  # the GPUs were 50% busy: at most twice the throughput
    exec(finding.code, {})
    assert data_parallel.check(summary, {"model": {"name": "net", "class": "Net"}}, FOUR_GPUS) is None
    # DataParallel given two of the four GPUs: the launcher line still starts one process per visible GPU.
    two = {"model": {**workload["model"], "data_parallel_gpus": 2}}
    finding = data_parallel.check(summary, two, FOUR_GPUS)
    assert finding is not None and "torchrun --nproc_per_node=4 train.py" in finding.code


# ------------------------------------------------------------------ gpu-imbalance: GPUs no rank uses


def test_gpus_no_rank_uses_are_named():
    ranks = [synthetic_rank(0, 10.0, gpu=0), synthetic_rank(1, 10.0, gpu=1)]
    summary = {"gpu_busy_mean": 90.0, "gpus_used": [0, 1], "gpus_unused_idle": [2, 3],
               "gpu_busy_by_gpu": {"0": 91.0, "1": 89.0, "2": 0.0, "3": 1.0}}
    finding = gpu_imbalance.check(summary, {"model": None, "ranks": ranks}, FOUR_GPUS)
    assert finding is not None and finding.evidence["gpus_no_rank_used"] == [2, 3]
    assert finding.code == "# one process per GPU: torchrun --nproc_per_node=4 train.py"
    assert finding.expected_speedup == 2.0
    exec(finding.code, {})
    # A GPU busy with someone else's work is not idle: only GPU 3 is named.
    summary["gpu_busy_by_gpu"]["2"] = 70.0
    finding = gpu_imbalance.check(summary, {"model": None, "ranks": ranks}, FOUR_GPUS)
    assert finding is not None and finding.evidence["gpus_no_rank_used"] == [3]
    # One process is not a multi-rank run: its idle neighbours are the summary's note, not a finding.
    assert gpu_imbalance.check(summary, {"model": None, "ranks": ranks[:1]}, FOUR_GPUS) is None


def test_from_a_four_gpu_trace_the_throttled_ranks_gpu_and_the_gpus_no_rank_used_are_named():
    """The summary's own per-GPU figures from NVML columns (GPU 1 slowed by heat while busy, GPUs 2
    and 3 idle) and two ranks on GPUs 0 and 1, the one on GPU 1 slower: the whole advisor."""
    from gpuwidget.advice.advisor import advise
    from gpuwidget.advice.summary import summarize
    from gpuwidget.trace import Trace

    gib = 2**30
    trace = Trace()
    for tick in range(40):
        row: dict[str, float] = {"cpu.util": 20.0}
        for index in range(4):
            busy = index < 2
            row.update({f"gpu{index}.util": 95.0 if busy else 0.0, f"gpu{index}.mem_total": 80 * gib,
                        f"gpu{index}.mem_used": 30 * gib if busy else 0.5 * gib,
                        f"gpu{index}.proc_mem": 30 * gib if busy else 0.0,
                        f"gpu{index}.sm_clock_max": 1.98e9,
                        f"gpu{index}.sm_clock": 1.2e9 if index == 1 else 1.98e9,
                        f"gpu{index}.clock_events": 0x20 if index == 1 else 0.0})  # 0x20: thermal slowdown
        trace.append(tick * 0.1, row)
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpu_throttle_fraction_by_gpu"] == {"0": 0.0, "1": 1.0}
    ranks = [synthetic_rank(0, 10.0, gpu=0), synthetic_rank(1, 15.5, gpu=1)]
    findings = {f.rule: f for f in advise(summary, {"model": None, "loaders": [], "ranks": ranks}, FOUR_GPUS)}
    straggler = findings["rank-straggler"]
    assert straggler.change == {"rank": 1, "cause": "its GPU 1 slowed its clocks"}
    assert findings["gpu-imbalance"].evidence["gpus_no_rank_used"] == [2, 3]
