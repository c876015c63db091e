"""The user's own loader classes, batch samplers and collate functions survive the code a finding
offers: each loader is written in notebook cells (a real IPython shell), watched with ``%%gpuwatch``,
and the code is run as a cell; the loader it builds is compared with the original, batch by batch.

A DataLoader subclass is built again as its own class where its constructor takes the DataLoader
arguments; where it cannot be, the code is comments that say, at the line that built the loader,
what to add, and running them changes nothing."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import pytest
from torch.utils.data import DataLoader

import gpuwidget
from gpuwidget.advice.code import loader_code
from gpuwidget.figures.summary import primary_loader

import frameworks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHANGE = {"num_workers": 2, "persistent_workers": True}
IMPORTS = ("import torch\nfrom torch.utils.data import DataLoader, Sampler\n"
           "from frameworks import SlowItems, burn\ntrain_ds = SlowItems(n=64, latency=0.002)\n")
LOOP = ("%%gpuwatch --quiet\n"
        "for batch in train_loader:\n"
        "    x = batch['x'] if isinstance(batch, dict) else batch[0]\n"
        "    burn(0.002)\n")
# Loader classes as people write them in a notebook: each yields dict batches, so a plain
# DataLoader in its place would break the loop's batch['x'].
CLASSES = '''class DictLoader(DataLoader):
    """No constructor of its own: it takes whatever DataLoader takes."""
    def __iter__(self):
        for x, y in super().__iter__():
            yield {"x": x, "y": y}

class KwargsLoader(DictLoader):
    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)

class ScaledLoader(DataLoader):
    """An argument of its own, kept as an attribute, and a collate function it sets itself."""
    def __init__(self, dataset, scale, **kwargs):
        self.scale = scale
        super().__init__(dataset, collate_fn=self.collate, **kwargs)

    def collate(self, items):
        return {"x": torch.stack([x for x, _ in items]) * self.scale, "y": torch.stack([y for _, y in items])}

class Forgetful(DictLoader):
    """Takes the DataLoader arguments but keeps its own nowhere."""
    def __init__(self, dataset, scale, **kwargs):
        super().__init__(dataset, **kwargs)

class Closed(DictLoader):
    """Takes no DataLoader argument but the batch size."""
    def __init__(self, dataset, batch_size=8):
        super().__init__(dataset, batch_size=batch_size, shuffle=True)

class Flipping(DictLoader):
    """An optional argument of its own, kept nowhere: only its default can be rebuilt."""
    def __init__(self, dataset, flip=False, **kwargs):
        super().__init__(dataset, **kwargs)

class Buckets(Sampler):
    """A batch sampler: batches of indices with the same remainder mod 4, odd sizes."""
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        for r in range(4):
            indices = list(range(r, self.n, 4))
            yield from (indices[i:i + 5] for i in range(0, len(indices), 5))
    def __len__(self):
        return sum((len(range(r, self.n, 4)) + 4) // 5 for r in range(4))

def as_dict(items):
    return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}
'''


@dataclass
class Shape:
    """One way the user built ``train_loader`` (a cell), and what the code must do."""

    built: str
    says: str  # in the code
    rebuilt: bool  # the code builds a new loader (else: comments only)


SHAPES = {
    "subclass without a constructor": Shape(
        "train_loader = DictLoader(train_ds, batch_size=8, shuffle=True)",
        "train_loader = DictLoader(train_ds, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)",
        True),
    "subclass with **kwargs": Shape(
        "train_loader = KwargsLoader(train_ds, batch_size=8, drop_last=True)",
        "train_loader = KwargsLoader(train_ds, batch_size=8, drop_last=True, num_workers=2", True),
    "subclass with its own required argument and collate": Shape(
        "train_loader = ScaledLoader(train_ds, 3.0, batch_size=8, shuffle=True)",
        "train_loader = ScaledLoader(train_ds, scale=train_loader.scale, batch_size=8, shuffle=True, num_workers=2",
        True),
    "subclass left to its optional argument's default": Shape(
        "train_loader = Flipping(train_ds, batch_size=8)",
        "train_loader = Flipping(train_ds, batch_size=8, num_workers=2", True),
    "custom batch_sampler": Shape(
        "buckets = Buckets(64)\ntrain_loader = DataLoader(train_ds, batch_sampler=buckets)",
        "train_loader = DataLoader(train_ds, batch_sampler=buckets, num_workers=2", True),
    "custom collate_fn": Shape(
        "train_loader = DataLoader(train_ds, batch_size=8, shuffle=True, collate_fn=as_dict)",
        "train_loader = DataLoader(train_ds, batch_size=8, shuffle=True, collate_fn=as_dict, num_workers=2", True),
    "collate_fn no name holds": Shape(
        "train_loader = DataLoader(train_ds, batch_size=8, collate_fn=lambda items: as_dict(items))",
        "collate_fn=train_loader.collate_fn, num_workers=2", True),
    "subclass that keeps its own argument nowhere": Shape(
        "train_loader = Forgetful(train_ds, 3.0, batch_size=8)",
        "which no attribute of the loader keeps,\n# so it cannot be built again here",
        False),
    "subclass that takes no DataLoader arguments": Shape(
        "train_loader = Closed(train_ds)",
        "does not pass num_workers on to DataLoader,\n", False),
    "subclass given its optional argument": Shape(
        "train_loader = Flipping(train_ds, True, batch_size=8)",
        ") takes flip, whose value the loader does not keep,\n", False),
}


def batches(loader: Any) -> list[Any]:
    return frameworks.batches(loader)


@pytest.fixture
def cells(ip: Any) -> Any:
    """Run the imports and the classes as two cells; returns the cell number the classes ran in."""
    assert ip.run_cell(IMPORTS, store_history=True).success
    assert ip.run_cell(CLASSES, store_history=True).success
    return ip.execution_count - 1


def watch(ip: Any, built: str) -> tuple[gpuwidget.Run, int]:
    """Build the loader in a cell of its own, then watch the loop: (the run, the building cell's number)."""
    assert ip.run_cell(built, store_history=True).success
    cell = ip.execution_count - 1
    assert ip.run_cell(LOOP, store_history=True).success
    return gpuwidget.last_run(), cell


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_code_for_a_users_loader_class_runs_as_a_cell_and_keeps_the_batches(ip, cells, shape):
    expected = SHAPES[shape]
    run, cell = watch(ip, expected.built)
    loader = primary_loader(run.workload)
    # Where the user built it, not the subclass's super().__init__ line.
    assert loader["built_at"]["cell"] == cell and loader["built_at"]["function"] == "<module>"
    original = ip.user_ns["train_loader"]
    before = batches(original)
    found = [(f.code, f.change) for f in frameworks.loader_findings(run)]
    for code, change in [(loader_code(loader, CHANGE, run.workload), CHANGE), *found]:
        ip.user_ns["train_loader"] = original
        result = ip.run_cell(code)
        assert result.success, f"{code}\nraised {result.error_in_exec!r}"
        rebuilt = ip.user_ns["train_loader"]
        if not expected.rebuilt:
            assert not ast.parse(code).body and rebuilt is original, code
            continue
        assert rebuilt is not original and type(rebuilt) is type(original), code
        assert rebuilt.num_workers == change.get("num_workers", 0), code
        assert frameworks.same(before, batches(rebuilt)), f"{code}\nchanged the batches"
        frameworks.end_workers(rebuilt)
    code = loader_code(loader, CHANGE, run.workload)
    assert expected.says in code, code
    ip.user_ns["train_loader"] = original


def test_a_class_that_cannot_be_rebuilt_is_told_what_to_add_at_the_line_that_built_it(ip, cells):
    run, cell = watch(ip, "train_loader = Closed(train_ds)")
    code = loader_code(primary_loader(run.workload), CHANGE, run.workload)
    init_line = CLASSES.splitlines().index("    def __init__(self, dataset, batch_size=8):") + 1
    assert code == (f"# train_loader is a Closed; its __init__ (cell In [{cells}], line {init_line}) does not pass "
                    "num_workers on to DataLoader,\n"
                    "# so it cannot be built again here without losing what Closed does.\n"
                    f"# Where it is built, at line 1 of cell In [{cell}], pass num_workers=2, "
                    "persistent_workers=True,\n"
                    "# and have Closed.__init__ hand them to DataLoader: take **kwargs and call\n"
                    "# super().__init__(..., **kwargs).")

    run, cell = watch(ip, "train_loader = Forgetful(train_ds, 3.0, batch_size=8)")
    code = loader_code(primary_loader(run.workload), CHANGE, run.workload)
    assert code.endswith(f"# Where it is built, at line 1 of cell In [{cell}], build it as\n"
                         "#     Forgetful(train_ds, 3.0, batch_size=8, num_workers=2, persistent_workers=True)")


def test_a_class_no_name_holds_is_called_as_the_loaders_type(ip, cells):
    """A library's loader class, or one made inside a function: ``type(train_loader)`` calls it."""
    assert ip.run_cell("def build():\n"
                       "    class Hidden(DictLoader):\n"
                       "        pass\n"
                       "    return Hidden(train_ds, batch_size=8, shuffle=True)\n"
                       "train_loader = build()\n", store_history=True).success
    assert ip.run_cell(LOOP).success
    run = gpuwidget.last_run()
    loader = primary_loader(run.workload)
    code = loader_code(loader, CHANGE, run.workload)
    assert code == ("train_loader = type(train_loader)(train_ds, batch_size=8, shuffle=True, num_workers=2, "
                    "persistent_workers=True)")
    original = ip.user_ns["train_loader"]
    assert ip.run_cell(code).success
    rebuilt = ip.user_ns["train_loader"]
    assert type(rebuilt) is type(original) and frameworks.same(batches(original), batches(rebuilt))
    frameworks.end_workers(rebuilt)


def test_a_subclass_built_in_a_function_is_changed_at_its_call(ip, cells):
    assert ip.run_cell("def make_loader():\n    return KwargsLoader(train_ds, batch_size=8)\n",
                       store_history=True).success
    cell = ip.execution_count - 1
    assert ip.run_cell("%%gpuwatch --quiet\nfor batch in make_loader():\n    burn(0.002)\n").success
    run = gpuwidget.last_run()
    code = loader_code(primary_loader(run.workload), CHANGE, run.workload)
    assert code == (f"# This DataLoader is built in make_loader() (cell In [{cell}], line 2); build it there as\n"
                    "#     KwargsLoader(train_ds, batch_size=8, num_workers=2, persistent_workers=True)")
    assert ip.run_cell(code).success


def test_the_tuners_loader_keeps_the_users_class(ip, cells):
    from gpuwidget.measure.tuner import tune_for_run
    from gpuwidget.probes.constructor import rebuild_loader

    run, _ = watch(ip, "train_loader = ScaledLoader(train_ds, 3.0, batch_size=8, shuffle=True)")
    original = ip.user_ns["train_loader"]
    result = tune_for_run(run, original, budget_s=3)
    for rebuilt in (result.loader(), rebuild_loader(original, CHANGE)):
        assert type(rebuilt).__name__ == "ScaledLoader" and rebuilt.scale == 3.0
        assert frameworks.same(batches(original), batches(rebuilt))
        frameworks.end_workers(rebuilt)
    assert result.loader().num_workers == result.change.get("num_workers", 0)

    run, _ = watch(ip, "train_loader = Closed(train_ds)")
    with pytest.raises(TypeError, match="Closed cannot be built again .* does not pass num_workers on"):
        rebuild_loader(ip.user_ns["train_loader"], CHANGE)
    run, _ = watch(ip, "train_loader = Flipping(train_ds, True, batch_size=8)")
    flipping = ip.user_ns["train_loader"]
    with pytest.raises(TypeError, match="takes flip, whose values the loader does not keep"):
        rebuild_loader(flipping, CHANGE, primary_loader(run.workload)["built_at"])


# --------------------------------------------------------------------------- constructors, read from their source


class Renamed(DataLoader):
    """Its own names for the DataLoader arguments, handed on positionally and by keyword."""

    def __init__(self, data, size, workers=0):
        super().__init__(data, size, num_workers=workers)


class Forwarding(DataLoader):
    def __init__(self, *args, **kwargs):
        DataLoader.__init__(self, *args, **kwargs)


class SingleProcess(DataLoader):
    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, num_workers=0, **kwargs)


class Layered(Forwarding):
    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)


class Opaque(DataLoader):
    def __init__(self, dataset, options):
        super().__init__(dataset, **options)


@pytest.mark.parametrize(("built", "arguments", "taken"), [
    (lambda ds: Renamed(ds, 8), {"batch_size": 8, "num_workers": 2}, {"size": 8, "workers": 2}),
    (lambda ds: Forwarding(ds, batch_size=8, shuffle=True), {"shuffle": True, "num_workers": 2},
     {"shuffle": True, "num_workers": 2}),
    (lambda ds: SingleProcess(ds, batch_size=8), {"batch_size": 8, "num_workers": 0, "pin_memory": True},
     {"batch_size": 8, "pin_memory": True}),  # num_workers: it sets that itself, unchanged
])
def test_a_constructor_is_called_under_its_own_parameter_names(built, arguments, taken):
    from gpuwidget.probes.constructor import constructor_call, constructor_facts, rebuild_loader

    original = built(frameworks.SlowItems(n=32, latency=0))
    change = {key: value for key, value in arguments.items() if key in ("num_workers", "pin_memory") and value}
    plan = constructor_call(constructor_facts(original), {"dataset": "ds", **arguments}, set(change))
    assert not isinstance(plan, str), plan
    assert plan.keywords == taken and plan.dataset == "ds" and plan.dataset_keyword is None
    rebuilt = rebuild_loader(original, change)
    assert type(rebuilt) is type(original) and frameworks.same(batches(original), batches(rebuilt))
    assert all(getattr(rebuilt, key) == value for key, value in change.items())
    frameworks.end_workers(rebuilt)


@pytest.mark.parametrize(("built", "reason"), [
    (lambda ds: SingleProcess(ds, batch_size=8), "its __init__ sets num_workers itself"),
    (lambda ds: Layered(ds, batch_size=8), "its __init__ hands its arguments to another class's __init__"),
    (lambda ds: Opaque(ds, {"batch_size": 8}), "keyword arguments that cannot be followed"),
])
def test_a_constructor_that_cannot_take_the_change_says_why(built, reason):
    from gpuwidget.probes.constructor import constructor_call, constructor_facts, rebuild_loader

    original = built(frameworks.SlowItems(n=32, latency=0))
    plan = constructor_call(constructor_facts(original), {"dataset": "ds", "num_workers": 2}, {"num_workers"})
    assert isinstance(plan, str) and reason in plan
    with pytest.raises(TypeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        rebuild_loader(original, {"num_workers": 2})
