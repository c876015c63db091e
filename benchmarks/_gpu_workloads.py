"""Training loops whose cause of GPU idle time is known, and what the advisor must say about each.

``EXPECTED`` is the one table of truth: ``benchmarks/gpu_check.py`` judges the runs it records on
a GPU with it, and ``tests/test_gpu_fixtures.py`` judges the same runs again, replayed from their
fixtures, with it. :func:`judge_rules` is the verdict both use.

Each loop is built so that no other rule's condition hides the expected one:

* ``launch_bound``: a step of ~1000 tiny elementwise kernels on a 64x64 tensor, data made on the GPU
  and no DataLoader (no data wait at all), parameters in bfloat16 (fp32-math has nothing to say
  about a model without matrix math). The host is pegged launching, the SMs idle.
* ``small_batch``: batches of 8 through a small MLP under bfloat16 autocast (fp32-math stays
  silent), from a DataLoader whose dataset already lives
  on the GPU and hands out each batch as one slice (``__getitems__``), no workers: the wait per
  batch is the loader's own bookkeeping, far under the 10% that turns small-batch and
  launch-bound off. Each step ends waiting on a *blocking* CUDA event, as a loop that logs its
  loss does. On an H200 the host is pegged all the same (SMs active 3%, the process at 98% of a
  core: the GPU ends each step's kernels before Python has launched the next), so small-batch
  must name the cause with a pegged host, and pageable-transfer must see there is nothing to pin.
* ``fp32_math``: 4096-wide linear layers in float32 at batch 1024 with TF32 explicitly off, data
  on the GPU: the SMs are busy (no small-batch, no launch-bound) on the FP32 units.
* ``dataloader_starved``: a dataset that spends 1 ms of CPU per sample in the main process
  (num_workers=0), a bfloat16 model (so fp32-math stays silent): the loop waits for data nearly
  all the time, and no GPU rule may claim the idle GPU.
* ``bf16_matmul``: four 8192x8192 bfloat16 linear layers at batch 8192, data on the GPU: nothing
  to find, and the achieved FLOP/s must come close to the measured bf16 matmul peak.

Four have a change that must pay (samples/s after over before): a CUDA graph of the same step,
batch 512, bfloat16 autocast, worker processes from the finding's own change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Rules about the GPU side of a run: none of them may claim a GPU that idles for want of data.
GPU_RULES = frozenset({"small-batch", "memory-pressure", "fp32-math", "launch-bound", "pageable-transfer",
                       "gpu-throttled", "gpu-unused", "gpu-imbalance"})


@dataclass(frozen=True)
class Expectation:
    """What the advisor must say about one workload: the rules that must fire and those that must not.

    ``none_at_all``: no finding of any rule (a loop with nothing to improve).
    """

    fires: frozenset[str] = frozenset()
    forbids: frozenset[str] = frozenset()
    none_at_all: bool = False
    # The change that must pay, and by how much (samples/s after over before); None: no change tried.
    change: str | None = None
    min_gain: float = 1.0
    why: str = ""


EXPECTED: dict[str, Expectation] = {
    "launch_bound": Expectation(
        fires=frozenset({"launch-bound"}), forbids=frozenset({"small-batch", "fp32-math", "dataloader-starved"}),
        change="the same step replayed as one CUDA graph", min_gain=2.0,
        why="~1000 tiny kernels per step: the host is pegged launching them while the SMs idle"),
    "small_batch": Expectation(
        fires=frozenset({"small-batch"}),
        forbids=frozenset({"launch-bound", "dataloader-starved", "pageable-transfer"}),
        change="batch 512", min_gain=2.0,
        why="batches of 8 leave the SMs idle, not for want of data: on a fast GPU the host is pegged "
            "launching each step's kernels too, and the batch is still the lever (launch-bound stands aside); "
            "the data is already on the GPU, so there is nothing to pin"),
    "fp32_math": Expectation(
        fires=frozenset({"fp32-math"}), forbids=frozenset({"small-batch", "launch-bound", "dataloader-starved"}),
        change="bfloat16 autocast", min_gain=1.5,
        why="float32 weights, no autocast, TF32 off: the matmuls skip the Tensor Cores"),
    "dataloader_starved": Expectation(
        fires=frozenset({"dataloader-starved"}), forbids=GPU_RULES,
        change="the finding's worker processes", min_gain=1.5,
        why="1 ms of CPU per sample in the main process: the loop waits for data, the GPU for the loop"),
    "bf16_matmul": Expectation(
        none_at_all=True,
        why="large bfloat16 matmuls with data on the GPU: nothing to improve, MFU near the measured peak"),
}


def judge_rules(name: str, rules: Iterable[str]) -> tuple[bool, str]:
    """(whether the rules that fired on workload ``name`` are what :data:`EXPECTED` says, in words)."""
    expectation = EXPECTED[name]
    fired = sorted(set(rules))
    missing = sorted(expectation.fires - set(fired))
    wrong = sorted(set(fired) & expectation.forbids) if not expectation.none_at_all else fired
    ok = not missing and not wrong
    parts = [f"fired {', '.join(fired) or 'nothing'}"]
    if expectation.none_at_all:
        parts.append("expected no finding")
    else:
        parts.append(f"expected {', '.join(sorted(expectation.fires))}")
    if missing:
        parts.append(f"missing {', '.join(missing)}")
    if wrong:
        parts.append(f"must not fire {', '.join(wrong)}")
    return ok, "; ".join(parts)


# ------------------------------------------------------------------ the loops (need CUDA)

# Where the loops run: a GPU on the lent machine; the tests run them on "cpu" to prove the code
# (everything but the CUDA graph and the blocking event, which need CUDA).
DEVICE = "cuda"
# Seconds each watched loop runs (after a few steps outside the watch, so cuBLAS and the
# allocator are warm), and how many steps warm it up.
WATCH_S = 3.0
WARM_STEPS = 3
# Shapes (module constants, so the tests can run the same code small on the CPU): the fp32
# workload's width and batch, the small-batch workload's GPU-resident samples, and the bf16
# workload's LAYERS square linear layers of WIDTH at batch BATCH.
FP32_WIDTH = 4096
FP32_BATCH = 1024
SMALL_SAMPLES = 1 << 16
BF16_WIDTH = 8192
BF16_LAYERS = 4
BF16_BATCH = 8192


@dataclass
class Loop:
    """One training loop: ``step()`` does one step and returns the samples it took."""

    step: Callable[[], int]
    model: Any = None
    loaders: list[Any] = field(default_factory=list)
    # Start the loop's DataLoader iteration afresh: called after the warm-up, so the watch sees
    # the loader's iter() (where the probe reads its settings) and not only its next() calls.
    reset: Callable[[], None] = lambda: None
    # Analytic FLOPs of one training step where the shapes make it exact (matmuls only).
    flops_per_step: float | None = None


def run_for(loop: Loop, seconds: float) -> float:
    """Run ``loop`` for ``seconds`` of wall time; samples/s, the GPU's queue drained at the end."""
    samples, start = 0, time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        samples += loop.step()
    synchronize()
    return samples / (time.perf_counter() - start)


def synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _sgd(model: Any) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=1e-4)


def launch_bound(graphed: bool = False) -> Loop:
    """~1000 tiny kernels per training step (forward and backward); ``graphed``: one CUDA graph replay."""
    import torch

    class TinyKernels(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(64, device=DEVICE, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(250):
                x = x * self.scale + 1e-3
            return x

    model = TinyKernels()
    optimizer = _sgd(model)
    batches = [torch.randn(64, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(8)]

    def train(x: torch.Tensor) -> None:
        model(x).float().sum().backward()
        optimizer.step()

    if not graphed:
        counter = iter(range(1 << 62))

        def step() -> int:
            optimizer.zero_grad(set_to_none=True)
            train(batches[next(counter) % len(batches)])
            return 64

        return Loop(step, model)

    # Whole-step capture as in PyTorch's CUDA graphs notes: warm up on a side stream, then capture
    # with the gradients unset, so backward allocates them in the graph's own pool.
    static = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            train(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        train(static)

    def replay() -> int:
        graph.replay()
        return 64

    return Loop(replay, model)


class GpuBatches:
    """A map-style dataset already on the GPU that hands out a batch of consecutive indexes as one
    slice (``__getitems__``, which the DataLoader's fetcher calls with the whole batch)."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.x[index], self.y[index]

    def __getitems__(self, indexes: list[int]) -> tuple[Any, Any]:
        first, last = indexes[0], indexes[-1]
        if last - first + 1 == len(indexes):
            return self.x[first:last + 1], self.y[first:last + 1]
        import torch

        where = torch.as_tensor(indexes, device=self.x.device)
        return self.x[where], self.y[where]


def as_batch(batch: Any) -> Any:
    """collate_fn for :class:`GpuBatches`: the batch is already one."""
    return batch


def small_batch(batch_size: int = 8) -> Loop:
    """A small MLP fed batches of ``batch_size`` from GPU-resident data; each step ends on a blocking event."""
    import torch
    from torch.utils.data import DataLoader

    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 10)).to(DEVICE)
    optimizer = _sgd(model)
    data: Any = GpuBatches(torch.randn(SMALL_SAMPLES, 1024, device=DEVICE),
                      torch.randint(0, 10, (SMALL_SAMPLES,), device=DEVICE))
    loader: Any = DataLoader(data, batch_size=batch_size, collate_fn=as_batch, drop_last=True)
    done = torch.cuda.Event(blocking=True) if DEVICE == "cuda" else None
    batches: Any = None

    def reset() -> None:
        nonlocal batches
        batches = None

    def step() -> int:
        nonlocal batches
        batch = None if batches is None else next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        x, y = batch
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if done is not None:
            done.record()
            done.synchronize()  # the host sleeps until the step is done, as a loop logging its loss waits
        return len(x)

    return Loop(step, model, [loader], reset=reset)


def fp32_math(autocast: bool = False) -> Loop:
    """4096-wide float32 linear layers at batch 1024 (call under :func:`tf32_off`); ``autocast``: bfloat16."""
    import torch

    width, layers, batch = FP32_WIDTH, 4, FP32_BATCH
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)),
                                torch.nn.Linear(width, 10)).to(DEVICE)
    optimizer = _sgd(model)
    x = torch.randn(batch, width, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)

    def step() -> int:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return batch

    return Loop(step, model)


class Decoded:
    """A dataset that spends ``cost_s`` of CPU per sample, as decoding and augmenting an image does."""

    def __init__(self, cost_s: float = 0.001, length: int = 1 << 20) -> None:
        self.cost_s, self.length = cost_s, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import torch

        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:
            pass
        return torch.full((3, 32, 32), float(index % 7)), index % 10


def dataloader_starved(num_workers: int = 0) -> Loop:
    """A bfloat16 conv net fed by :class:`Decoded` in batches of 32 (``num_workers`` processes)."""
    import torch
    from torch.utils.data import DataLoader

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(64, 10)).to(DEVICE, torch.bfloat16)
    optimizer = _sgd(model)
    workers: dict[str, Any] = {"num_workers": num_workers, "pin_memory": True,
                               "persistent_workers": True} if num_workers else {}
    dataset: Any = Decoded()
    loader: Any = DataLoader(dataset, batch_size=32, **workers)
    batches: Any = None

    def reset() -> None:
        nonlocal batches
        batches = None

    def step() -> int:
        nonlocal batches
        if batches is None:
            batches = iter(loader)
        x, y = next(batches)
        x, y = x.to(DEVICE, torch.bfloat16, non_blocking=True), y.to(DEVICE, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return len(x)

    return Loop(step, model, [loader], reset=reset)


def bf16_matmul() -> Loop:
    """BF16_LAYERS bfloat16 linear layers of BF16_WIDTH at batch BF16_BATCH, no bias, data on the GPU."""
    import torch

    model = torch.nn.Sequential(*(torch.nn.Linear(BF16_WIDTH, BF16_WIDTH, bias=False)
                                  for _ in range(BF16_LAYERS))).to(DEVICE, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    x = torch.randn(BF16_BATCH, BF16_WIDTH, device=DEVICE, dtype=torch.bfloat16)

    def step() -> int:
        loss = model(x).float().square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return BF16_BATCH

    return Loop(step, model, flops_per_step=bf16_matmul_flops())


def bf16_matmul_flops() -> float:
    """The bf16 workload's matmul FLOPs per training step: each layer's forward (2·B·W²), its weight
    gradient (2·B·W²) and, but for the first layer (its input needs none), its input gradient."""
    per_matmul = 2.0 * BF16_BATCH * BF16_WIDTH * BF16_WIDTH
    return per_matmul * (3 * BF16_LAYERS - 1)


def warm(loop: Loop, steps: int = WARM_STEPS) -> None:
    for _ in range(steps):
        loop.step()
    synchronize()


# name -> (the loop as found, the loop with the change that must pay; None: no change)
BUILDERS: dict[str, tuple[Callable[[], Loop], Callable[[dict[str, Any]], Loop] | None]] = {
    "launch_bound": (launch_bound, lambda change: launch_bound(graphed=True)),
    "small_batch": (small_batch, lambda change: small_batch(min(4096, int(change.get("batch_size") or 512)))),
    "fp32_math": (fp32_math, lambda change: fp32_math(autocast=True)),
    "dataloader_starved": (dataloader_starved,
                           lambda change: dataloader_starved(int(change.get("num_workers") or 8))),
    "bf16_matmul": (bf16_matmul, None),
}
