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
from gpuwidget.advice.rules._ranks import (
    MIN_EXTRA_S,
    SIGNIFICANCE,
    binomial_tail,
    ddp_timings,
    median,
    step_series,
    worst,
)
from gpuwidget.advice.rules.rank_straggler import RELATIVE_SCORE
from gpuwidget.children.ranks import loop_figures
from gpuwidget.probes.torch_model import ddp_logging_facts

# Times real gloo ranks (who straggles): alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial

NO_GPU: dict[str, Any] = {"gpus": [], "usable_cpus": 2}
FOUR_GPUS: dict[str, Any] = {"gpus": [{"index": i, "name": "NVIDIA H100"} for i in range(4)], "usable_cpus": 32}
# The tiny-bucket model: a layer's weight and bias, (64 * 64 + 64) * 4 bytes, fill a bucket of 0.01 MB.
WIDTH, LAYERS = 64, 12  # 12 buckets all-reduced one by one: 44-55 % of a step left exposed here (36 took 2.6 s more)
TINY_BUCKET_STEPS = 510
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
    """One process's figures as the watch lists them in ``workload["ranks"]`` (its steps one by one too)."""
    return {"rank": rank, "local_rank": rank, "world_size": world, "pid": os.getpid(), "gpu": None,
            **loop_figures(run.workload), "loaders": run.workload["loaders"], "model": run.workload["model"]}


def train_ranks(rank: int, world: int, port: int, results: Any) -> None:
    """Each rank trains twice, watched by gpuwidget in its own process: (1) a DDP model whose buckets
    are far too small, (2) a small DDP model where rank 1's loader is slow."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        wide = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        model = torch.nn.parallel.DistributedDataParallel(wide, bucket_cap_mb=0.01)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        # 510 steps: DDP times iterations 1 to 10 (start-up) and every 100th, so steps 100 to 500
        # are the typical steps it timed (gpuwidget.advice.rules._ranks.typical_ddp_step)
        loader = DataLoader(TensorDataset(torch.randn(TINY_BUCKET_STEPS * 8, WIDTH)), batch_size=8)
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
        del model, small  # the model before its group: tests/gloo_job.py's fit() says why
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
    assert len(ddp["rebuilt_bucket_sizes"]) == LAYERS  # one (WIDTH x WIDTH + WIDTH) * 4 bytes layer per bucket
    assert all(size == (WIDTH * WIDTH + WIDTH) * 4 for size in ddp["rebuilt_bucket_sizes"])
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
    assert finding is not None and finding.rule == "ddp-communication", [
        (median(step_series(rank)[0]), ddp_timings(rank, typical_only=False), ddp_timings(rank))
        for rank in gloo_ranks["tiny_buckets"]]
    evidence = finding.evidence
    assert evidence["buckets"] == LAYERS and evidence["world_size"] == 2
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


def ddp_rank(rank: int, step_ms: float, exposed_ms: float, wait_fraction: float = 0.02,
             jitter: float = 0.02) -> dict[str, Any]:
    """A synthetic DDP rank: its steps one by one, and DDP's timings with ``exposed_ms`` of all-reduce
    after backward (in its average and its latest sample)."""
    ddp = {"world_size": 2, "rank": rank, "avg_backward_comm_time": int(exposed_ms * 1e6),
           "backward_comm_time": int(exposed_ms * 1e6), "avg_backward_compute_comm_overlap_time": 0,
           "avg_forward_compute_time": 1_000_000, "avg_backward_compute_time": 2_000_000,
           "bucket_cap_bytes": 25 * 2**20, "rebuilt_bucket_sizes": [4_000_000], "gradient_as_bucket_view": True,
           "static_graph": True}
    step_times = steps_around(step_ms / 1e3, jitter)
    return {**synthetic_rank(rank, step_ms, wait_fraction), "step_times": step_times,
            "wait_times": [wait_fraction * step for step in step_times], "model": {"name": "model", "ddp": ddp}}


@pytest.mark.parametrize(("jitter", "fires"), [(0.38, True), (0.42, False)])
def test_an_exposed_all_reduce_within_the_ranks_jitter_is_not_named(jitter, fires):
    # 1 ms of a 5 ms step (20%) waits for the all-reduce on both ranks. Steps whose MAD is 0.95 ms
    # (+-19% and +-38% around the median) cannot make that by skew alone; with a MAD of 1.05 ms they can.
    ranks = [ddp_rank(0, 5.0, 1.0, jitter=jitter), ddp_rank(1, 5.0, 1.0, jitter=jitter)]
    finding = ddp_communication.check({}, {"ranks": ranks}, NO_GPU)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["step_jitter_ms"] == pytest.approx(0.95, rel=0.01)


def test_the_seconds_ranks_wait_for_a_straggler_have_one_explanation():
    # Rank 1 waits 6 ms of each 10 ms step for its loader; rank 0 waits for it in the all-reduce (7 ms
    # exposed), rank 1 itself 3 ms. The straggler's 5.8 ms extra is rank-straggler's; ddp-communication
    # judges the straggler alone, and never for more than the step less that extra.
    ranks = [ddp_rank(0, 10.0, 7.0, wait_fraction=0.02), ddp_rank(1, 10.0, 6.0, wait_fraction=0.6)]
    straggler = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    communication = ddp_communication.check({}, {"ranks": ranks}, NO_GPU)
    assert straggler is not None and straggler.evidence["straggler"] == 1
    assert straggler.evidence["extra_ms"] == pytest.approx(5.8)
    assert communication is not None and communication.evidence["judged"] == "rank 1"
    assert communication.evidence["exposed_comm_ms"] == pytest.approx(10.0 - 5.8)
    claimed = straggler.evidence["extra_ms"] + communication.evidence["exposed_comm_ms"]
    assert claimed <= communication.evidence["step_time_ms"] + 1e-9


@pytest.fixture
def single_process_group():
    """A gloo group of one in this process, as a notebook that wraps its model in DDP has."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_probe_keeps_every_iteration_ddp_timed_through_a_long_watch(single_process_group):
    # The model probe's global hooks leave after its first calls; the DDP wrapper's own counter stays
    # and reads DDP's figures on its sampled iterations (1-10, then every 100th) until the watch ends.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(310):
            model(torch.randn(2, 4)).sum().backward()
    iterations = run.workload["model"]["ddp"]["iterations"]
    assert [sample["iteration"] for sample in iterations] == [*range(1, 11), 100, 200, 300]
    assert all(sample["backward_compute_time"] > 0 for sample in iterations)
    assert model._forward_pre_hooks == {}  # the watch removed its counter


def test_ddp_communication_judges_the_median_of_the_iterations_ddp_timed_after_start_up():
    def iteration(number: int, exposed_ms: float, compute_ms: float = 3.0) -> dict[str, int]:
        return {"iteration": number, "forward_compute_time": int(compute_ms * 1e6) // 3,
                "backward_compute_time": int(compute_ms * 1e6) * 2 // 3,
                "backward_comm_time": int(exposed_ms * 1e6), "backward_compute_comm_overlap_time": 0}

    ranks = [ddp_rank(rank, 10.0, 0.5, jitter=0.02) for rank in (0, 1)]  # average and latest: 0.5 ms, 5%
    assert ddp_communication.check({}, {"ranks": ranks}, NO_GPU) is None
    # Start-up iterations of 6 ms (the other rank still starting) do not count, nor a preempted one
    # (20 ms: longer than a typical step); the steady ones of 1.5, 3 and 4 ms do, and their median, 3 ms
    # of the 10 ms step, is named.
    for entry in ranks:
        entry["model"]["ddp"]["iterations"] = [*(iteration(n, 6.0) for n in range(1, 11)), iteration(100, 1.5),
                                               iteration(200, 20.0), iteration(300, 3.0), iteration(400, 4.0)]
    finding = ddp_communication.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None and finding.evidence["exposed_comm_ms"] == pytest.approx(3.0)
    # Two steady iterations are too few: DDP's average and latest figures are judged (5%: not named).
    for entry in ranks:
        del entry["model"]["ddp"]["iterations"][-2:]
    assert ddp_communication.check({}, {"ranks": ranks}, NO_GPU) is None


def test_the_last_rank_to_arrive_in_each_timed_iteration_shows_the_all_reduce_without_the_skew():
    def iteration(number: int, exposed_ms: float) -> dict[str, int]:
        return {"iteration": number, "forward_compute_time": 300_000, "backward_compute_time": 700_000,
                "backward_comm_time": int(exposed_ms * 1e6), "backward_compute_comm_overlap_time": 0}

    # Steps of 5 ms whose MAD is 2 ms: a loaded host, where a step that is mostly all-reduce is as
    # jittery as its all-reduce. Both ranks wait 1.5 to 2.2 ms in the same timed iterations: the last
    # to arrive waited for no one, so that is the transfer's time (median 1.8 ms, 36%), named although
    # it is under the jitter.
    ranks = [ddp_rank(rank, 5.0, 0.5, jitter=0.8) for rank in (0, 1)]
    for entry in ranks:
        entry["model"]["ddp"]["iterations"] = [iteration(100 * (n + 1), ms)
                                               for n, ms in enumerate([1.5, 2.2, 1.8, 1.6, 1.9])]
    finding = ddp_communication.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None
    assert finding.evidence["exposed_comm_ms"] == pytest.approx(1.8)
    assert finding.evidence["step_jitter_ms"] == pytest.approx(2.0) and finding.evidence["iterations_compared"] == 5
    assert "the last rank to arrive, in the median of 5 iterations DDP timed" in finding.suggestion
    # Skew alone: in each iteration one rank waits 3.5 ms for the other, which arrives late and waits
    # 0.2 ms for the transfer (4% of the step). Each rank's own median wait (3.5 ms) is skew: not named.
    for rank, entry in enumerate(ranks):
        entry["model"]["ddp"]["iterations"] = [iteration(100 * (n + 1), 3.5 if (n + rank) % 2 else 0.2)
                                               for n in range(5)]
    assert ddp_communication.check({}, {"ranks": ranks}, NO_GPU) is None


def test_an_all_reduce_timed_past_the_median_step_counts_for_the_step_less_its_compute():
    # Steps of 10 ms whose MAD is 0.95 ms; DDP timed 10.5 ms of all-reduce after 1 ms of compute on its
    # steady iterations (typical: within three MADs of the median step). A typical step waits at most
    # the step less that compute.
    ranks = [ddp_rank(rank, 10.0, 0.5, jitter=0.38) for rank in (0, 1)]
    for entry in ranks:
        entry["model"]["ddp"]["iterations"] = [
            {"iteration": n, "forward_compute_time": 300_000, "backward_compute_time": 700_000,
             "backward_comm_time": 10_500_000, "backward_compute_comm_overlap_time": 0} for n in (100, 200, 300)]
    finding = ddp_communication.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None
    assert finding.evidence["exposed_comm_ms"] == pytest.approx(finding.evidence["step_time_ms"] - 1.0)


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
    assert finding.title.startswith("Rank 1 is a straggler: it waits")
    # Its own loader waits a batch's worth of sleeps per step (4 x 2 ms); rank 0 hardly waits for data.
    assert finding.evidence["data_wait_ms"] >= 4 * SLOW_ITEM_S * 1e3 * 0.8
    assert finding.evidence["others_data_wait_ms"] < finding.evidence["data_wait_ms"] / 2
    assert finding.evidence["measured"] == "data wait" and finding.evidence["p_value"] < SIGNIFICANCE
    # The gain is bounded by the measured extra wait: the job's step less that.
    step = max(finding.evidence["step_time_ms_by_rank"].values())
    assert finding.expected_speedup == pytest.approx(step / (step - finding.evidence["extra_ms"]), rel=0.01)
    assert finding.expected_speedup > 1.5
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
    del model  # the model before its group: tests/gloo_job.py's fit() says why
    dist.destroy_process_group()


def test_a_watch_around_spawned_ranks_names_the_straggler():
    with gpuwidget.watch(display=False) as run:
        mp.spawn(ddp_rank_with_a_slow_loader, args=(2, free_port()), nprocs=2, join=True)
    assert sorted(entry["rank"] for entry in run.ranks) == [0, 1]
    assert all(entry["model"]["ddp"]["world_size"] == 2 for entry in run.workload["ranks"])
    finding = next(f for f in run.findings if f.rule == "rank-straggler")
    assert finding.evidence["straggler"] == 1 and finding.change["cause"] == "its data loader"
    assert finding.evidence["pid"] == next(entry["pid"] for entry in run.ranks if entry["rank"] == 1)


WARMUP = 11  # of the 101 synthetic steps the first are slow start-up steps (_ranks.steady leaves out 11)


def steps_around(step_s: float, jitter: float = 0.02) -> list[float]:
    """101 steps: WARMUP start-up steps three times as long, then 90 whose median is exactly ``step_s``
    (18 each at -2, -1, 0, +1 and +2 times ``jitter / 2`` of it)."""
    steady = [step_s * (1 + jitter / 2 * ((i % 5) - 2)) for i in range(90)]
    return [3 * step_s] * WARMUP + steady


def synthetic_rank(rank: int, step_ms: float, wait_fraction: float = 0.0, gpu: int | None = None,
                   run_delay: float | None = None) -> dict[str, Any]:
    step_times = steps_around(step_ms / 1e3)
    entry: dict[str, Any] = {"rank": rank, "pid": 1000 + rank, "gpu": gpu, "steps": len(step_times),
                             "step_time_p50_s": step_ms / 1e3, "data_wait_fraction": wait_fraction,
                             "step_times": step_times, "wait_times": [wait_fraction * step for step in step_times],
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
        assert finding.evidence["measured"] == "step time"
        assert finding.expected_speedup == pytest.approx(slow_ms / 10.0, rel=0.01)  # current / median step


def test_lockstep_ranks_charge_the_slowest_loaders_measured_wait():
    # All step 20 ms (they meet in an all-reduce); rank 2 waits 12 ms of it for data, the others 1 ms.
    ranks = [synthetic_rank(0, 20.0, 0.05), synthetic_rank(1, 20.1, 0.05), synthetic_rank(2, 20.0, 0.6)]
    finding = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    assert finding is not None and finding.evidence["straggler"] == 2 and finding.change["cause"] == "its data loader"
    assert finding.evidence["lockstep"] is True and finding.evidence["measured"] == "data wait"
    assert finding.evidence["extra_ms"] == pytest.approx(12.0 - 1.0025, abs=0.01)
    # Bounded by the measured extra wait: the job's step (the slowest rank's median) less it.
    assert finding.expected_speedup == pytest.approx(20.1 / (20.1 - 10.9975), rel=0.01)
    # Every one of its steady steps waited more than the others' median: p = 3 x 2^-90.
    assert finding.evidence["steps_above_others"] == 90 and finding.evidence["p_value"] < 1e-20


@pytest.mark.parametrize(("step_ms", "fires"), [(1.0, False), (2.0, True)])
def test_a_difference_under_a_millisecond_is_no_straggler_whatever_the_ratio(step_ms, fires):
    # Rank 2 waits 60% of each step for data against 5% on the others, on every steady step: on a
    # 1 ms step that is 0.55 ms more (under MIN_EXTRA_S), on a 2 ms step 1.1 ms (over it).
    ranks = [synthetic_rank(0, step_ms, 0.05), synthetic_rank(1, step_ms, 0.05), synthetic_rank(2, step_ms, 0.6)]
    extra_s = 0.55 * step_ms / 1e3
    assert (extra_s >= MIN_EXTRA_S) is fires
    finding = rank_straggler.check({}, {"ranks": ranks}, NO_GPU)
    assert (finding is not None) is fires


def test_equal_ranks_have_no_straggler():
    ranks = [synthetic_rank(0, 20.0, 0.1), synthetic_rank(1, 20.5, 0.12)]
    assert rank_straggler.check({}, {"ranks": ranks}, NO_GPU) is None
    assert rank_straggler.check({}, {"ranks": ranks[:1]}, NO_GPU) is None


def test_noisy_ranks_of_one_kind_are_no_straggler_however_far_apart_their_medians():
    """Two ranks whose data waits come from one two-peaked distribution (half the batches ready at
    once, half after 10 ms): a rank's median lands on either peak by chance, so the medians are often
    10 ms apart, yet the sign test across steps names no one in 200 seeded runs."""
    import random

    def noisy(rank: int, rng: random.Random) -> dict[str, Any]:
        waits = [(0.0001 if rng.random() < 0.5 else 0.010) + rng.uniform(0, 1e-4) for _ in range(120)]
        return {"rank": rank, "pid": 1000 + rank, "steps": 120, "step_time_p50_s": 0.02,
                "step_times": [0.02 + rng.uniform(-2e-4, 2e-4) for _ in range(120)], "wait_times": waits}

    named = apart = 0
    for seed in range(200):
        rng = random.Random(seed)
        ranks = [noisy(0, rng), noisy(1, rng)]
        compared = worst([rank["wait_times"][12:] for rank in ranks])
        apart += compared is not None and compared.extra_s >= 0.002  # over both noise floors
        named += rank_straggler.check({}, {"ranks": ranks}, NO_GPU) is not None
    assert apart >= 40  # medians alone would have named a straggler in these runs
    assert named == 0


def test_the_sign_test_is_exact_at_its_edges():
    assert binomial_tail(0, 10) == 1.0
    assert binomial_tail(10, 10) == 2 ** -10
    assert binomial_tail(9, 10) == 11 / 1024
    # 30 steps of which 25 above the others' median: p = 2 x P(X >= 25) = 2 x 174437 / 2^30 (about 3.2e-4).
    mine, theirs = [2.0] * 25 + [0.5] * 5, [1.0] * 30
    compared = worst([theirs, mine])
    assert compared is not None and compared.index == 1 and compared.above == 25
    assert compared.p_value == pytest.approx(2 * 174437 / 2**30)


def test_ddp_timings_name_a_compute_straggler_only_when_every_measure_agrees():
    """Lockstep ranks with equal data waits: DDP's own timings of forward and backward are the evidence.
    Its average over the sampled iterations includes the first ones, where a rank that started early
    also computed slower (caches, allocations); its latest sample must agree, and the others must have
    been measured waiting in the all-reduce at least as long."""
    def entry(rank: int, compute_ms: tuple[float, float], waited_ms: float) -> dict[str, Any]:
        ddp = {"avg_forward_compute_time": 0, "avg_backward_compute_time": int(compute_ms[0] * 1e6),
               "forward_compute_time": 0, "backward_compute_time": int(compute_ms[1] * 1e6),
               "avg_backward_comm_time": int(waited_ms * 1e6), "backward_comm_time": int(waited_ms * 1e6)}
        return {**synthetic_rank(rank, 10.0, 0.02), "model": {"ddp": ddp}}

    started_early = [entry(0, (6.0, 2.0), 0.3), entry(1, (2.0, 2.1), 4.0)]
    assert rank_straggler.check({}, {"ranks": started_early}, NO_GPU) is None
    nobody_waited = [entry(0, (6.0, 6.0), 0.3), entry(1, (2.0, 2.0), 0.3)]
    assert rank_straggler.check({}, {"ranks": nobody_waited}, NO_GPU) is None
    # DDP's figures of iterations far longer than the run's steps (a preempted one; start-up in the
    # average) describe no typical step: on a 5 ms step, 9.8 and 6.1 ms of compute are no evidence.
    atypical = [{**entry(0, (9.8, 6.1), 0.3), "step_times": steps_around(0.005)},
                {**entry(1, (0.5, 0.6), 9.4), "step_times": steps_around(0.005)}]
    for rank in atypical:
        rank["wait_times"] = [0.0] * len(rank["step_times"])
    assert rank_straggler.check({}, {"ranks": atypical}, NO_GPU) is None
    slower = [entry(0, (6.0, 5.8), 0.3), entry(1, (2.0, 2.1), 4.0)]
    finding = rank_straggler.check({}, {"ranks": slower}, NO_GPU)
    assert finding is not None and finding.evidence["straggler"] == 0
    assert finding.evidence["measured"] == "forward and backward (DDP)"
    assert finding.change["cause"] == "its own forward and backward"
    assert finding.evidence["extra_ms"] == pytest.approx(3.7)  # the smaller of the two differences
    assert finding.expected_speedup == pytest.approx(10.0 / (10.0 - 3.7), rel=0.01)
    exec(finding.code, {})


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
    from gpuwidget.figures.summary import summarize
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
                        f"gpu{index}.slowdown": 1.0 if index == 1 else 0.0,  # GPU 1 slowed down (thermal)
                        f"gpu{index}.power_capped": 0.0})
        trace.append(tick * 0.1, row)
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpu_throttle_fraction_by_gpu"] == {"0": 0.0, "1": 1.0}
    ranks = [synthetic_rank(0, 10.0, gpu=0), synthetic_rank(1, 15.5, gpu=1)]
    findings = {f.rule: f for f in advise(summary, {"model": None, "loaders": [], "ranks": ranks}, FOUR_GPUS)}
    straggler = findings["rank-straggler"]
    assert straggler.change == {"rank": 1, "cause": "its GPU 1 slowed its clocks"}
    assert findings["gpu-imbalance"].evidence["gpus_no_rank_used"] == [2, 3]


def test_a_stragglers_own_time_is_judged_by_its_typical_figures_when_its_average_is_start_up():
    """Rank 1 spends 9 ms of each 13 ms step outside the model's work (its stack samples), and rank 0
    waits for it in the all-reduce. Rank 1's DDP average is of the start-up, when it waited 12 ms for
    rank 0 to start: no typical step of its run. Its latest figure is, and names it (in CI, the
    average alone had kept the real torchrun straggler of tests/test_real_scripts.py unnamed)."""
    def entry(rank: int, average_ms: tuple[float, float], latest_ms: tuple[float, float]) -> dict[str, Any]:
        ddp = {"avg_forward_compute_time": 0, "avg_backward_compute_time": int(average_ms[0] * 1e6),
               "avg_backward_comm_time": int(average_ms[1] * 1e6),
               "forward_compute_time": 0, "backward_compute_time": int(latest_ms[0] * 1e6),
               "backward_comm_time": int(latest_ms[1] * 1e6)}
        return {**synthetic_rank(rank, 13.0), "model": {"ddp": ddp}}

    waiting, straggling = entry(0, (2.4, 10.6), (0.9, 11.0)), entry(1, (2.0, 12.0), (1.3, 0.8))
    assert [t.which for t in ddp_timings(straggling)] == ["latest"]  # its average: 14 ms of a 13 ms step
    assert rank_straggler.check({}, {"ranks": [waiting, straggling]}, NO_GPU) is None  # no stack evidence
    straggling["loop_waits"] = [{"function": "log_metrics", "file": "train.py", "line": 40, "share": 0.7}]
    finding = rank_straggler.check({}, {"ranks": [waiting, straggling]}, NO_GPU)
    assert finding is not None and finding.evidence["straggler"] == 1
    assert finding.evidence["measured"] == rank_straggler.OWN_TIME
    assert finding.evidence["own_ms_by_sample"] == {"latest": 12.2}
    assert finding.evidence["extra_ms"] == pytest.approx(12.2 - 2.0)  # its 12.2 ms against rank 0's 2.0
    assert "log_metrics" in finding.change["cause"]
