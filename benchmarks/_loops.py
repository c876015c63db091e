"""The training loops the overhead benchmarks watch: issue 23's 0.3 ms loop and section 1's 1.4 ms loop.

Both are CPU loops on one torch thread with an in-memory ``TensorDataset`` behind a ``DataLoader``
(``num_workers=0``): almost all Python and torch dispatch, the worst case for anything that takes
the GIL or adds work per step.

* ``fast``: batch 8, an MLP 256-128-10, SGD; about 0.3 ms a step on a quiet 2-vCPU VM.
* ``python``: batch 32, 6 x Linear+LayerNorm+ReLU (64 wide), AdamW with ``foreach=False``;
  about 1.4 ms a step.

``make_loop(name)`` returns ``run(steps) -> (wall s, process CPU s)``; each run takes a fresh
iterator per epoch, as a training loop does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LOOPS = ("fast", "python")
DESCRIPTIONS = {
    "fast": "batch 8, MLP 256-128-10, SGD (issue 23's 0.3 ms loop)",
    "python": "batch 32, 6 x Linear+LayerNorm+ReLU, AdamW foreach=False (the 1.4 ms loop)",
}

Loop = Callable[[int], tuple[float, float]]


def make_loop(name: str = "python") -> Loop:
    """A training loop of CPU steps; returns run(steps) -> (wall s, process CPU s of all threads)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "fast":
        inputs, batch = torch.randn(4096, 256), 8
        model: nn.Module = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    elif name == "python":
        inputs, batch = torch.randn(4096, 32), 32
        layers: list[nn.Module] = []
        for i in range(6):
            layers += [nn.Linear(32 if i == 0 else 64, 64), nn.LayerNorm(64), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(64, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    else:
        raise ValueError(f"no loop {name!r}: {LOOPS}")
    labels = torch.randint(0, 10, (len(inputs),))
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=batch, shuffle=True, num_workers=0)
    loss_fn = nn.CrossEntropyLoss()

    def run(steps: int) -> tuple[float, float]:
        done = 0
        cpu = time.process_time()
        started = time.perf_counter()
        while done < steps:
            for x, y in loader:  # a new iterator per epoch
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                done += 1
                if done >= steps:
                    break
        return time.perf_counter() - started, time.process_time() - cpu

    return run
