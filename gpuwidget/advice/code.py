"""The code a loader finding offers: it runs as pasted in the user's namespace and keeps the data.

The invariant (DESIGN.md, public contract): executed where the watched cell ran, the code
either (a) rebinds the user's own name for the loader to a DataLoader that yields the same
samples with the same batching, sampling and collation, only the speed settings changed;
or (b) where no name of the user's holds the loader (a Trainer owns it, or a function
built it), it is an instruction in the owning framework's terms that raises nothing:
attribute assignments on the user's ``TrainingArguments``, ``accelerator.prepare`` of a
loader built with the settings, or comments naming the file, function and the DataLoader
line to change. It never uses a name the user does not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuwidget.advice.loader import DEFAULT_PREFETCH
from gpuwidget.facts import LoaderFacts, WorkloadFacts
from gpuwidget.probes.origin import call_with_keywords

IMPORT = "from torch.utils.data import DataLoader"
# DataLoader settings -> the Hugging Face TrainingArguments fields the Trainer builds its loader from.
HF_ARGUMENTS = {"num_workers": "dataloader_num_workers", "pin_memory": "dataloader_pin_memory",
                "persistent_workers": "dataloader_persistent_workers",
                "prefetch_factor": "dataloader_prefetch_factor"}


def model_code(name: str | None, statement: str, where: str = "apply it where you build the model") -> str:
    """``statement`` (written with ``{model}``) on the user's model: code on their own name where a
    variable of theirs holds the model, else the same line as a comment saying where it goes, so
    the snippet never names a variable the user does not have."""
    if name:
        return statement.format(model=name)
    commented = statement.format(model="model").replace("\n", "\n# ")
    return f"# No variable of yours holds the model: {where}.\n# {commented}"


def speed_keywords(settings: Mapping[str, Any], change: Mapping[str, Any]) -> dict[str, Any]:
    """The speed settings to write, valid for torch (no prefetch or persistence without workers)."""
    merged = {**settings, **change}
    workers = int(merged.get("num_workers") or 0)
    keywords: dict[str, Any] = {"num_workers": workers}
    if merged.get("pin_memory"):
        keywords["pin_memory"] = True
    if workers > 0:
        if merged.get("prefetch_factor") not in (None, DEFAULT_PREFETCH):
            keywords["prefetch_factor"] = merged["prefetch_factor"]
        if merged.get("persistent_workers"):
            keywords["persistent_workers"] = True
        if merged.get("multiprocessing_context"):
            keywords["multiprocessing_context"] = merged["multiprocessing_context"]
    return keywords


def loader_code(loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any],
                workload: WorkloadFacts | Mapping[str, Any] | None = None) -> str:
    """The snippet that applies ``change`` to ``loader`` (see the module docstring)."""
    frameworks = (workload or {}).get("frameworks") or {}
    name = loader.get("name")
    owner = loader.get("owner")
    duplicates = _duplicates_warning(loader, change)
    if duplicates:
        return duplicates
    if owner == "transformers":
        return _hf_code(change, frameworks)
    if name and owner == "accelerate":
        return _accelerate_code(name, loader, change, frameworks.get("accelerator"))
    if name:
        return f"{IMPORT}\n{name} = {dataloader_call(name, loader, change)}"
    return _where_built(loader, change)


def dataloader_call(name: str, loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any]) -> str:
    """``DataLoader(...)`` over the same dataset, sampling, batching and collation as the loader
    the user calls ``name``, with ``change`` applied."""
    settings = loader.get("settings") or {}
    args = [loader.get("dataset_name") or f"{name}.dataset"]
    if settings.get("iterable_dataset"):
        # An IterableDataset takes no sampler (torch raises on sampler= or shuffle=).
        args.append(f"batch_size={settings.get('batch_size')!r}")
        if settings.get("drop_last"):
            args.append("drop_last=True")
    elif settings.get("custom_batch_sampler") or settings.get("batch_sampler_given"):
        args.append(f"batch_sampler={name}.batch_sampler")
    else:
        args.append(f"batch_size={change.get('batch_size', settings.get('batch_size'))!r}")
        if settings.get("custom_sampler"):
            args.append(f"sampler={name}.sampler")
        elif settings.get("shuffle"):
            args.append("shuffle=True")
        if settings.get("drop_last"):
            args.append("drop_last=True")
    if not settings.get("default_collate", True):
        args.append(f"collate_fn={name}.collate_fn")
    if settings.get("worker_init_fn"):
        args.append(f"worker_init_fn={name}.worker_init_fn")
    if settings.get("generator"):
        args.append(f"generator={name}.generator")
    if settings.get("timeout"):
        args.append(f"timeout={settings['timeout']!r}")
    args += [f"{key}={value!r}" for key, value in speed_keywords(settings, change).items()]
    return f"DataLoader({', '.join(args)})"


def _hf_code(change: Mapping[str, Any], frameworks: Mapping[str, str]) -> str:
    fields = {HF_ARGUMENTS[key]: value for key, value in change.items() if key in HF_ARGUMENTS}
    keywords = ", ".join(f"{key}={value!r}" for key, value in fields.items())
    lines = ["# The Trainer builds this DataLoader from its TrainingArguments; set the loader's speed there",
             f"# (where you create them: TrainingArguments(..., {keywords})).",
             "# The next trainer.train() builds its loader with:"]
    target = f"{frameworks['hf_trainer']}.args" if "hf_trainer" in frameworks else frameworks.get("training_args")
    if target is None:
        return "\n".join(lines[:2])
    return "\n".join(lines + [f"{target}.{key} = {value!r}" for key, value in fields.items()])


def _accelerate_code(name: str, loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any],
                     accelerator: str | None) -> str:
    """Build the loader as it was before ``accelerator.prepare``, with the settings, and prepare it."""
    settings = loader.get("settings") or {}
    inner = settings.get("inner_batching") or {}
    if inner.get("plain_sampler") and not settings.get("iterable_dataset"):
        plain = {**settings, "batch_sampler_given": False, "custom_sampler": False, **inner}
        call = dataloader_call(name, {**loader, "settings": plain}, change)
    else:
        call = dataloader_call(name, loader, change)
    if accelerator is None:
        return (f"# {name} was prepared by accelerate: build the DataLoader you pass to accelerator.prepare as\n"
                f"#     {call}\n# and prepare it again.")
    return (f"{IMPORT}\n# The loader as it was before accelerate prepared it, with the new settings:\n"
            f"{name} = {accelerator}.prepare({call})")


def _where_built(loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any]) -> str:
    """Comments only: no name of the user's holds the loader, so say where to change it."""
    settings = loader.get("settings") or {}
    keywords = speed_keywords(settings, change)
    listed = ", ".join(f"{key}={value!r}" for key, value in keywords.items())
    site = loader.get("built_at")
    owner = loader.get("owner")
    if site is None:
        where = ("the LightningModule's train_dataloader" if owner == "lightning"
                 else "the code that builds this DataLoader")
        return f"# No variable of yours holds this loader: in {where}, pass\n#     {listed}"
    place = _place(site)
    line = call_with_keywords(site, keywords)
    if line is None:
        return f"# This DataLoader is built {place}: pass it\n#     {listed}"
    return f"# This DataLoader is built {place}; build it there as\n#     {line}"


def unsharded(loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any]) -> bool:
    """Workers in ``change`` would each yield every item of this IterableDataset (it does not
    shard with get_worker_info())."""
    settings = loader.get("settings") or {}
    return (bool(settings.get("iterable_dataset")) and settings.get("shards_by_worker") is False
            and int(change.get("num_workers") or 0) >= 2)


SHARDING_SENTENCE = (" Its IterableDataset does not split items between workers: shard it with "
                     "torch.utils.data.get_worker_info() first, or every worker yields every sample.")


def _place(site: Mapping[str, Any]) -> str:
    """``in make_loader() (loaders.py, line 12)``, ``in train() (cell In [5], line 3)``, or
    ``at line 3 of cell In [5]`` for a cell's own top level."""
    where = f"cell In [{site['cell']}]" if site.get("cell") is not None else Path(site["file"]).name
    if site["function"] == "<module>":
        return f"at line {site['line']} of {where}"
    return f"in {site['function']}() ({where}, line {site['line']})"


def _duplicates_warning(loader: LoaderFacts | Mapping[str, Any], change: Mapping[str, Any]) -> str | None:
    """An IterableDataset that does not shard gives every worker all items: workers would
    repeat each sample, so the code shows the sharding first instead of adding workers."""
    if not unsharded(loader, change):
        return None
    settings = loader.get("settings") or {}
    workers = int(change.get("num_workers") or 0)
    where = settings.get("dataset_code") or {}
    place = f" ({Path(where['file']).name}, line {where['line']})" if where else ""
    dataset = settings.get("dataset_type") or "the dataset"
    return (f"# {dataset}.__iter__{place} does not split its items between worker processes: with\n"
            f"# num_workers={workers} every worker would yield every sample ({workers} copies of each).\n"
            "# Give each worker its share first, then add the workers:\n"
            "#     def __iter__(self):\n"
            "#         info = torch.utils.data.get_worker_info()\n"
            "#         items = self.items_to_read()  # your list of files, shards or rows\n"
            "#         if info is not None:\n"
            "#             items = items[info.id::info.num_workers]\n"
            "#         for item in items:\n"
            "#             yield self.read(item)\n"
            f"#     ... DataLoader(..., num_workers={workers})")


def cache_code(loader: LoaderFacts | Mapping[str, Any]) -> str:
    """What to cache for a CPU-bound loader, in prose (comments): only the deterministic part
    of a sample (decoding, resizing), never the random augmentation applied after it."""
    settings = loader.get("settings") or {}
    dataset = settings.get("dataset_type") or "the dataset"
    where = settings.get("dataset_code") or {}
    place = f" ({Path(where['file']).name}, line {where['line']})" if where else ""
    transforms = settings.get("dataset_transforms") or []
    lines = [f"# Each sample is rebuilt every epoch in {dataset}.__getitem__{place}."]
    if transforms:
        attribute = transforms[0]
        lines += [f"# Cache what it computes before self.{attribute} (decoding, resizing: the same every epoch),",
                  f"# e.g. keep decoded samples in a dict by index, and apply self.{attribute} after the lookup:",
                  "# a random augmentation must still run on every access, or every epoch sees the same one."]
    else:
        lines += ["# Cache the part that is the same every epoch (decoding, resizing), keyed by index, and keep",
                  "# random augmentation outside the cache so every epoch still sees new samples."]
    lines.append("# Or run the augmentation on the GPU on whole batches (torchvision.transforms.v2, NVIDIA DALI).")
    return "\n".join(lines)
