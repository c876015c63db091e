"""A small DDP job on gloo that a watched kernel cell spawns (importable by spawned children: torch only)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    """Small tensors; ``delay_s`` of sleep per item makes a slow loader."""

    def __init__(self, count: int, delay_s: float) -> None:
        self.count, self.delay_s = count, delay_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.full((4,), float(index)), torch.ones(1)


def slow_loader_rank(rank: int, world_size: int, port: int, steps: int, slow_rank: int, delay_s: float) -> None:
    """One DDP rank: ``steps`` batches of 4; ``slow_rank``'s loader sleeps ``delay_s`` per item."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fit(rank, world_size, steps, delay_s if rank == slow_rank else 0.0)
    finally:
        dist.destroy_process_group()


def fit(rank: int, world_size: int, steps: int, delay_s: float) -> None:
    """The rank's training, in a function of its own: its DDP model is gone before the process group.

    With torch 2.13 every ``backward()`` leaves a Python object in the thread state that gloo's
    all-reduce works copy, and a work freed on gloo's thread takes the GIL. A model that outlives
    ``destroy_process_group()`` holds the group's last reference, and freeing it joins gloo's threads
    with the GIL held: the rank hangs now and then (gdb: ``~ProcessGroupGloo`` in ``thread.join`` and
    ``~AsyncAllreduceWork`` in ``take_gil``). Freed from Python, the group lets go of the GIL first.
    """
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    dataset = Items(4 * steps * world_size, delay_s)
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, world_size, rank))
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
