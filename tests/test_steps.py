"""The training loop from its optimizer's steps: counted whatever feeds it, the loader chosen by what
trains, a loader rebuilt each epoch as one loop, and nothing left behind."""

from __future__ import annotations

import copy
import io
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils.data import DataLoader, TensorDataset

import gpuwidget
from gpuwidget.figures.summary import primary_loader
from gpuwidget.probes import BETWEEN_STEPS_SPAN, TRAIN_STEP_SPAN
from gpuwidget.probes.torch_steps import FLOPS_AT_STEP, DtypeFlopCounter
from gpuwidget.report import main_cause

torch.manual_seed(0)


class Student(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def nothing_left() -> None:
    assert not optim_module._global_optimizer_post_hooks and not optim_module._global_optimizer_pre_hooks
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert torch._C._len_torch_dispatch_stack() == 0  # no FLOP counter still entered


def test_a_get_batch_loop_without_a_dataloader_counts_its_optimizer_steps():
    """nanoGPT's shape: random slices of a token array, 'storage' that takes 4 ms per batch."""
    tokens = torch.randint(0, 50, (5000,))
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 8, 50))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(tokens) - 9, (12,))
        time.sleep(0.004)  # the storage read
        x = torch.stack([tokens[i:i + 8] for i in starts])
        return x, tokens[starts + 8]

    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(40):
            train_step(model, optimizer, *get_batch())
    summary = run.summary
    assert summary["step_source"] == "optimizer" and summary["steps"] == 40
    assert summary["samples"] == 40 * 12
    assert summary["samples_per_s"] == pytest.approx(12 * summary["steps_per_s"])
    assert summary["step_time_p50"] >= 0.004  # every step waited on its storage read
    assert "no training loop seen" not in main_cause(run)
    assert len(run.trace.spans(TRAIN_STEP_SPAN)) == 40
    # Each of the first steps' waits, then one per sampler tick (the window that tick opened).
    between = run.trace.spans(BETWEEN_STEPS_SPAN)
    assert 1 + FLOPS_AT_STEP <= len(between) <= 39
    # The wait between one step's end and the next forward is the batch fetch: at least its sleep.
    assert min(span.duration for span in between) >= 0.004
    training = run.workload["training"]
    assert training["between_s"] == pytest.approx(sum(span.duration for span in between))
    assert training["between_spans"] == len(between) and training["forwards_sampled"] is True
    assert run.workload["model"]["class"] == "Sequential"
    nothing_left()


def manual_sgd_loop(steps: int, update: str) -> tuple[gpuwidget.Run, int]:
    """PyTorch's word_language_model without ``--use-optimizer``: its batches from ``get_batch``, the
    model's gradients cleared by ``model.zero_grad()`` and its parameters updated by hand; an
    evaluation under ``no_grad`` after every 10 steps."""
    tokens = torch.randint(0, 50, (5000,))
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 8, 50))

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)  # the storage read
        rows = torch.stack([tokens[j:j + 9] for j in range(i * 12, i * 12 + 12)])
        return rows[:, :8], rows[:, 8]

    evaluations = 0
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for i in range(steps):
            x, y = get_batch(i)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if update == "data":
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)  # .data: no version counter moves
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            if i % 10 == 9:
                model.eval()
                with torch.no_grad():
                    model(get_batch(0)[0])
                evaluations += 1
                model.train()
    return run, evaluations


@pytest.mark.parametrize("update", ["data", "no_grad"])
def test_a_loop_that_updates_its_parameters_itself_counts_a_step_per_training_forward(update):
    run, evaluations = manual_sgd_loop(40, update)
    summary, training = run.summary, run.workload["training"]
    assert evaluations == 4  # the evaluations' forwards ran under no_grad: none of them is a step
    assert summary["step_source"] == training["step_source"] == "forward" and summary["steps"] == 40
    assert summary["samples"] == 40 * 12
    assert "optimizer_steps" not in summary and "no optimizer steps the model" in summary["mfu_missing"]
    # A step runs from one training forward to the next: the batch's read, the update, an evaluation
    # are in it; the last step (its forward to the loop's end) has no end to span.
    spans = run.trace.spans(TRAIN_STEP_SPAN)
    assert len(spans) == 39 and training["spanned_steps"] == 39
    assert min(span.duration for span in spans) >= 0.002 and not run.trace.spans(BETWEEN_STEPS_SPAN)
    assert run.workload["model"]["class"] == "Sequential"
    nothing_left()


def test_a_model_called_with_gradients_but_never_updated_has_no_steps():
    """Inference without ``no_grad`` (a common slip) changes no parameter: no training loop."""
    model = Student()
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(20):
            model(torch.randn(8, 16)).sum()
    assert run.workload["training"] is None and not run.summary.get("steps")
    nothing_left()


def test_a_generator_fed_loop_is_counted_too():
    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield torch.randn(8, 16), torch.randint(0, 4, (8,))

    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = batches()
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(25):
            train_step(model, optimizer, *next(stream))
    assert run.summary["steps"] == 25 and run.summary["step_source"] == "optimizer"
    assert run.workload["training"]["samples_per_step"] == 8


def test_validation_iterator_kept_open_is_not_the_training_loop():
    """Lightning's sanity check: two batches of a validation iterator kept alive, then 60 training steps."""
    val_loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))), batch_size=16)
    train_loader = DataLoader(TensorDataset(torch.randn(480, 16), torch.randint(0, 4, (480,))), batch_size=8)
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:  # the names: this function's locals
        val_batches = iter(val_loader)
        with torch.no_grad():
            for _ in range(2):
                model(next(val_batches)[0])
        for x, y in train_loader:
            train_step(model, optimizer, x, y)
    loaders = {loader["name"]: loader for loader in run.workload["loaders"]}
    # The kept-open iterator was in its loop for the whole run: by loop time alone it would win.
    assert loaders["val_loader"]["loop_time_s"] > loaders["train_loader"]["loop_time_s"]
    assert loaders["val_loader"]["steps_fed"] == 0 and loaders["train_loader"]["steps_fed"] == 60
    assert primary_loader(run.workload)["name"] == "train_loader"
    assert run.summary["steps"] == 60 and run.summary["loader"] == "train_loader"
    assert run.summary["step_source"] == "dataloader"
    del val_batches


def test_loader_rebuilt_each_epoch_counts_every_epoch():
    dataset = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(3):
            loader = DataLoader(dataset, batch_size=4, shuffle=True)
            for x, y in loader:
                train_step(model, optimizer, x, y)
    (facts,) = run.workload["loaders"]
    assert facts["epochs"] == 3 and facts["steps"] == 192 and facts["steps_fed"] == 192
    assert run.summary["steps"] == 192 and run.summary["samples"] == 768


def test_loaders_over_other_data_or_settings_stay_apart():
    dataset = TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in DataLoader(dataset, batch_size=4):
            pass
        for _ in DataLoader(dataset, batch_size=8):
            pass
        for _ in DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=4):
            pass
    assert sorted(loader["steps"] for loader in run.workload["loaders"]) == [4, 8, 8]


def test_gradient_accumulation_keeps_the_loaders_steps_and_counts_the_optimizers():
    loader = DataLoader(TensorDataset(torch.randn(160, 16), torch.randint(0, 4, (160,))), batch_size=4)
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for index, (x, y) in enumerate(loader):
            (nn.functional.cross_entropy(model(x), y) / 4).backward()
            if index % 4 == 3:
                optimizer.step()
                optimizer.zero_grad()
    assert run.summary["step_source"] == "dataloader" and run.summary["steps"] == 40
    assert run.summary["optimizer_steps"] == 10 and run.workload["loaders"][0]["steps_fed"] == 10
    assert run.workload["training"]["samples_per_step"] == 16  # four micro-batches of 4


def test_the_trained_model_is_the_one_the_optimizer_holds_not_the_largest():
    teacher = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4))  # trainable, never stepped
    student = Student(width=8)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(20):
            x = torch.randn(8, 16)
            with torch.no_grad():
                target = teacher(x).argmax(dim=1)
            train_step(student, optimizer, x, target)
    assert run.workload["training"]["model_class"] == "Student"
    assert run.workload["model"]["name"] == "student"
    # Only the student's own forward calls: the teacher's (under no_grad) are not the trained model's.
    training = run.workload["training"]
    assert training["eval_forwards"] == 0
    # All but the first step's (before the model was known), unless the steady state's windows began.
    assert training["forward_calls"] == 19 or training["forwards_sampled"] and training["forward_calls"] < 19


def test_of_two_optimizers_the_one_holding_most_of_the_model_counts_the_steps():
    model = Student()
    head, body = list(model.body[2].parameters()), list(model.body[0].parameters())
    big, small = torch.optim.AdamW(body, lr=1e-3), torch.optim.SGD(head, lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(15):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            loss.backward()
            small.step()  # steps first, holds fewer of the model's parameters
            big.step()
            small.zero_grad()
            big.zero_grad()
    assert run.summary["steps"] == 15 and run.workload["training"]["optimizer_steps"] == 15


def test_evaluation_between_steps_is_time_between_steps():
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.05) as run:
        for step in range(12):
            train_step(model, optimizer, torch.randn(8, 16), torch.randint(0, 4, (8,)))
            if step % 4 == 3:
                with torch.no_grad():  # evaluation: forward calls of the trained model, not a step's
                    for _ in range(3):
                        model(torch.randn(8, 16))
                        time.sleep(0.05)
    between = [span.duration for span in run.trace.spans(BETWEEN_STEPS_SPAN)]
    training = run.workload["training"]
    # Every step's wait in the first steps; once the windows began, the waits a tick fell in, and an
    # evaluation three ticks long always holds one.
    assert len(between) == 11 or training["forwards_sampled"] and len(between) < 11
    assert sum(1 for duration in between if duration >= 0.15) == 2  # after steps 3 and 7; step 11 was the last
    assert training["eval_forwards"] == 6 or training["forwards_sampled"] and training["eval_forwards"] >= 2


def test_autocast_share_counts_every_forward_call_not_the_first():
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for step in range(21):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            if step == 0:
                train_step(model, optimizer, x, y)  # outside autocast: what the first call saw
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    training = run.workload["training"]
    assert run.workload["model"]["autocast"]["enabled"] is False  # the first call's view
    assert training["forward_calls"] == 20 or training["forwards_sampled"] and training["forward_calls"] < 20
    assert training["autocast_share"] == 1.0 and training["autocast_dtype"] == "bfloat16"


def test_a_step_that_raises_while_counted_leaves_no_flop_counter_entered():
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="loss went NaN"), gpuwidget.watch(quiet=True, interval=0.1) as run:
        stepped = 0
        while stepped < 2000:  # until the counted step: the FLOP counter loads on the sampler thread first
            out = model(torch.randn(8, 16))
            if torch._C._len_torch_dispatch_stack() == 1:  # the counted step, counting
                raise RuntimeError("loss went NaN")
            nn.functional.cross_entropy(out, torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            stepped += 1
            time.sleep(0.002)
    nothing_left()
    assert run.workload["training"]["optimizer_steps"] == stepped >= FLOPS_AT_STEP
    assert "flops_per_step" not in run.workload["training"]
    assert run.summary["mfu_missing"] == "the counted step did not reach its optimizer step"


def test_a_cell_too_short_for_the_counted_step_says_why_there_are_no_flops():
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _ in range(FLOPS_AT_STEP):
            train_step(model, optimizer, torch.randn(8, 16), torch.randint(0, 4, (8,)))
    assert run.summary["steps"] == FLOPS_AT_STEP and "flops_per_step" not in run.summary
    assert run.summary["mfu_missing"] == f"the loop ended before step {FLOPS_AT_STEP + 1}, the one counted"
    nothing_left()


def test_an_inference_loop_keeps_the_busiest_loader():
    model = Student()
    loader = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=8)
    with gpuwidget.watch(quiet=True, interval=0.1) as run, torch.no_grad():
        for (x,) in loader:
            model(x)
    assert run.workload["training"] is None
    assert run.summary["steps"] == 8 and run.summary["step_source"] == "dataloader"


# ------------------------------------------------------------------ fp32-math reads the autocast share


def fp32_math_on_an_a100(workload: dict) -> object:
    """fp32-math on the run's real model and step facts, as if the model had trained on an A100 (no GPM)."""
    from gpuwidget.advice.rules import fp32_math

    model_facts = {**workload["model"], "param_devices": ["cuda"], "cuda_matmul_allow_tf32": False,
                   "float32_matmul_precision": "highest"}
    cuda = {"devices": [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "total_memory": 100,
                         "peak_allocated": 10, "peak_reserved": 10}]}
    machine = {"gpus": [{"index": 0, "name": "NVIDIA A100-SXM4-80GB"}], "usable_cpus": 8}
    summary = {"gpu_busy_mean": 90.0, "process_cpu_mean": 50.0, "data_wait_fraction": 0.0}
    return fp32_math.check(summary, {**workload, "model": model_facts, "cuda": cuda}, machine)


def autocast_loop(first_call_outside: bool, autocast: bool) -> dict:
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        if first_call_outside:
            model(torch.randn(2, 16))  # a shape check before the loop, outside autocast
        for _ in range(12):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run.workload


def test_a_model_whose_first_call_ran_outside_autocast_gets_no_false_fp32_math_finding():
    workload = autocast_loop(first_call_outside=True, autocast=True)
    assert workload["model"]["autocast"]["enabled"] is False  # all the first call saw
    assert fp32_math_on_an_a100(workload) is None
    # The share alone settles it, without the counted step's dtype.
    workload["training"].pop("flops_dtype", None)
    assert fp32_math_on_an_a100(workload) is None


def test_a_model_trained_outside_autocast_still_gets_fp32_math():
    workload = autocast_loop(first_call_outside=True, autocast=False)
    finding = fp32_math_on_an_a100(workload)
    assert finding is not None and finding.rule == "fp32-math" and finding.evidence["autocast_share"] == 0.0


# ------------------------------------------------------------------ a script under gpuwatch

GET_BATCH_SCRIPT = '''\
import time, torch
tokens = torch.randint(0, 50, (4000,))
model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 8, 50))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

def get_batch():
    starts = torch.randint(0, len(tokens) - 9, (6,))
    time.sleep(0.003)
    return torch.stack([tokens[i:i + 8] for i in starts]), tokens[starts + 8]

for _ in range(30):
    x, y = get_batch()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def test_a_get_batch_script_under_gpuwatch_counts_the_training_processs_steps(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from gpuwidget import Run

    script, saved = tmp_path / "train.py", tmp_path / "run.json"
    script.write_text(GET_BATCH_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "gpuwidget.cli", "--interval", "0.1", "--save", str(saved), "--",
                             sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL, cwd=root)
    assert result.returncode == 0, result.stderr
    run = Run.load(saved)
    assert run.summary["steps"] == 30 and run.summary["step_source"] == "optimizer"
    assert run.workload["training"]["optimizer_steps"] == 30 and run.workload["trained_in"]
    assert "no training loop seen" not in result.stdout
    assert len(run.trace.spans(TRAIN_STEP_SPAN)) == 30


def test_a_batch_taken_to_read_its_size_each_epoch_is_no_step_of_the_loop():
    """PyTorch's DDP tutorial reads ``len(next(iter(loader))[0])`` at each epoch's start: 3 epochs of
    20 steps take 63 batches and train on 60."""
    loader = DataLoader(TensorDataset(torch.randn(80, 16), torch.randint(0, 4, (80,))), batch_size=4)
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        for _epoch in range(3):
            assert len(next(iter(loader))[0]) == 4
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert run.workload["loaders"][0]["steps"] == 63 and run.workload["loaders"][0]["steps_fed"] == 60
    assert run.summary["steps"] == 60 and run.summary["optimizer_steps"] == 60


@pytest.mark.parametrize(("batches", "fed", "optimizer_steps", "steps"), [
    (63, 60, 60, 60),  # a batch read for its size at each of 3 epochs' starts
    (90, 88, 90, 90),  # accelerate's loader reads one ahead: each epoch's last batch is seen to feed none
    (40, 10, 10, 40),  # gradient accumulation over 4 batches: the steps are the batches
    (50, 50, 0, 50),  # no optimizer stepped
])
def test_the_loops_steps_are_the_optimizers_where_it_takes_one_batch_per_step(batches, fed, optimizer_steps, steps):
    from gpuwidget.figures.summary import loop_steps

    loader = {"steps": batches, "steps_fed": fed}
    assert loop_steps(loader, {"optimizer_steps": optimizer_steps}) == steps  # type: ignore[arg-type, typeddict-item]


def test_a_models_fingerprint_reads_a_few_parameters_and_a_nan_is_no_change():
    """What tells a manual update: the first element of the first 8 trainable parameters, read once;
    a diverged model's NaN compares equal to itself, so an inference loop over it is no training."""
    from gpuwidget.probes.torch_model import FINGERPRINT_PARAMETERS, _fingerprint

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    before = _fingerprint(torch, model)
    assert len(before) == FINGERPRINT_PARAMETERS == 8 and before[0] is None
    assert _fingerprint(torch, model) == before
    with torch.no_grad():
        model[1].bias.data.add_(1.0)  # an update of the fourth parameter
    assert _fingerprint(torch, model) != before


def copy_and_save(model: nn.Module) -> bytes:
    """What a loop does between steps with the model it trains: a best-model copy, a whole-model save."""
    copied = copy.deepcopy(model)
    copied(torch.randn(2, 16))  # the copy works, whatever it took of the hooks on the model
    saved = io.BytesIO()
    torch.save(model, saved)
    return saved.getvalue()


@pytest.fixture
def flop_counter_loaded() -> None:
    """What the sampler thread loads before the steady state (StepProbe.prepare), loaded here first: in a
    fresh process on a busy machine its import alone holds the GIL for seconds."""
    with DtypeFlopCounter():
        torch.ones(2, 2) @ torch.ones(2, 2)


def test_the_steady_state_keeps_no_hook_on_the_model_between_its_windows(flop_counter_loaded: None,
                                                                          one_torch_thread: None):
    """After the first steps, torch's fast path: a forward hook costs a module about 3 us a call. (One
    torch thread: two spinning on a busy 2-core machine made a step of this model take 100 ms.)"""
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = steps = 0
    with gpuwidget.watch(quiet=True, interval=0.25) as run:
        started = time.perf_counter()
        while time.perf_counter() - started < 2.0 or steps < 300:
            assert time.perf_counter() - started < 60, f"{steps} steps in 60 s"
            hooked += bool(model._forward_pre_hooks)
            steps += 1
            train_step(model, optimizer, torch.randn(8, 16), torch.randint(0, 4, (8,)))
    training = run.workload["training"]
    assert training["forwards_sampled"] is True and training["optimizer_steps"] == steps
    # Windows open only in the last few steps before each tick (about 3 ms of its 250 ms here) and at
    # the tick, each until the next training forward: few steps start hooked (55 of 2416 on a busy machine).
    assert hooked < steps / 10, (hooked, run.sampler["ticks"], steps)
    # Every forward of the first steps (until the FLOP count), then those the windows saw.
    assert 1 + FLOPS_AT_STEP <= training["forward_calls"] < steps / 2, (training["forward_calls"], steps)
    assert training["between_spans"] == len(run.trace.spans(BETWEEN_STEPS_SPAN))
    assert model._forward_pre_hooks == {}
    nothing_left()


@pytest.mark.parametrize("closure", [False, True], ids=["step", "closure"])
def test_the_first_steps_global_hooks_end_once_read_and_a_later_step_is_counted(
        closure: bool, flop_counter_loaded: None, one_torch_thread: None, monkeypatch: pytest.MonkeyPatch):
    """torch's global module hooks take every module off its fast path (10-20 % of a 0.3 ms step): they
    end once the first steps' inputs are read, not when the FLOP counter has loaded (in a fresh process
    its import takes seconds: here it loads from the 40th step on); a hook on the model then starts the
    count at a step's first training forward. With ``closure``, the forward runs inside
    ``optimizer.step(closure)``, as Lightning's does: the count ends with that step."""
    from gpuwidget.probes.torch_steps import StepProbe

    prepare = StepProbe.prepare

    def loads_late(probe: StepProbe) -> None:
        if probe.steps >= 40:
            prepare(probe)

    monkeypatch.setattr(StepProbe, "prepare", loads_late)
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if not closure:
            train_step(model, optimizer, x, y)
            return

        def forward_backward() -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        optimizer.step(forward_backward)

    global_hooks_at = {}
    with gpuwidget.watch(quiet=True, interval=0.05) as run:
        started, steps = time.perf_counter(), 0
        while time.perf_counter() - started < 1.0 or steps < 20:
            assert time.perf_counter() - started < 60, f"{steps} steps in 60 s"
            step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
            steps += 1
            if steps in (2, 24):  # (the model probe's own global hooks end after 16 calls: probes.torch_model)
                global_hooks_at[steps] = bool(nn_module._global_forward_pre_hooks)
    training = run.workload["training"]
    assert global_hooks_at == {2: True, 24: False}  # the first steps' hooks, then none
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with DtypeFlopCounter() as counter:
        step(x, y)
    assert training["flops_counted_at_step"] >= 40  # counted once loaded, past the first steps
    assert training["flops_per_step"] == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert training["samples_per_step"] == 8 and training["optimizer_steps"] == steps
    assert "flops_step_s" in training  # the counted step's time, kept out of its step times:
    assert len(training["step_times"]) == training["spanned_steps"] - 1
    assert model._forward_pre_hooks == {}
    nothing_left()


def test_windows_before_a_tick_are_planned_from_the_steps_queued_since_the_last_flush(monkeypatch):
    """Spans are made once a second (probes.FLUSH_EVERY_S): the steps a tick plans its windows from are
    those the loop queued since, not a second older (nor none, in a watch's first second)."""
    from gpuwidget.probes import torch_steps
    from gpuwidget.probes.torch_steps import LEAD_STEPS, StepProbe
    from gpuwidget.trace import Trace

    probe = StepProbe(Trace(), None)
    probe._windowed = True
    monkeypatch.setattr(probe, "_open_window", lambda: None)
    following = iter([100.25, 100.5, 100.75])  # the ticks after those due at 100.0, 100.25 and 100.5
    monkeypatch.setattr(torch_steps, "next_tick_due", lambda: next(following))
    step = 0.004
    for k in range(12):  # queued, not flushed: a step's end, then the next step's training forward
        probe._events += [99.9 + k * step, -(99.9 + k * step + 0.001)]
    probe.arm()
    probe.arm()
    assert probe._window_from == pytest.approx(100.25 + 0.25 - LEAD_STEPS * step)
    probe._events.clear()
    probe.step_times.extend([0.5, 0.02])  # made at the last flush: nothing queued since
    probe.arm()
    assert probe._window_from == pytest.approx(100.5 + 0.25 - LEAD_STEPS * 0.5)


def test_a_model_copied_and_saved_in_a_watched_loop_takes_nothing_of_the_watch(flop_counter_loaded: None,
                                                                                 one_torch_thread: None):
    """copy.deepcopy(model) and torch.save(model) between steps: through the first steps' global hooks,
    the windows opened at ticks, and a loop with two forwards a step (a hook on every forward)."""
    for forwards in (1, 2):
        model = Student()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        armed = 0
        with gpuwidget.watch(quiet=True, interval=0.02) as run:
            started = time.perf_counter()
            while time.perf_counter() - started < 1.0 or armed < 3:  # past the first steps, into windows
                assert time.perf_counter() - started < 60, "never a copy while a hook was on the model"
                for _ in range(forwards):
                    nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
                optimizer.step()
                optimizer.zero_grad()
                armed += bool(model._forward_pre_hooks)
                saved = copy_and_save(model)
                assert b"gpuwidget" not in saved  # it loads where gpuwidget is not installed
        training = run.workload["training"]
        assert training["forwards_sampled"] is (forwards == 1)
        assert training["optimizer_steps"] >= 1 + FLOPS_AT_STEP
        assert torch.load(io.BytesIO(saved), weights_only=False)(torch.randn(2, 16)).shape == (2, 4)
    nothing_left()


def test_a_loop_with_two_forwards_a_step_keeps_a_hook_on_every_forward(flop_counter_loaded: None,
                                                                        one_torch_thread: None):
    """Two micro-batches a step: a window opened between them could not tell the second from the first."""
    model = Student()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuwidget.watch(quiet=True, interval=0.05) as run:
        deadline = time.perf_counter() + 0.8
        steps = 0
        while time.perf_counter() < deadline:
            for _ in range(2):
                nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    training = run.workload["training"]
    assert training["forwards_sampled"] is False
    assert training["forward_calls"] == 2 * (steps - 1)  # all but the first step's, before it was known
    assert training["between_spans"] == steps - 1
    assert model._forward_pre_hooks == {}
