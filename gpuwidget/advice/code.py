"""The code a loader finding offers: it runs as pasted in the user's namespace and keeps the data.

The invariant (DESIGN.md, public contract): executed where the watched cell ran, the code
either (a) rebinds the user's own name for the loader to a loader that yields the same
samples with the same batching, sampling and collation, only the speed settings changed:
of the user's own class where the loader is a DataLoader subclass whose constructor takes the
arguments (gpuwidget.probes.constructor), with its sampler, batch sampler and collate function
by the user's names for them; or (b) where a method of the user's object built the loader (a
LightningModule's or datamodule's ``train_dataloader``), replaces that method on the user's
instance with one that rebuilds the loader it builds, so the next ``trainer.fit`` uses it; or
(c) where neither can be done (a Trainer owns the loader, a function built it, the class cannot
take the arguments), it is an instruction in the owning framework's terms that raises nothing:
attribute assignments on the user's ``TrainingArguments``, ``accelerator.prepare`` of a loader
built with the settings, or comments naming the file, function and line that built the loader
and what to add there. It never uses a name the user does not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from gpuwidget.advice.loader import DEFAULT_PREFETCH
from gpuwidget.facts import LoaderChange, LoaderFacts, LoaderSettings, LoopWait, WorkloadFacts
from gpuwidget.probes.constructor import constructor_call, constructor_keywords, defaults_hold
from gpuwidget.probes.origin import call_with_keywords, location
from gpuwidget.probes.origin import place as site_place

IMPORT = "from torch.utils.data import DataLoader"
# DataLoader settings -> the Hugging Face TrainingArguments fields the Trainer builds its loader from.
HF_ARGUMENTS = {"num_workers": "dataloader_num_workers", "pin_memory": "dataloader_pin_memory",
                "persistent_workers": "dataloader_persistent_workers",
                "prefetch_factor": "dataloader_prefetch_factor", "batch_size": "per_device_train_batch_size"}


def model_code(name: str | None, statement: str, where: str = "apply it where you build the model") -> str:
    """``statement`` (written with ``{model}``) on the user's model: code on their own name where a
    variable of theirs holds the model, else the same line as a comment saying where it goes, so
    the snippet never names a variable the user does not have."""
    if name:
        return statement.format(model=name)
    commented = statement.format(model="model").replace("\n", "\n# ")
    return f"# No variable of yours holds the model: {where}.\n# {commented}"


def speed_keywords(settings: LoaderSettings, change: LoaderChange) -> dict[str, int | bool | str]:
    """The DataLoader keywords for speed to write, valid for torch (no prefetch or persistence without workers)."""
    merged: LoaderSettings = {**settings, **change}
    workers = int(merged.get("num_workers") or 0)
    keywords: dict[str, int | bool | str] = {"num_workers": workers}
    if merged.get("pin_memory"):
        keywords["pin_memory"] = True
    if workers > 0:
        prefetch = merged.get("prefetch_factor")
        if prefetch is not None and prefetch != DEFAULT_PREFETCH:
            keywords["prefetch_factor"] = prefetch
        if merged.get("persistent_workers"):
            keywords["persistent_workers"] = True
        if context := merged.get("multiprocessing_context"):
            keywords["multiprocessing_context"] = context
    return keywords


def change_keywords(settings: LoaderSettings, change: LoaderChange) -> dict[str, int | bool | str]:
    """The keywords an instruction lists: the batch size where the change sets it (small-batch), then
    :func:`speed_keywords` where the change sets any of those."""
    keywords: dict[str, int | bool | str] = {}
    if change.get("batch_size"):
        keywords["batch_size"] = int(change["batch_size"])
    if any(key != "batch_size" for key in change):
        keywords.update(speed_keywords(settings, change))
    return keywords


def loader_code(loader: LoaderFacts, change: LoaderChange,
                workload: WorkloadFacts | None = None) -> str:
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
        try:
            call = constructor_expression(name, loader, change)
        except Unbuildable as why:
            return _class_instruction(loader, change, str(why), name)
        return f"{_import_for(loader)}{name} = {call}"
    hook = _hook_code(loader, change)
    return hook if hook is not None else _where_built(loader, change)


class Unbuildable(Exception):
    """The loader's own class cannot be built again with the change; the message says why
    ("its __init__ ...")."""


def constructor_expression(ref: str, loader: LoaderFacts, change: LoaderChange,
                           dataset: str | None = None) -> str:
    """The call that builds the loader ``ref`` names again, with ``change`` applied: ``DataLoader(...)``,
    or its own class (by the user's name for it, else ``type(ref)``) called as its constructor takes
    the arguments (gpuwidget.probes.constructor). ``dataset``: the dataset's expression (default: the
    user's name for it, else ``ref.dataset``). Raises :class:`Unbuildable` when the class cannot take them."""
    settings = loader.get("settings") or {}
    constructor = settings.get("constructor")
    arguments = _arguments(ref, loader, change, dataset)
    plan = constructor_call(constructor, arguments, set(change))
    if isinstance(plan, str):
        raise Unbuildable(plan)
    if not constructor:
        callee = "DataLoader"
    else:
        class_name = constructor.get("class_name", "")
        if plan.defaults and not defaults_hold(plan.defaults, loader.get("built_at"), class_name):
            listed = ", ".join(plan.defaults)
            raise Unbuildable(f"its __init__ takes {listed}, whose value the loader does not keep")
        callee = (loader.get("user_names") or {}).get("class") or f"type({ref})"
    parts = []
    if plan.dataset is not None and plan.dataset_keyword is None:
        parts.append(plan.dataset)
    elif plan.dataset is not None:
        parts.append(f"{plan.dataset_keyword}={plan.dataset}")
    parts += [f"{parameter}={ref}.{attribute}" for parameter, attribute in plan.attributes.items()]
    parts += [f"{key}={value}" for key, value in plan.keywords.items()]
    return f"{callee}({', '.join(parts)})"


def dataloader_call(name: str, loader: LoaderFacts, change: LoaderChange) -> str:
    """``DataLoader(...)`` over the same dataset, sampling, batching and collation as the loader
    the user calls ``name``, with ``change`` applied (torch's class, whatever the loader's own)."""
    settings: LoaderSettings = {**(loader.get("settings") or {}), "constructor": None}
    return constructor_expression(name, {**loader, "settings": settings}, change)


def _arguments(ref: str, loader: LoaderFacts, change: LoaderChange,
               dataset: str | None) -> dict[str, str]:
    """DataLoader keyword -> expression, for the same dataset, sampling, batching and collation as
    the loader ``ref`` names, with ``change``'s speed settings. The sampler, batch sampler and
    collate function are the loader's own objects, by the user's name where one holds them."""
    settings = loader.get("settings") or {}
    names = loader.get("user_names") or {}

    def own(attribute: str) -> str:
        return names.get(attribute) or f"{ref}.{attribute}"

    arguments = {"dataset": dataset or loader.get("dataset_name") or f"{ref}.dataset"}
    if settings.get("iterable_dataset"):
        # An IterableDataset takes no sampler (torch raises on sampler= or shuffle=).
        arguments["batch_size"] = repr(settings.get("batch_size"))
        if settings.get("drop_last"):
            arguments["drop_last"] = "True"
    elif settings.get("custom_batch_sampler") or settings.get("batch_sampler_given"):
        arguments["batch_sampler"] = own("batch_sampler")
    else:
        arguments["batch_size"] = repr(change.get("batch_size", settings.get("batch_size")))
        if settings.get("custom_sampler"):
            arguments["sampler"] = own("sampler")
        elif settings.get("shuffle"):
            arguments["shuffle"] = "True"
        if settings.get("drop_last"):
            arguments["drop_last"] = "True"
    if not settings.get("default_collate", True):
        arguments["collate_fn"] = own("collate_fn")
    if settings.get("worker_init_fn"):
        arguments["worker_init_fn"] = f"{ref}.worker_init_fn"
    if settings.get("generator"):
        arguments["generator"] = f"{ref}.generator"
    if settings.get("timeout"):
        arguments["timeout"] = repr(settings["timeout"])
    arguments.update({key: repr(value) for key, value in speed_keywords(settings, change).items()})
    return arguments


def _import_for(loader: LoaderFacts) -> str:
    """torch's DataLoader import, where the code calls torch's class (never over the user's own
    class of that name: torch_geometric's loader is called DataLoader too)."""
    return "" if (loader.get("settings") or {}).get("constructor") else f"{IMPORT}\n"


# The methods a framework calls to get a loader (Lightning's LightningModule and LightningDataModule hooks).
LOADER_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")


def _hook_code(loader: LoaderFacts, change: LoaderChange) -> str | None:
    """For a loader a method of the user's object built (a LightningModule's or datamodule's
    ``train_dataloader``, which the Trainer calls): that method replaced on the user's instance by
    one that builds the loader as theirs does and rebuilds it with the settings. The class stays
    as written; the next ``trainer.fit`` calls the replacement. None where no name holds the instance."""
    site = loader.get("built_at") or {}
    instance = (loader.get("user_names") or {}).get("built_by")
    method = str(site.get("function") or "").rsplit(".", 1)[-1]
    if instance is None or method not in LOADER_HOOKS:
        return None
    try:
        call = constructor_expression("loader", loader, change, dataset="loader.dataset")
    except Unbuildable as why:
        return _class_instruction(loader, change, str(why), None)
    replacement = f"faster_{method}"
    return "\n".join([
        f"import types\n{_import_for(loader)}", "",
        f"def {replacement}(self):",
        f"    loader = type(self).{method}(self)  # your {method}'s loader, built but not iterated",
        f"    return {call}", "", "",
        f"# The next trainer.fit(...) calls this instead of {site['function']} ({location(site)}):",
        f"{instance}.{method} = types.MethodType({replacement}, {instance})",
    ])


def _class_instruction(loader: LoaderFacts, change: LoaderChange, reason: str,
                       name: str | None) -> str:
    """Comments only: the loader's own class cannot be built again with the change here, so say
    why and what to add where the loader is built."""
    settings = loader.get("settings") or {}
    constructor = settings.get("constructor") or {}
    class_name = constructor.get("class_name", "DataLoader")
    keywords = change_keywords(settings, change)
    listed = ", ".join(f"{key}={value!r}" for key, value in keywords.items())
    subject = name or "This loader"
    init = constructor.get("code")
    if init:
        reason = reason.replace("its __init__", f"its __init__ ({location(init)})", 1)
    lines = [f"# {subject} is a {class_name}; {reason},",
             f"# so it cannot be built again here without losing what {class_name} does."]
    site = loader.get("built_at")
    where = f"Where it is built, {site_place(site)}," if site else "Where you build it,"
    taken = constructor_keywords(constructor, keywords, set(change)) if constructor else keywords
    if isinstance(taken, str):
        lines += [f"# {where} pass {listed},",
                  f"# and have {class_name}.__init__ hand them to DataLoader: take **kwargs and call",
                  "# super().__init__(..., **kwargs)."]
        return "\n".join(lines)
    line = call_with_keywords(site, taken, [class_name]) if site else None
    if line is None:
        mapped = ", ".join(f"{key}={value!r}" for key, value in taken.items())
        lines.append(f"# {where} pass it {mapped}.")
    else:
        lines += [f"# {where} build it as", f"#     {line}"]
    return "\n".join(lines)


def _hf_code(change: LoaderChange, frameworks: Mapping[str, str]) -> str:
    fields = {HF_ARGUMENTS[key]: value for key, value in change.items() if key in HF_ARGUMENTS}
    keywords = ", ".join(f"{key}={value!r}" for key, value in fields.items())
    lines = ["# The Trainer builds this DataLoader from its TrainingArguments; set the loader's speed there",
             f"# (where you create them: TrainingArguments(..., {keywords})).",
             "# The next trainer.train() builds its loader with:"]
    target = f"{frameworks['hf_trainer']}.args" if "hf_trainer" in frameworks else frameworks.get("training_args")
    if target is None:
        return "\n".join(lines[:2])
    return "\n".join(lines + [f"{target}.{key} = {value!r}" for key, value in fields.items()])


def _accelerate_code(name: str, loader: LoaderFacts, change: LoaderChange,
                     accelerator: str | None) -> str:
    """Build the loader as it was before ``accelerator.prepare``, with the settings, and prepare it."""
    settings = loader.get("settings") or {}
    inner = settings.get("inner_batching")
    if inner and inner.get("plain_sampler") and not settings.get("iterable_dataset"):
        # its batching as torch's own BatchSampler's keywords (plain_sampler rides along unread)
        plain = cast(LoaderSettings, {**settings, "batch_sampler_given": False, "custom_sampler": False, **inner})
        call = dataloader_call(name, {**loader, "settings": plain}, change)
    else:
        call = dataloader_call(name, loader, change)
    if accelerator is None:
        return (f"# {name} was prepared by accelerate: build the DataLoader you pass to accelerator.prepare as\n"
                f"#     {call}\n# and prepare it again.")
    return (f"{IMPORT}\n# The loader as it was before accelerate prepared it, with the new settings:\n"
            f"{name} = {accelerator}.prepare({call})")


def _where_built(loader: LoaderFacts, change: LoaderChange) -> str:
    """Comments only: no name of the user's holds the loader, so say where to change it."""
    settings = loader.get("settings") or {}
    keywords = change_keywords(settings, change)
    constructor = settings.get("constructor")
    plan = constructor_call(constructor, keywords, set(change))
    if isinstance(plan, str):
        return _class_instruction(loader, change, plan, None)
    listed = ", ".join(f"{key}={value!r}" for key, value in plan.keywords.items())
    site = loader.get("built_at")
    owner = loader.get("owner")
    if site is None:
        where = ("the LightningModule's train_dataloader" if owner == "lightning"
                 else "the code that builds this DataLoader")
        return f"# No variable of yours holds this loader: in {where}, pass\n#     {listed}"
    place = site_place(site)
    classes = [constructor["class_name"]] if constructor else []
    line = call_with_keywords(site, plan.keywords, classes)
    if line is None:
        return f"# This DataLoader is built {place}: pass it\n#     {listed}"
    return f"# This DataLoader is built {place}; build it there as\n#     {line}"


def unsharded(loader: LoaderFacts, change: LoaderChange) -> bool:
    """Workers in ``change`` would each yield every item of this IterableDataset (it does not
    shard with get_worker_info())."""
    settings = loader.get("settings") or {}
    return (bool(settings.get("iterable_dataset")) and settings.get("shards_by_worker") is False
            and int(change.get("num_workers") or 0) >= 2)


SHARDING_SENTENCE = (" Its IterableDataset does not split items between workers: shard it with "
                     "torch.utils.data.get_worker_info() first, or every worker yields every sample.")


def _duplicates_warning(loader: LoaderFacts, change: LoaderChange) -> str | None:
    """An IterableDataset that does not shard gives every worker all items: workers would
    repeat each sample, so the code shows the sharding first instead of adding workers."""
    if not unsharded(loader, change):
        return None
    settings = loader.get("settings") or {}
    workers = int(change.get("num_workers") or 0)
    where = settings.get("dataset_code") or {}
    place = f" ({location(where)})" if where else ""
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


def cache_code(loader: LoaderFacts, builder: LoopWait | None = None) -> str:
    """What to cache for a CPU-bound loader, in prose (comments): only the deterministic part
    of a sample (decoding, resizing), never the random augmentation applied after it.

    ``builder``: the loop wait (probes.stack) inside the loader's ``next()`` where its batches were
    measured being built. Where that is not the dataset's ``__getitem__`` (a ``collate_fn`` that
    tokenizes, a sampler), the code names it instead: that is where the CPU went. With torch's default
    collate the batches are the dataset's samples stacked, so a helper the samples were found in (a
    decode function ``__getitem__`` calls) is the dataset's work, and the dataset is named."""
    settings = loader.get("settings") or {}
    dataset_builds = settings.get("default_collate") is True
    if (builder is not None and not dataset_builds
            and not str(builder.get("function") or "").endswith("__getitem__")):
        share = float(builder.get("share") or 0.0)
        return "\n".join([
            f"# The batches are built {site_place(builder)}: {100 * share:.0f}% of the loop's time "
            f"({'timed' if builder.get('timed') else 'stack samples'}),",
            "# on the CPUs that are already busy. Do that work once, ahead of training (tokenize or decode the",
            "# whole dataset once and keep the result, as datasets' map() does), or make it cheaper."])
    dataset = settings.get("dataset_type") or "the dataset"
    where = settings.get("dataset_code") or {}
    place = f" ({location(where)})" if where else ""
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
