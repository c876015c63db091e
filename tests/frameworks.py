"""Training code written the way Lightning, Hugging Face, accelerate and torch's docs write it, for
the real-frameworks advice tests and benchmark (CPU, a second or two each).

Each :class:`Case` is two notebook cells as source: ``setup`` (imports, data, model) and
``cell`` (the watched training loop, bound to ``run``), executed in one namespace like a
kernel's. Storage is a sleep per item, so starvation is deterministic; ``latency=0`` gives
the healthy version of the same loop. :func:`check_code` executes a finding's ``.code`` in
that namespace and compares the loader before and after: the invariant every loader finding
keeps (DESIGN.md); its epochs read storage and decode without their seconds (:func:`timeless`).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

LOADER_RULES = {"dataloader-starved", "dataloader-cpu-bound", "io-bound"}
# 40 batches of 8 at 4 ms an item: 1.3 s of loop, over the evidence a cause needs
# (gpuwidget.advice.evidence: 16 steady steps, 1 s of them).
ITEMS = 320
FEATURES = 16


# While check_code reads its epochs (it compares samples, not speed) storage answers at once and decoding
# takes no time: their sleeps and burns were about half of each real-frameworks case's seconds.
_timeless = False


@contextlib.contextmanager
def timeless() -> Iterator[None]:
    """Storage and decoding without their seconds meanwhile (workers forked meanwhile inherit it:
    check_code ends the persistent workers of the loaders it read, so that none keeps it)."""
    global _timeless
    before, _timeless = _timeless, True
    try:
        yield
    finally:
        _timeless = before


def burn(seconds: float) -> None:
    """CPU work in Python (holds the GIL, as a decode or augmentation does)."""
    if _timeless:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def item(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: the same features and label every time it is read."""
    generator = torch.Generator().manual_seed(i)
    return torch.randn(FEATURES, generator=generator), torch.tensor(i % 4)


class SlowItems(Dataset):
    """Each item waits ``latency`` seconds on "storage" (a network filesystem read)."""

    def __init__(self, n: int = ITEMS, latency: float = 0.004) -> None:
        self.n, self.latency = n, latency

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latency and not _timeless:
            time.sleep(self.latency)
        return item(i)


class TokenItems(SlowItems):
    """Hugging Face style: dict samples with input_ids and labels."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self.latency and not _timeless:
            time.sleep(self.latency)
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Stream(IterableDataset):
    """Records read one after another from a stream; every worker reads the whole stream."""

    def __init__(self, n: int = ITEMS, latency: float = 0.004) -> None:
        self.n, self.latency = n, latency

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            if self.latency and not _timeless:
                time.sleep(self.latency)
            yield item(i)


class ShardedStream(Stream):
    """The same records, each worker reading its share (torch's IterableDataset recipe)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        indices = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in indices:
            if self.latency and not _timeless:
                time.sleep(self.latency)
            yield item(i)


class Normalize(torch.nn.Module):
    """A torchvision-style transform written with torch ops (an nn.Module, called per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.mean


class RandomFlip(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(0) if torch.rand(()) < 0.5 else x


class Images(Dataset):
    """Decode (CPU work, the same every epoch) then augment (random): a torchvision pipeline."""

    def __init__(self, n: int = ITEMS, decode_s: float = 0.004) -> None:
        self.n, self.decode_s = n, decode_s
        self.transform = torch.nn.Sequential(Normalize(), RandomFlip())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decode_s:
            burn(self.decode_s)
        x, y = item(i)
        return self.transform(x), y


def mlp(hidden: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def make_loader(dataset: Dataset, batch_size: int = 8) -> DataLoader:
    """A loader built in an imported function: no name of the user's holds it."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def burn_each_step(step_s: float) -> Any:
    """A Hugging Face TrainerCallback that computes ``step_s`` more per step (a bigger model)."""
    from transformers import TrainerCallback

    class BurnEachStep(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            burn(step_s)

    return BurnEachStep()


def lightning_module(dataset: Dataset | None, step_s: float = 0.0) -> Any:
    """A LightningModule that builds its loader over ``dataset`` in ``train_dataloader``; with
    ``dataset=None`` it has none and trains from a datamodule's."""
    import pytorch_lightning as pl

    class Classifier(pl.LightningModule):
        """No forward(): training_step calls the encoder and the decoder itself."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Linear(FEATURES, 32)
            self.decoder = torch.nn.Linear(32, 4)
            self.dataset = dataset

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            burn(step_s)
            return torch.nn.functional.cross_entropy(self.decoder(torch.relu(self.encoder(x))), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        if dataset is not None:
            def train_dataloader(self) -> DataLoader:
                return DataLoader(self.dataset, batch_size=8, shuffle=True)

    return Classifier()


def lightning_datamodule(items: int = ITEMS, latency: float = 0.004) -> Any:
    """A LightningDataModule that makes its dataset in ``setup()``, as datamodules do: no name of
    the user's holds the dataset or the loader."""
    import pytorch_lightning as pl

    class Storage(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            self.train_set = SlowItems(n=items, latency=latency)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_set, batch_size=8, shuffle=True)

    return Storage()


# --------------------------------------------------------------------------- the cases

LOOP = """
with gpuwidget.watch(display=False) as run:
    for x, y in {iterable}:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        burn(step_s)
"""
PLAIN_SETUP = """
import torch, gpuwidget
from torch.utils.data import DataLoader
from frameworks import {dataset}, burn, mlp
train_ds = {dataset}(n={items}, latency={latency})
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""


@dataclass
class Case:
    """One way people write a training loop, as two cells."""

    name: str
    setup: str
    cell: str
    loader: str | None  # expression giving the loader the code changes; None: comments only
    cause: str  # the diagnosis expected when starved: "io" or "cpu"
    unordered: bool = False  # compare samples as a multiset (an IterableDataset's batches
    # depend on how it shards between workers)
    frameworks: tuple[str, ...] = ()
    # Run before comparing samples: random augmentation draws from each worker's own RNG, so
    # the comparison turns it off (the samples must match on everything else).
    compare_setup: str = ""
    # An expression giving a loader like the one the loop iterated, for a num_workers sweep.
    sweep: str | None = None

    @property
    def sweep_loader(self) -> str:
        return self.sweep or self.loader or ""


def cases(latency: float = 0.004, items: int = ITEMS) -> list[Case]:
    """Every case, starved (``latency`` seconds of storage or decoding per item) or healthy (0),
    over ``items`` samples."""
    plain = PLAIN_SETUP.format(dataset="SlowItems", latency=latency, items=items)
    stream = PLAIN_SETUP.format(dataset="Stream", latency=latency, items=items)
    sharded = PLAIN_SETUP.format(dataset="ShardedStream", latency=latency, items=items)
    images = PLAIN_SETUP.replace("train_ds = {dataset}(n={items}, latency={latency})",
                                 "train_ds = Images(n={items}, decode_s={latency})")
    images = images.format(dataset="Images", latency=latency, items=items)
    return [
        Case("batch_sampler= loader", plain + "from torch.utils.data import BatchSampler, RandomSampler\n"
             "train_loader = DataLoader(train_ds, batch_sampler=BatchSampler(RandomSampler(train_ds), 8, False))\n",
             LOOP.format(iterable="train_loader"), "train_loader", "io"),
        Case("dict batches", plain.replace("SlowItems", "TokenItems") + "embed = torch.nn.Embedding(32, 4)\n"
             "model = torch.nn.Sequential(embed, torch.nn.Flatten(), torch.nn.Linear(32, 4))\n"
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "train_loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n",
             LOOP.replace("for x, y in {iterable}:", "for batch in {iterable}:")
             .replace("model(x), y", "model(batch['input_ids']), batch['labels'][:, 0] % 4")
             .format(iterable="train_loader"), "train_loader", "io"),
        Case("tqdm", plain + "import io\nfrom tqdm.auto import tqdm\n"
             "train_loader = DataLoader(train_ds, batch_size=8)\n",
             LOOP.replace("for x, y in {iterable}:",
                          "for step, (x, y) in enumerate(tqdm(train_loader, file=io.StringIO())):"),
             "train_loader", "io"),
        Case("IterableDataset, sharded", sharded + "train_loader = DataLoader(train_ds, batch_size=8)\n",
             LOOP.format(iterable="train_loader"), "train_loader", "io", unordered=True),
        Case("IterableDataset, not sharded", stream + "train_loader = DataLoader(train_ds, batch_size=8)\n",
             LOOP.format(iterable="train_loader"), "train_loader", "io"),
        Case("torchvision-style transforms",
             images + "train_loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n",
             LOOP.format(iterable="train_loader"), "train_loader", "cpu",
             compare_setup="train_ds.transform = train_ds.transform[:1]\n"),
        Case("loader from an imported function", plain + "from frameworks import make_loader\n",
             LOOP.format(iterable="make_loader(train_ds)"), None, "io", sweep="make_loader(train_ds)"),
        Case("accelerate", plain + "from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n"
             "train_dl = DataLoader(train_ds, batch_size=8, shuffle=True)\n"
             "model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)\n",
             LOOP.format(iterable="train_dl").replace("loss.backward()", "accelerator.backward(loss)"),
             "train_dl", "io", frameworks=("accelerate",)),
        Case("Hugging Face Trainer", HF_SETUP.format(latency=latency, items=items), HF_CELL,
             "trainer.get_train_dataloader()", "io", frameworks=("transformers",)),
        Case("Lightning Trainer", LIGHTNING_SETUP.format(latency=latency, items=items), LIGHTNING_CELL,
             "model.train_dataloader()", "io", frameworks=("pytorch_lightning",)),
        Case("Lightning datamodule", LIGHTNING_DATAMODULE_SETUP.format(latency=latency, items=items),
             LIGHTNING_DATAMODULE_CELL, "dm.train_dataloader()", "io", frameworks=("pytorch_lightning",)),
    ]


HF_SETUP = """
import gpuwidget
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from frameworks import TokenItems, burn_each_step
config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps={items} // 8, report_to=[],
                         save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True)
trainer = Trainer(model=model, args=args, train_dataset=TokenItems(n={items}, latency={latency}),
                  callbacks=[burn_each_step(step_s)])
"""
HF_CELL = """
with gpuwidget.watch(display=False) as run:
    trainer.train()
"""
LIGHTNING_SETUP = """
import gpuwidget
import pytorch_lightning as pl
from frameworks import SlowItems, lightning_module
model = lightning_module(SlowItems(n={items}, latency={latency}), step_s)
trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu")
"""
LIGHTNING_CELL = """
with gpuwidget.watch(display=False) as run:
    trainer.fit(model)
"""
LIGHTNING_DATAMODULE_SETUP = """
import gpuwidget
import pytorch_lightning as pl
from frameworks import lightning_datamodule, lightning_module
model = lightning_module(None, step_s)
dm = lightning_datamodule(items={items}, latency={latency})
trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu")
"""
LIGHTNING_DATAMODULE_CELL = """
with gpuwidget.watch(display=False) as run:
    trainer.fit(model, datamodule=dm)
"""


def run_case(case: Case, output_dir: str, step_s: float = 0.002) -> tuple[dict[str, Any], Any]:
    """Run the case's two cells in a fresh namespace (like a kernel's), each training step
    computing for at least ``step_s``; returns the namespace and the Run."""
    namespace: dict[str, Any] = {"__name__": "__main__", "output_dir": output_dir, "step_s": step_s}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(case.setup, namespace)
        exec(case.cell, namespace)
    return namespace, namespace["run"]


def batches(loader: Any, seed: int = 0) -> list[Any]:
    """One epoch of ``loader`` with the global RNG seeded (shuffling and augmentation repeat)."""
    torch.manual_seed(seed)
    return list(loader)


def same(a: Any, b: Any) -> bool:
    """Equal structure, dtypes, shapes and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return bool(a == b)


def _seeded_eval(expression: str, namespace: dict[str, Any]) -> Any:
    """The loader ``expression`` gives, built with the global RNG seeded (a Trainer seeds its
    sampler from it when it builds the loader)."""
    torch.manual_seed(0)
    return eval(expression, namespace)


def _sample_keys(epoch: list[Any]) -> Counter[bytes]:
    """The samples of an epoch as a multiset (first tensor of each sample, by value)."""
    keys: Counter[bytes] = Counter()
    for batch in epoch:
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        for row in first:
            keys[row.numpy().tobytes()] += 1
    return keys


@dataclass
class CodeCheck:
    """What executing a finding's ``.code`` did."""

    error: str | None = None  # the exception it raised, or None
    executable: bool = False  # it has statements (not only comments)
    same_samples: bool | None = None  # the loader yields what it did (None: no loader to compare)
    changed: bool = False  # the loader expression now gives another object (the change applies)

    @property
    def ok(self) -> bool:
        return self.error is None and self.same_samples is not False


@timeless()
def check_code(code: str, namespace: dict[str, Any], case: Case) -> CodeCheck:
    """Execute ``code`` in ``namespace`` and compare the loader ``case.loader`` evaluates to,
    before and after: one seeded epoch, batch by batch (or as a multiset for ``case.unordered``)."""
    import ast

    result = CodeCheck(executable=bool(ast.parse(code).body))
    loader, unordered = case.loader, case.unordered
    exec(case.compare_setup, namespace)
    before_loader = _seeded_eval(loader, namespace) if loader else None
    before = batches(before_loader) if before_loader is not None else None
    if before_loader is not None:
        end_workers(before_loader)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(code, namespace)
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if loader is None or before is None:
        return result
    after_loader = _seeded_eval(loader, namespace)
    result.changed = after_loader is not before_loader
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = batches(after_loader)
    end_workers(after_loader)
    if unordered:
        result.same_samples = _sample_keys(before) == _sample_keys(after)
    else:
        result.same_samples = same(before, after)
    return result


def end_workers(loader: Any) -> None:
    """Shut a persistent-workers loader's worker processes down now, not at garbage collection; the
    next epoch starts new ones. An accelerate loader's are its ``base_dataloader``'s (which its
    attributes forward to): that loader lets its iterator go."""
    owner = getattr(loader, "base_dataloader", loader)
    iterator = vars(owner).get("_iterator")
    if iterator is not None:
        iterator._shutdown_workers()
        owner._iterator = None


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
    return int(first.shape[0])


def shows_sharding(code: str) -> bool:
    """The code explains the sharding an IterableDataset needs before workers (changes nothing)."""
    return "get_worker_info" in code


def loader_findings(run: Any) -> list[Any]:
    return [f for f in run.findings if f.rule in LOADER_RULES]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def available(case: Case) -> bool:
    """The frameworks the case needs are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in case.frameworks)

