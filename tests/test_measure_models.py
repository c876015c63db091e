"""Run.measure on real training loops (CPU): an MLP, a small conv net, a tiny GPT-2 from a config and a
LightningModule under a real Trainer. Every change key on each: the user's state left bitwise as it was,
the numerics reported, and the verdict checked against the test's own timing of the same change."""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gpuwidget
from gpuwidget.measure.ab import MIN_BLOCKS
from gpuwidget.measure.preserve import backend_flags
from gpuwidget.measure.sides import MeasureError

BUDGET_S = 3.0


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Timing on a shared two-core machine: the loops' math on one core (conftest), theirs and the test's."""


@dataclass
class Case:
    name: str
    run: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any  # what the test's own step takes
    step: Callable[[nn.Module, Any], torch.Tensor]  # the loop's loss, for the test's own timing
    loss_kind: str
    samples: int


def mlp_case() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    features, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(12):
            x, y = features, labels
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return Case("mlp", run, model, optimizer, (features, labels), lambda m, b: criterion(m(b[0]), b[1]),
                "criterion(output, y)", 32)


def conv_case() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(12):
            loss = nn.functional.cross_entropy(model(images), labels)  # no loss object: the loss is guessed
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return Case("conv", run, model, optimizer, (images, labels),
                lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), "cross_entropy(output, labels), guessed", 8)


def gpt2_case() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (4, 16))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(10):
            batch = {"input_ids": ids, "labels": ids}
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return Case("gpt2", run, model, optimizer, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss,
                "the model's own loss", 4)


def lightning_case() -> Case:
    import pytorch_lightning as pl
    from torch.utils.data import TensorDataset

    from frameworks import FEATURES, lightning_module

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(160, FEATURES), torch.randint(0, 4, (160,)))
    model = lightning_module(data)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    with gpuwidget.watch(quiet=True) as run:
        trainer.fit(model)
    batch = next(iter(model.train_dataloader()))
    return Case("lightning", run, model, trainer.optimizers[0], batch, lambda m, b: m.training_step(b, 0),
                "training_step", 8)


CASES = {"mlp": mlp_case, "conv": conv_case, "gpt2": gpt2_case, "lightning": lightning_case}


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]()


# --------------------------------------------------------------------------- what must not change


def snapshot(case: Case) -> dict[str, Any]:
    model, optimizer = case.model, case.optimizer
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
        "flags": backend_flags(),
        "training": model.training,
        "compiled": hasattr(model, "_orig_mod"),
    }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def assert_unchanged(case: Case, before: dict[str, Any]) -> None:
    after = snapshot(case)
    for key in before:
        assert equal(before[key], after[key]), f"{case.name}: the user's {key} changed"


# --------------------------------------------------------------------------- the test's own timing


def own_step(case: Case, change: dict[str, Any]) -> tuple[Callable[[], None], int]:
    """The change applied by hand to a copy, as a user trying it would: (one step, samples per step)."""
    model, optimizer = copy.deepcopy((case.model, case.optimizer))
    optimizer.__dict__.pop("step", None)
    batch, samples = case.batch, case.samples
    if change.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t

        batch = ({k: convert(v) for k, v in batch.items()} if isinstance(batch, dict)
                 else type(batch)(convert(t) for t in batch))
    if change.get("fused_optimizer"):
        groups = [{"params": g["params"]} for g in optimizer.param_groups]
        optimizer = type(optimizer)(groups, fused=True, lr=optimizer.param_groups[0]["lr"])
    if "batch_size" in change:
        size = change["batch_size"]
        rows = torch.arange(size) % samples
        batch = ({k: v[rows] for k, v in batch.items()} if isinstance(batch, dict)
                 else type(batch)(t[rows] for t in batch))
        samples = size
    forward = torch.compile(model) if change.get("compile") else model
    autocast = change.get("autocast")

    def step() -> None:
        with torch.autocast("cpu", dtype=getattr(torch, autocast or "bfloat16"), enabled=autocast is not None):
            loss = case.step(forward, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, samples


def own_ratio(case: Case, change: dict[str, Any], steps: int = 15, least_s: float = 0.3,
              most: int = 500) -> float:
    """Throughput changed / unchanged from interleaved steps, each side's fastest (its own cost; the slower
    ones carry the machine's load): at least ``steps`` a side and ``least_s`` of them, at most ``most``.
    Fifteen fast steps were too few on a loaded host: one side's fastest of them read 1.28x the other's
    on a change that does nothing on the CPU (8 tries); a hundred read within 1.5%."""
    unchanged, samples_a = own_step(case, {})
    changed, samples_b = own_step(case, change)
    for step in (unchanged, changed, unchanged, changed):
        step()
    best = {"a": math.inf, "b": math.inf}
    spent = {"a": 0.0, "b": 0.0}
    taken = 0
    while taken < most and (taken < steps or min(spent.values()) < least_s):
        for key, step in (("a", unchanged), ("b", changed)):
            began = time.perf_counter()
            step()
            took = time.perf_counter() - began
            best[key], spent[key] = min(best[key], took), spent[key] + took
        taken += 1
    return (samples_b / best["b"]) / (samples_a / best["a"])


def assert_verdict_agrees(measured: Any, ratio: float) -> None:
    if ratio < 0.9:
        assert measured.verdict != "faster", f"measured {measured!r}; the test's own timing: {ratio:.2f}x"
    if ratio > 1.1:
        assert measured.verdict != "slower", f"measured {measured!r}; the test's own timing: {ratio:.2f}x"


# --------------------------------------------------------------------------- every key on every model


def batch_change(case: Case) -> dict[str, Any]:
    return {"batch_size": case.samples // 2}


UNCOMPILED = [{"autocast": "bfloat16"}, {"autocast": "float16"}, {"tf32": True}, {"channels_last": True},
              {"fused_optimizer": True}, "batch"]


@pytest.mark.parametrize("change", UNCOMPILED, ids=lambda c: c if isinstance(c, str) else next(iter(c)))
def test_every_change_is_measured_on_a_copy_with_numerics(case, change):
    change = batch_change(case) if change == "batch" else change
    before = snapshot(case)
    measured = case.run.measure(change, budget_s=BUDGET_S)
    assert_unchanged(case, before)
    assert measured.loss == case.loss_kind
    assert measured.blocks >= 1 and measured.speedup is not None and measured.ci is not None
    assert measured.ci[0] <= measured.speedup <= measured.ci[1]
    assert measured.verdict in ("faster", "slower", "no difference")
    # The same steps from the same state: bfloat16 and float16 round; micro-batches have batch norm's
    # statistics of their own rows; a GradScaler that skipped a step (overflow) took fewer updates.
    loss_diff, grad_diff = measured.numerics["loss_rel_diff"], measured.numerics["grad_rel_diff"]
    assert loss_diff is not None and grad_diff is not None
    skipped = any("GradScaler skipped" in note for note in measured.notes)
    if not skipped:
        assert loss_diff < (0.05 if "autocast" in change or "batch_size" in change else 1e-3)
    no_op = "tf32" in change or "channels_last" in change and case.name != "conv"
    if no_op:
        assert loss_diff == 0.0 and grad_diff == 0.0  # nothing changed on the CPU
    assert measured.peak_memory_ratio is None and any("peak memory" in n for n in measured.notes)
    if "tf32" in change:
        assert measured.verdict == "no difference"  # the sides ran the same code on the CPU, whatever the timing
    elif not no_op:
        # Against a change that does nothing, the test's timing and the measurement both time noise: a 95%
        # interval then excludes 1 now and then by design (tests/test_measure_stats.py keeps that under 5%).
        assert_verdict_agrees(measured, own_ratio(case, change))
    # Renders like the tuner's results.
    bundle = measured._repr_mimebundle_()
    assert measured.verdict in bundle["text/plain"] and "gpuwidget-measurement" in bundle["text/html"]
    assert measured.to_dict()["verdict"] == measured.verdict


def test_tf32_on_the_cpu_is_an_a_a_test_and_no_difference():
    case = mlp_case()
    measured = case.run.measure({"tf32": True}, budget_s=6)
    assert measured.verdict == "no difference", measured.text()
    assert measured.blocks == MIN_BLOCKS and measured.elapsed_s < 6  # six blocks of the machine's noise, then done
    assert any("on the CPU it changes nothing" in note for note in measured.notes)


def test_a_far_smaller_batch_is_measured_slower_and_not_recommended():
    case = mlp_case()
    change = {"batch_size": 2}  # 16 accumulated micro-batches of 2 where the loop took 32 at once
    measured = case.run.measure(change, budget_s=8)
    ratio = own_ratio(case, change)
    assert ratio < 0.9
    assert measured.verdict == "slower", measured.text()
    assert measured.ci[1] < 1.0
    assert "not recommended" in measured.verdict_line()
    assert any("16 micro-batches accumulated" in note for note in measured.notes)


def test_a_larger_batch_of_a_step_bound_by_overhead_is_faster():
    case = mlp_case()
    measured = case.run.measure({"batch_size": 256}, budget_s=8)
    assert own_ratio(case, {"batch_size": 256}) > 1.1
    assert measured.verdict == "faster", measured.text()
    # Compared with 8 accumulated batches of 32 over the same samples: the same update.
    assert measured.numerics["loss_rel_diff"] < 1e-4


def test_a_loaded_machine_is_said_to_be_a_measurement_of_what_it_measured():
    """The first lines say what was measured against what: the change, the verdict and the interval."""
    case = mlp_case()
    measured = case.run.measure({"fused_optimizer": True}, budget_s=BUDGET_S)
    text = measured.text().splitlines()[0]
    assert text.startswith("fused_optimizer: ") and "[" in text
    assert any(note.startswith("optimizer: AdamW(fused=True)") for note in measured.notes)


# --------------------------------------------------------------------------- before anything runs


def test_bad_keys_and_values_raise_before_anything_runs(monkeypatch):
    case = mlp_case()
    import gpuwidget.measure.ab as ab

    def never(*args: Any) -> Any:
        raise AssertionError("a copy was made for a change that was refused")

    monkeypatch.setattr(ab, "copy_training", never)
    for change in ({"autocast": "fp8"}, {"speed": 2}, {"batch_size": -4}, {"compile": "fastest"}, {}):
        with pytest.raises(ValueError):
            case.run.measure(change)
    with pytest.raises(ValueError, match="budget_s"):
        case.run.measure({"tf32": True}, budget_s=0)
    with pytest.raises(ValueError, match="step must be a function"):
        case.run.measure({"tf32": True}, step="loss")


def test_a_run_without_training_says_what_it_lacks():
    model = nn.Linear(4, 2)
    with gpuwidget.watch(quiet=True) as run, torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
    with pytest.raises(MeasureError, match="no optimizer stepped"):
        run.measure({"autocast": "bfloat16"})
    loaded = gpuwidget.Run.from_dict(run.to_dict())
    with pytest.raises(MeasureError, match="not in this process"):
        loaded.measure({"autocast": "bfloat16"})


# --------------------------------------------------------------------------- the loss


def test_an_explicit_step_function_overrides_the_loss_found():
    case = mlp_case()
    calls = []

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        calls.append(type(batch).__name__)
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)

    measured = case.run.measure({"fused_optimizer": True}, budget_s=2, step=step)
    assert measured.loss == "step=" and calls and set(calls) == {"tuple"}
    assert measured.numerics["loss_rel_diff"] is not None


def test_without_a_loss_or_a_target_a_stand_in_is_timed_and_numerics_not_compared():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train() -> None:
        for _ in range(6):
            model(torch.randn(8, 16)).pow(2).mean().backward()  # no target held anywhere
            optimizer.step()
            optimizer.zero_grad()

    with gpuwidget.watch(quiet=True) as run:
        train()
    measured = run.measure({"fused_optimizer": True}, budget_s=2)
    assert measured.loss.startswith("stand-in")
    assert measured.numerics == {"loss_rel_diff": None, "grad_rel_diff": None}
    assert any("stand-in loss" in note for note in measured.notes)


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_mid_measurement_restores_everything_and_returns_the_blocks_so_far():
    case = mlp_case()
    before = snapshot(case)
    blocks = []

    def progress(line: str, elapsed: float) -> None:
        if "blocks" in line:
            blocks.append(line)
            if len(blocks) == 7:
                raise KeyboardInterrupt

    measured = case.run.measure({"autocast": "bfloat16"}, budget_s=30, progress=progress)
    assert measured.interrupted and measured.blocks == 7
    assert measured.elapsed_s < 30
    assert measured.speedup is not None and measured.verdict in ("faster", "slower", "no difference")
    assert any("interrupted after 7 block(s)" in note for note in measured.notes)
    assert_unchanged(case, before)


def test_ctrl_c_before_any_block_returns_no_figures_and_restores():
    case = mlp_case()
    before = snapshot(case)

    def progress(line: str, elapsed: float) -> None:
        raise KeyboardInterrupt  # at the first thing it tells: the numerics

    measured = case.run.measure({"tf32": True}, budget_s=30, progress=progress)
    assert measured.interrupted and measured.blocks == 0
    assert measured.speedup is None and measured.verdict == "no difference"
    assert measured.short() == "not measured (interrupted)"
    assert_unchanged(case, before)


# --------------------------------------------------------------------------- compile (slow)


@pytest.mark.slow
def test_compile_measures_a_copy_and_reports_the_compile_time_apart():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    case = mlp_case()
    before = snapshot(case)
    forward_code = type(case.model).forward.__code__
    entries = len(_debug_get_cache_entry_list(forward_code))
    measured = case.run.measure({"compile": True}, budget_s=20)
    assert_unchanged(case, before)
    assert not hasattr(case.model, "_orig_mod")
    # The copy's compiled entries are gone from the model class's code: the user's compile starts clean.
    assert len(_debug_get_cache_entry_list(forward_code)) == entries
    assert measured.compile_s is not None and measured.compile_s > 0
    assert any(note.startswith(f"compiled in {measured.compile_s:.1f} s") for note in measured.notes)
    assert any(note.startswith("graph breaks: ") for note in measured.notes)
    # The MLP's dropout draws its masks from inductor's own generator once compiled: not eager's masks.
    assert measured.numerics["loss_rel_diff"] < 0.05
    assert measured.blocks >= 1
    assert_verdict_agrees(measured, own_ratio(case, {"compile": True}))
