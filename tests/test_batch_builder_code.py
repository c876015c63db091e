"""dataloader-cpu-bound's code names where the batches were measured being built: a ``collate_fn``
that tokenizes (Hugging Face's streaming pipelines) rather than the dataset's ``__getitem__``."""

from __future__ import annotations

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
