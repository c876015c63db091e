""""Since the previous run of this cell": only between runs of one cell (its id) on the same data.

The magic runs in the in-process IPython shell with the cell ids a front-end sends (JupyterLab's
``cellId``, which ipykernel hands to ``run_cell``); the loops are tiny real ones over real loaders.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpuwidget
from gpuwidget.report import comparison_line, run_text

CELL = "%%gpuwatch --quiet --no-advice\nfor x, y in net_loader:\n    (x * 2).sum()\n"


def loader(items: int = 64, features: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(items, features), torch.zeros(items)), batch_size=8)


def test_a_cell_is_compared_with_its_own_previous_run_and_never_with_another_cell_of_the_same_text(ip):
    ip.user_ns["net_loader"] = loader()
    ip.run_cell(CELL, cell_id="cell-a")
    first = gpuwidget.last_run()
    ip.run_cell(CELL, cell_id="cell-b")  # the same text in another cell (tutorial 02 has four such)
    other = gpuwidget.last_run()
    assert other.previous is None and comparison_line(other) is None
    assert "Since the previous run" not in run_text(other)
    ip.run_cell(CELL, cell_id="cell-a")
    again = gpuwidget.last_run()
    assert again.previous is first
    assert comparison_line(again).startswith("Since the previous run of this cell: ")


def test_without_a_cell_id_identical_text_is_compared_with_nothing(ip):
    ip.user_ns["net_loader"] = loader()
    ip.run_cell(CELL)
    ip.run_cell(CELL)  # a console, nbclient: no cell id, so no sign that it is the same cell
    assert gpuwidget.last_run().previous is None


def test_the_same_cell_over_other_data_is_compared_with_nothing(ip):
    ip.user_ns["net_loader"] = loader(items=64)
    ip.run_cell(CELL, cell_id="cell-c")
    ip.user_ns["net_loader"] = loader(items=96)  # another dataset bound to the same name
    ip.run_cell(CELL, cell_id="cell-c")
    assert gpuwidget.last_run().previous is None
    # The same data with other loader settings is the same loader (the change the advice suggests).
    dataset = ip.user_ns["net_loader"].dataset
    ip.user_ns["net_loader"] = DataLoader(dataset, batch_size=16)
    ip.run_cell(CELL, cell_id="cell-c")
    assert gpuwidget.last_run().previous is not None


def test_watch_blocks_in_two_cells_of_the_same_text_are_not_compared(ip):
    ip.user_ns["net_loader"] = loader()
    block = ("import gpuwidget\nwith gpuwidget.watch(quiet=True, advice=False):\n"
             "    for x, y in net_loader:\n        (x * 2).sum()\n")
    ip.run_cell(block, cell_id="cell-d")
    first = gpuwidget.last_run()
    ip.run_cell(block, cell_id="cell-e")  # IPython names both cells' code after their text: one file
    assert gpuwidget.last_run().previous is None
    ip.run_cell(block, cell_id="cell-d")
    assert gpuwidget.last_run().previous is first
