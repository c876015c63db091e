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
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        dataset = Items(4 * steps * world_size, delay_s if rank == slow_rank else 0.0)
        loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, world_size, rank))
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in loader:
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()
