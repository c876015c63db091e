"""FLOPs per training step and MFU: one real step counted by FlopCounterMode, judged against the
chip's dense peak for the dtype its matmuls ran in, and read first in the panel."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gpuwidget
from gpuwidget import Run
from gpuwidget.figures.summary import steady_step_times, summarize
from gpuwidget.probes.torch_steps import FLOPS_AT_STEP, DtypeFlopCounter
from gpuwidget.report import fmt_flops, fmt_mfu, headline, run_html, run_text
from gpuwidget.trace import Trace

H100_NAME = "NVIDIA H100 80GB HBM3"
STEPS = 12
# A watched loop runs at least this long: the FLOP counter loads on the sampler thread's first tick
# (interval 0.1 s) and counts the first step after that.
MIN_LOOP_S = 0.5


def watched_steps(model: nn.Module, batch: Callable[[], dict[str, Any]], loss: Callable[..., torch.Tensor],
                  autocast: bool = False) -> tuple[Run, float]:
    """A real training loop under a watch, then the same step counted by FlopCounterMode itself."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = loss(model, **batch())
        optimizer.zero_grad()
        value.backward()
        optimizer.step()

    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        started, steps = time.perf_counter(), 0
        while steps < STEPS or time.perf_counter() - started < MIN_LOOP_S:
            step()
            steps += 1
    with FlopCounterMode(display=False) as counter:
        step()
    return run, float(counter.get_total_flops())


def mlp_case() -> tuple[nn.Module, Callable[[], dict[str, Any]], Callable[..., torch.Tensor]]:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    return (model, lambda: {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))},
            lambda m, x, y: nn.functional.cross_entropy(m(x), y))


def conv_case() -> tuple[nn.Module, Callable[[], dict[str, Any]], Callable[..., torch.Tensor]]:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10))
    return (model, lambda: {"x": torch.randn(8, 3, 32, 32), "y": torch.randint(0, 10, (8,))},
            lambda m, x, y: nn.functional.cross_entropy(m(x), y))


def gpt2_case() -> tuple[nn.Module, Callable[[], dict[str, Any]], Callable[..., torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(config)
    return (model, lambda: {"ids": torch.randint(0, 256, (4, 32))},
            lambda m, ids: m(input_ids=ids, labels=ids).loss)


@pytest.fixture(autouse=True, scope="module")
def counter_loaded() -> None:
    """torch's dispatch modes import torch._dynamo at their first use: seconds in a fresh process, which
    the probe spends on the sampler thread before it counts. Loaded once here, every watch counts early."""
    import torch._dynamo  # noqa: F401


@pytest.mark.parametrize("case", [mlp_case, conv_case])
def test_flops_per_step_matches_flopcountermode(case):
    run, reference = watched_steps(*case())
    assert run.workload["training"]["flops_counted_at_step"] >= FLOPS_AT_STEP
    assert run.summary["flops_per_step"] == pytest.approx(reference, rel=0.10)
    assert run.summary["flops_dtype"] == "fp32"


def test_flops_per_step_matches_flopcountermode_for_a_tiny_gpt2():
    run, reference = watched_steps(*gpt2_case())
    # The forward alone is a third of a training step: the count holds its backward too.
    assert run.summary["flops_per_step"] == pytest.approx(reference, rel=0.10)
    assert run.workload["training"]["model_class"] == "GPT2LMHeadModel"
    assert run.workload["training"]["samples_per_step"] == 4  # input_ids, passed by keyword


def test_without_a_gpu_achieved_flops_are_shown_and_no_mfu_is_claimed():
    run, _ = watched_steps(*mlp_case())
    summary = run.summary
    steady = steady_step_times(run.workload["training"])  # the warm-up apart
    assert 0 < len(steady) <= len(run.workload["training"]["step_times"])
    assert summary["achieved_flops_per_s"] == pytest.approx(summary["flops_per_step"] * len(steady) / sum(steady))
    assert "mfu" not in summary and "peak_flops_per_s" not in summary
    assert summary["mfu_missing"] == "the model trained on the cpu, not a GPU"
    labels = dict(headline(run))
    assert labels["achieved"].endswith(("GFLOP/s", "MFLOP/s")) and "MFU" not in labels


def on_a_fake_gpu(run: Run, name: str = H100_NAME) -> dict[str, Any]:
    """The run's real facts, as if torch had trained on ``name`` (torch here is a CPU build)."""
    workload = copy.deepcopy(run.workload)
    workload["training"]["device_type"] = "cuda"
    workload["cuda"] = {"devices": [{"index": 0, "name": name, "capability": [9, 0], "total_memory": 80 * 2**30,
                                     "peak_allocated": 2**30, "peak_reserved": 2**30}]}
    machine = {"gpus": [{"index": 0, "name": name, "uuid": "GPU-0"}]}
    return summarize(run.trace, workload, duration_s=run.summary["duration_s"], machine=machine)


def test_mfu_on_a_fake_h100_uses_the_bf16_dense_peak():
    run, _ = watched_steps(*mlp_case(), autocast=True)
    assert run.workload["training"]["flops_dtype"] == "bf16"  # the matmuls' operands under autocast
    summary = on_a_fake_gpu(run)
    assert summary["peak_flops_per_s"] == 989.4e12  # dense, not the datasheet's 1,979 with sparsity
    assert summary["mfu"] == pytest.approx(summary["achieved_flops_per_s"] / 989.4e12)


def test_an_unknown_chip_gets_no_mfu_and_says_so():
    run, _ = watched_steps(*mlp_case(), autocast=True)
    summary = on_a_fake_gpu(run, "NVIDIA Quantum Tensor Z9")
    assert "mfu" not in summary and summary["achieved_flops_per_s"] > 0
    assert summary["mfu_missing"] == "NVIDIA Quantum Tensor Z9 is not in gpuwidget's table of chip peaks"


def test_a_chip_without_a_peak_for_the_dtype_gets_no_mfu():
    run, _ = watched_steps(*mlp_case(), autocast=True)
    summary = on_a_fake_gpu(run, "Tesla T4")  # Turing: no BF16 Tensor Cores
    assert "mfu" not in summary and summary["mfu_missing"] == "the T4's datasheet has no dense bf16 peak"


def test_a_mig_slice_gets_no_mfu_against_the_whole_chips_peak():
    run, _ = watched_steps(*mlp_case(), autocast=True)
    summary = on_a_fake_gpu(run, "NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert "mfu" not in summary and "MIG slice" in summary["mfu_missing"]


@pytest.fixture
def tf32_matmuls() -> Any:
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    yield
    matmul.fp32_precision = before


def test_fp32_matmuls_count_as_tf32_on_cuda_where_torch_allows_it(tf32_matmuls):
    counter = DtypeFlopCounter()
    with counter:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert counter.get_total_flops() == 2 * 64**3
    assert counter.dominant_dtype("cuda") == "tf32"
    assert counter.dominant_dtype("cpu") == "fp32"  # no Tensor Cores there


def test_fp32_matmuls_stay_fp32_on_cuda_with_tf32_off():
    counter = DtypeFlopCounter()
    with counter:
        torch.randn(32, 32) @ torch.randn(32, 32)
    if torch.backends.cuda.matmul.fp32_precision in ("none", "ieee"):
        assert counter.dominant_dtype("cuda") == "fp32"


def fake_run(summary: dict[str, Any], gpu: bool) -> Run:
    machine = {"gpus": [{"index": 0, "name": H100_NAME}]} if gpu else {"gpus": []}
    return Run(trace=Trace(), summary={"duration_s": 30.0, "steps": 500, "cpu_util_mean": 20.0, **summary},
               machine=machine, options={"advice": True}, finished=True)


def test_the_headline_reads_samples_per_s_achieved_tflops_and_mfu_first():
    run = fake_run({"samples_per_s": 1234.0, "achieved_flops_per_s": 412e12, "mfu": 0.4165,
                    "peak_flops_per_s": 989.4e12, "gpu_busy_mean": 97.0}, gpu=True)
    assert headline(run)[:3] == [("samples/s", "1,234/s"), ("achieved", "412 TFLOP/s"), ("MFU", "42%")]
    assert run_text(run).splitlines()[2].startswith("  samples/s 1,234/s · achieved 412 TFLOP/s · MFU 42%")
    html = run_html(run)
    assert html.index("412 TFLOP/s") < html.index("MFU") < html.index("42%") < html.index("duration")


def test_an_mfu_under_one_percent_keeps_two_digits():
    # The H200 run's batch-8 MLP reached 0.019% of the chip's bf16 peak: "0%" would hide how far.
    run = fake_run({"samples_per_s": 5682.0, "achieved_flops_per_s": 183e9, "mfu": 0.00018515,
                    "peak_flops_per_s": 989.4e12, "gpu_busy_mean": 3.3}, gpu=True)
    assert headline(run)[2] == ("MFU", "0.019%")
    assert [fmt_mfu(value) for value in (0.711, 0.0095, 0.0, float("nan"))] == ["71%", "0.95%", "0%", "n/a"]


def test_the_headline_on_a_cpu_shows_gflops_and_no_mfu():
    run = fake_run({"samples_per_s": 88.5, "achieved_flops_per_s": 3.21e9}, gpu=False)
    assert headline(run)[:2] == [("samples/s", "88.5/s"), ("achieved", "3.21 GFLOP/s")]
    assert "MFU" not in run_text(run)


@pytest.mark.parametrize(("value", "text"), [(989.4e12, "989 TFLOP/s"), (2.25e15, "2.25 PFLOP/s"),
                                             (41.2e9, "41.2 GFLOP/s"), (5e5, "0.5 MFLOP/s"), (None, "n/a")])
def test_flop_rates_keep_three_figures_in_their_unit(value, text):
    assert fmt_flops(value) == text
