"""dataloader-cpu-bound's code names where the batches were measured being built: a ``collate_fn``
that tokenizes (Hugging Face's streaming pipelines) rather than the dataset's ``__getitem__``."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

import gpuwidget
from gpuwidget.advice.code import cache_code
from gpuwidget.advice.rules.dataloader_cpu_bound import batch_builder

LOADER = {"settings": {"dataset_type": "TextBlocks", "dataset_code": {"file": "train.py", "line": 40, "cell": None}}}
COLLATE = {"function": "collate_fn", "file": "train.py", "line": 136, "cell": None, "share": 0.3, "in_loader": 1.0}


def test_a_collate_fn_that_builds_the_batches_is_named_with_its_share():
    workload = {"loop_waits": [{**COLLATE, "function": "main", "in_loader": 0.2}, COLLATE]}
    builder = batch_builder(workload)  # type: ignore[arg-type]
    assert builder is COLLATE  # the first wait mostly inside next(), not the larger one outside it
    code = cache_code(LOADER, builder)
    assert "built in collate_fn() (train.py, line 136): 30% of the loop's time" in code
    assert "__getitem__" not in code
    exec(code, {})  # comments: runs as pasted


def test_without_a_measured_builder_or_in_getitem_the_dataset_is_named():
    for builder in (None, {**COLLATE, "function": "TextBlocks.__getitem__"}):
        code = cache_code(LOADER, builder)
        assert code.startswith("# Each sample is rebuilt every epoch in TextBlocks.__getitem__ (train.py, line 40).")
    assert batch_builder({"loop_waits": [{**COLLATE, "in_loader": 0.49}]}) is None  # type: ignore[typeddict-item]
    # The loop's own line calling next() (its samples in the loader's own code) builds nothing itself.
    loop_line = {**COLLATE, "function": "main", "in_loop": True}
    assert batch_builder({"loop_waits": [loop_line, COLLATE]}) is COLLATE  # type: ignore[typeddict-item]


def test_a_helper_the_dataset_calls_under_the_default_collate_is_the_datasets_work():
    # CpuHeavyDataset.__getitem__ calls burn(): the samples find burn(), but with torch's default collate
    # the batch is the dataset's samples stacked, so the dataset is what to cache.
    loader = {"settings": {**LOADER["settings"], "collate_fn": "default_collate", "default_collate": True}}
    helper = {**COLLATE, "function": "burn", "line": 22}
    code = cache_code(loader, helper)  # type: ignore[arg-type]
    assert code.startswith("# Each sample is rebuilt every epoch in TextBlocks.__getitem__ (train.py, line 40).")
    assert "burn" not in code
    custom = {"settings": {**LOADER["settings"], "collate_fn": "collate_fn", "default_collate": False}}
    assert "built in collate_fn() (train.py, line 136)" in cache_code(custom, COLLATE)  # type: ignore[arg-type]


def busy_ms(ms: float) -> None:
    """Pure Python for ``ms`` milliseconds: holds the GIL, as a slow tokenizer does."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Collator:
    """A collator object, as transformers' DataCollator classes are."""

    def __call__(self, items: list[torch.Tensor]) -> torch.Tensor:
        busy_ms(3.0)
        return torch.stack(items)


def test_a_collate_fn_holding_the_gil_is_named_by_the_probes_timing_where_the_samples_miss_it():
    # A 3 ms collate in pure Python: a stack read waits up to the 5 ms switch interval for the GIL, by
    # when the collate has mostly ended. The DataLoader probe times the collate itself (one next() in 8).
    def collate_fn(items: list[torch.Tensor]) -> torch.Tensor:
        busy_ms(3.0)
        return torch.stack(items)

    # 256 batches a loader, so 32 sampled calls: a descheduling of a few ms outside the collate (a busy
    # host) moves the share by about 1/32 of itself, not by 1/8 (fresh-check: 0.79 from 8 sampled calls).
    data = torch.randn(1024, 4)
    for collate, name in ((collate_fn, "collate_fn"), (Collator(), "Collator.__call__")):
        loader = DataLoader(data, batch_size=4, collate_fn=collate)
        with gpuwidget.watch(quiet=True) as run:
            for batch in loader:
                batch.sum()
        (facts,) = run.workload["loaders"]
        assert facts["settings"]["collate_code"]["function"] == name
        assert facts["settings"]["collate_code"]["file"].endswith("test_batch_builder_code.py")
        assert facts["collate_share"] >= 0.8  # 3 ms of a next() that does little else
        builder = batch_builder({"loop_waits": []}, facts)
        assert builder is not None and builder["function"] == name and builder["timed"] is True
        assert builder["seconds"] == pytest.approx(facts["collate_share"] * facts["wait_total_s"])
        code = cache_code(facts, builder)
        assert f"built in {name}() (" in code and "of the loop's time (timed)" in code
        exec(code, {})
    # With torch's default collate the dataset builds the samples: nothing is timed, nothing named.
    with gpuwidget.watch(quiet=True) as run:
        for batch in DataLoader(data, batch_size=4):
            batch.sum()
    (facts,) = run.workload["loaders"]
    assert facts["settings"]["collate_code"] is None
    assert batch_builder({"loop_waits": []}, facts) is None
