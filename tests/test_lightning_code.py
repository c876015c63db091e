"""A loader built in a LightningModule's or a LightningDataModule's ``train_dataloader``: the code a
finding offers replaces that method on the user's own instance, and the next ``Trainer.fit``
iterates a loader with the new settings and the same batches (a real Trainer, on the CPU)."""

from __future__ import annotations

import ast
import warnings
from typing import Any

import pytest
import torch

import gpuwidget
from gpuwidget.advice.code import loader_code
from gpuwidget.figures.summary import primary_loader

import frameworks

pl = pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHANGE = {"num_workers": 2, "persistent_workers": True}
BATCHES = 6  # limit_train_batches: of the 8 an epoch has, so a loader that yields too few shows


class Batches(pl.Callback):
    """The batches the Trainer hands to ``training_step``, in order."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch)


def fit(model: Any, datamodule: Any = None) -> tuple[list[Any], Any]:
    """A new Trainer, as the user's next cell makes one, fitting from seed 0: (the batches it trained
    on, the trainer)."""
    recorder = Batches()
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=BATCHES, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         callbacks=[recorder])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=datamodule)
    return recorder.seen, trainer


def codes(run: gpuwidget.Run) -> list[tuple[str, dict[str, Any]]]:
    """Every loader code the run can offer, with its change: its loader findings' and the worker change's."""
    loader = primary_loader(run.workload)
    return [(f.code, f.change) for f in frameworks.loader_findings(run)] + [
        (loader_code(loader, CHANGE, run.workload), CHANGE)]


@pytest.mark.parametrize(("case", "instance"), [("Lightning Trainer", "model"), ("Lightning datamodule", "dm")])
def test_next_fit_trains_on_the_same_batches_from_a_loader_with_the_new_settings(tmp_path, case, instance):
    namespace, run = frameworks.run_case({c.name: c for c in frameworks.cases()}[case], str(tmp_path))
    owner = namespace[instance]
    as_written = vars(type(owner))["train_dataloader"]
    for code, change in codes(run):
        assert ast.parse(code).body, f"only comments:\n{code}"
        vars(owner).pop("train_dataloader", None)  # the previous code's replacement: back to the class's
        # The reference: the user's own train_dataloader as written, through a real fit.
        before, _ = fit(namespace["model"], namespace.get("dm"))
        exec(compile(code, "<finding code>", "exec"), namespace)  # noqa: S102 - the user's paste
        after, trainer = fit(namespace["model"], namespace.get("dm"))
        used = trainer.train_dataloader
        assert used.num_workers == change.get("num_workers", 0), code
        assert used.persistent_workers == bool(change.get("persistent_workers")), code
        assert len(before) == len(after) == BATCHES and frameworks.same(before, after), code
        assert vars(type(owner))["train_dataloader"] is as_written  # the class stays as written
        frameworks.end_workers(used)


def test_lightning_module_written_in_a_cell_keeps_its_own_loader_class(ip):
    """The module, its DataLoader subclass (which needs an argument of its own) and the loop are the
    user's cells; the code keeps the subclass, whose batches are dicts, and its argument."""
    ip.run_cell("import torch, pytorch_lightning as pl\n"
                "from torch.utils.data import DataLoader\n"
                "from frameworks import SlowItems, burn\n")
    ip.run_cell("class Padded(DataLoader):\n"
                "    def __init__(self, dataset, pad, **kwargs):\n"
                "        self.pad = pad\n"
                "        super().__init__(dataset, **kwargs)\n"
                "\n"
                "    def __iter__(self):\n"
                "        for x, y in super().__iter__():\n"
                "            yield {'x': torch.nn.functional.pad(x, (0, self.pad)), 'y': y}\n", store_history=True)
    ip.run_cell("class Net(pl.LightningModule):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.layer = torch.nn.Linear(18, 4)\n"
                "\n"
                "    def training_step(self, batch, batch_idx):\n"
                "        burn(0.002)\n"
                "        return torch.nn.functional.cross_entropy(self.layer(batch['x']), batch['y'])\n"
                "\n"
                "    def configure_optimizers(self):\n"
                "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
                "\n"
                "    def train_dataloader(self):\n"
                "        return Padded(SlowItems(n=64, latency=0.003), 2, batch_size=8, shuffle=True)\n",
                store_history=True)
    ip.run_cell("net = Net()\n"
                "trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,\n"
                "                     enable_progress_bar=False, enable_model_summary=False, accelerator='cpu')\n")
    assert ip.run_cell("%%gpuwatch --quiet\ntrainer.fit(net)\n").success
    run = gpuwidget.last_run()
    loader = primary_loader(run.workload)
    assert loader["user_names"] == {"class": "Padded", "built_by": "net"}
    assert loader["settings"]["constructor"]["attributes"] == {"pad": "pad"}
    code = loader_code(loader, CHANGE, run.workload)
    assert "return Padded(loader.dataset, pad=loader.pad, batch_size=8, shuffle=True, num_workers=2" in code
    net = ip.user_ns["net"]
    before, _ = fit(net)
    result = ip.run_cell(code)
    assert result.success, result.error_in_exec
    after, trainer = fit(net)
    assert type(trainer.train_dataloader).__name__ == "Padded" and trainer.train_dataloader.num_workers == 2
    assert before[0]["x"].shape == (8, 18) and frameworks.same(before, after)
    frameworks.end_workers(trainer.train_dataloader)
