"""A watched DDP rank that frees its model after ``destroy_process_group()`` still exits.

With torch 2.13, every ``backward()`` leaves a Python object in the thread state that gloo's all-reduce
works copy, so whichever thread frees such a work takes the GIL. A DDP model that outlives
``destroy_process_group()`` holds its group's last reference; freed with the rank function's frame, it
joins gloo's worker threads with the GIL held while one of them waits for the GIL: the rank hangs at
its exit (gdb: ``~ProcessGroupGloo`` in ``thread.join``, ``~AsyncAllreduceWork`` in ``take_gil``).
Beside a busy core, two forked ranks of this shape without gpuwidget hung in 1 to 4 runs here.

A watched rank's agent holds the groups ``destroy_process_group()`` let go of until its exit hook,
and lets go of them from Python, whose binding releases the GIL before it joins the threads.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import gpuwidget

pytestmark = pytest.mark.slow

JOBS = 6
STEPS = 150
JOB_LIMIT_S = 60.0  # a job takes one to two seconds beside a neighbour


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_freeing_its_model_last(rank: int, world_size: int, port: int, results: Any) -> None:
    """torch's own DDP example's order: destroy the group, then the model goes with the function's frame."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpuwidget.children import agent as agent_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        loss = ((model(torch.randn(4, 4)) - torch.ones(4, 1)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    group = model.process_group
    dist.destroy_process_group()
    agent = agent_module._agent
    results.put((rank, any(held is group for held in getattr(agent, "_held_groups", ()))))


def test_a_watched_rank_that_frees_its_ddp_model_after_the_group_exits() -> None:
    import torch._dynamo  # noqa: F401 - DDP imports it on first use: seconds in every forked rank otherwise

    context = mp.get_context("fork")
    held = []
    for _ in range(JOBS):
        results = context.SimpleQueue()
        with gpuwidget.watch(display=False) as run:
            job = mp.start_processes(rank_freeing_its_model_last, args=(2, free_port(), results), nprocs=2,
                                     join=False, start_method="fork")
            deadline = time.monotonic() + JOB_LIMIT_S
            while not job.join(timeout=0.5):
                if time.monotonic() > deadline:
                    alive = [process.pid for process in job.processes if process.is_alive()]
                    for process in job.processes:
                        process.kill()
                    pytest.fail(f"ranks {alive} still ran {JOB_LIMIT_S} s after they started: hung at exit")
        held.extend(results.get() for _ in range(2))
        assert sorted(rank["steps"] for rank in run.ranks) == [STEPS, STEPS]
    # Every rank's agent held its group past destroy_process_group(), so the model's free was not the last.
    assert sorted(held) == sorted((rank, True) for _ in range(JOBS) for rank in (0, 1)), held
