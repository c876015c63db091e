"""Small real torch training workloads with known causes, for tests and benchmarks (CPU, seconds each).

Each builder returns a :class:`Workload`: a DataLoader bound to a name, a model, and a
``train(loader)`` function that runs one epoch the way a user's cell would.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


def burn(seconds: float) -> None:
    """CPU work in Python (holds the GIL, as a PIL decode or augmentation does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class CpuHeavyDataset(Dataset):
    """Each item costs ``cost`` seconds of CPU (a decode plus augmentations)."""

    def __init__(self, n: int, cost: float, features: int = 256) -> None:
        self.n, self.cost = n, cost
        self.data = torch.randn(n, features)
        self.labels = torch.randint(0, 10, (n,))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        burn(self.cost)
        return self.data[i], self.labels[i]


class SlowStorageDataset(CpuHeavyDataset):
    """Each item waits ``latency`` seconds on "storage" (a network filesystem read)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.cost)
        return self.data[i], self.labels[i]


class FirstTouchDataset(TensorDataset):
    """In-memory tensors whose first ``slow_items`` reads each wait ``latency`` seconds: a
    memory-mapped file paged in on first touch, or a cache filled by the first batches."""

    def __init__(self, *tensors: torch.Tensor, slow_items: int = 0, latency: float = 0.0) -> None:
        super().__init__(*tensors)
        self.slow_items, self.latency, self.reads = slow_items, latency, 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        self.reads += 1
        if self.reads <= self.slow_items:
            time.sleep(self.latency)
        return super().__getitem__(i)


OPEN_S = 0.2


def open_slowly(worker_id: int) -> None:
    """A loader's ``worker_init_fn`` that opens its data first: a file, a shard index, a connection."""
    time.sleep(OPEN_S)


def mlp(features: int = 256, hidden: int = 1024, layers: int = 3) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    width = features
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*blocks)


@dataclass
class Workload:
    name: str
    loader: DataLoader
    model: torch.nn.Module
    train: Callable[[DataLoader], None]
    namespace: dict[str, Any] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)


def _trainer(model: torch.nn.Module, every: int = 0, pause: Callable[[], None] | None = None,
             fail_at: int | None = None) -> Callable[[DataLoader], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(loader: DataLoader) -> None:
        for step, (x, y) in enumerate(loader):
            if fail_at is not None and step == fail_at:
                raise FloatingPointError(f"loss is nan at step {step}")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if every and pause is not None and step % every == every - 1:
                pause()

    return train


def _bind(name: str, loader: DataLoader, model: torch.nn.Module, train: Callable[[DataLoader], None],
          expected: set[str]) -> Workload:
    namespace = {"train_loader": loader, "train_ds": loader.dataset, "model": model}
    return Workload(name, loader, model, train, namespace, expected)


def cpu_heavy_transform(items: int = 480, cost: float = 0.0025, batch: int = 16) -> Workload:
    """The main process decodes every sample itself (num_workers=0): starved, CPU work."""
    model = mlp()
    loader = DataLoader(CpuHeavyDataset(items, cost), batch_size=batch, shuffle=True)
    return _bind("cpu-heavy transform, num_workers=0", loader, model, _trainer(model), {"dataloader-starved"})


def slow_storage(items: int = 480, latency: float = 0.003, batch: int = 16) -> Workload:
    """Every item waits on storage: starved while the process sleeps."""
    model = mlp(layers=2)
    loader = DataLoader(SlowStorageDataset(items, latency), batch_size=batch, shuffle=True)
    return _bind("storage-bound dataset", loader, model, _trainer(model), {"io-bound"})


def healthy(items: int = 2048, batch: int = 64) -> Workload:
    """In-memory tensors and a compute-heavy model: the loader keeps up."""
    model = mlp(hidden=2048, layers=3)
    data = TensorDataset(torch.randn(items, 256), torch.randint(0, 10, (items,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    return _bind("healthy in-memory loop", loader, model, _trainer(model), set())


def periodic_checkpoint(items: int = 3200, batch: int = 32, every: int = 10, pause_s: float = 0.12) -> Workload:
    """A healthy loop that saves a checkpoint every ``every`` steps, synchronously: 100 steps and 10
    stalls by default, 1.2 s of them, past the evidence a loop cause needs (advice.evidence: 16 steady
    steps lasting 1 s) however fast the steps between them are."""
    model = mlp(hidden=512, layers=2)
    data = TensorDataset(torch.randn(items, 256), torch.randint(0, 10, (items,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True)

    def checkpoint() -> None:
        torch.save(model.state_dict(), io.BytesIO())
        time.sleep(pause_s)  # the slow part: a network filesystem write

    return _bind("checkpoint every 10 steps", loader, model, _trainer(model, every, checkpoint),
                 {"periodic-stall"})


def failing(items: int = 640, batch: int = 16, fail_at: int = 5) -> Workload:
    model = mlp(layers=1)
    loader = DataLoader(CpuHeavyDataset(items, 0.001), batch_size=batch)
    return _bind("exception mid-loop", loader, model, _trainer(model, fail_at=fail_at), set())


def periodic_pause(items: int = 4800, batch: int = 32, every: int = 25, pause_s: float = 0.5,
                   warm_batches: int = 8, warm_batch_s: float = 0.05) -> Workload:
    """A pause of ``pause_s`` every ``every`` steps over in-memory tensors, after a slow start:
    the first ``warm_batches`` batches are read from a cold cache (``warm_batch_s`` each)."""
    model = mlp(features=64, hidden=128, layers=2)
    data = FirstTouchDataset(torch.randn(items, 64), torch.randint(0, 10, (items,)),
                             slow_items=warm_batches * batch, latency=warm_batch_s / batch)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    return _bind(f"a {pause_s} s pause every {every} steps after a slow start", loader, model,
                 _trainer(model, every, lambda: time.sleep(pause_s)), {"periodic-stall"})
