"""GPU rules read NVIDIA's counters for what they mean: SM activity over utilisation, the chip's own
TF32 ratio, slowdown bits over the power cap, and several GPUs only where the work was meant to spread."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwidget.advice.rules import fp32_math, gpu_imbalance, gpu_throttled, gpu_unused, launch_bound, small_batch

H100 = {"gpus": [{"index": 0, "name": "NVIDIA H100"}], "usable_cpus": 8}


def loader(batch: int = 32) -> dict[str, Any]:
    return {"name": "train_loader", "steps": 100, "samples": 100 * batch, "wait_total_s": 0.0,
            "compute_total_s": 1.0, "loop_time_s": 1.0, "step_times": [0.01] * 100,
            "settings": {"batch_size": batch, "num_workers": 2}}


def model(**extra: Any) -> dict[str, Any]:
    return {"name": "net", "class": "Net", "param_devices": ["cuda"], "param_dtypes": {"float32": 1000},
            "autocast": {"enabled": False}, "float32_matmul_precision": "highest",
            "cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": True, **extra}


def cuda(capability: tuple[int, int]) -> dict[str, Any]:
    return {"devices": [{"index": 0, "capability": list(capability), "total_memory": 100,
                         "peak_allocated": 10, "peak_reserved": 10}]}


def summary(busy: float, **extra: Any) -> dict[str, Any]:
    """Without GPM: the busy figure is NVML's utilisation ("kernel running")."""
    return {"gpu_busy_mean": busy, "gpu_busy_metric": "kernel_running", "gpu_kernel_running_mean": busy,
            "process_cpu_mean": 50.0, "data_wait_fraction": 0.0, "peak_gpu_mem_fraction": 0.2, **extra}


def gpm_summary(sm_active: float, kernel_running: float | None, **extra: Any) -> dict[str, Any]:
    """With GPM (Hopper, a MIG instance of one): the busy figure is SM activity; a MIG instance has no utilisation."""
    figures = summary(sm_active, gpu_busy_metric="sm_active", gpu_sm_active_mean=sm_active, **extra)
    if kernel_running is None:
        figures.pop("gpu_kernel_running_mean")
    else:
        figures["gpu_kernel_running_mean"] = kernel_running
    return figures


# ------------------------------------------------------------------ SM activity (GPM) before utilisation


def test_launch_bound_sees_tiny_kernels_that_keep_utilisation_high():
    workload = {"model": model()}  # data made on the GPU: no loader whose batch could grow
    tiny_kernels = gpm_summary(18.0, 97.0, process_cpu_mean=100.0)
    finding = launch_bound.check(tiny_kernels, workload, H100)
    assert finding is not None
    assert finding.evidence["signal"] == "sm_active" and finding.evidence["sm_active_percent"] == 18.0
    assert finding.evidence["kernel_running_percent"] == 97.0
    assert finding.expected_speedup == pytest.approx(100 / 18, rel=0.01)
    # Without GPM the same loop reads 97% "kernel running" and nothing can be said.
    assert launch_bound.check(summary(97.0, process_cpu_mean=100.0), workload, H100) is None


@pytest.mark.parametrize(("sm_active", "fires"), [(49.9, True), (50.0, False)])
def test_launch_bound_judges_sm_activity_at_dcgms_half(sm_active, fires):
    # Memory at 60%: the batch cannot double, so small-batch has nothing to say and launch-bound judges.
    pegged = gpm_summary(sm_active, 99.0, process_cpu_mean=100.0, peak_gpu_mem_fraction=0.6)
    assert (launch_bound.check(pegged, {"loaders": [loader()], "model": model()}, H100) is not None) is fires


def test_a_small_batch_that_pegs_the_host_is_named_small_batch_and_launch_bound_stands_aside():
    # As measured on an H200 (benchmarks/gpu_check.py's small_batch workload, tests/fixtures/gpu/):
    # batches of 8 through an MLP, SMs active 3%, the process at 98% of a core, 0.8% of the memory.
    workload = {"loaders": [loader(batch=8)], "model": model()}
    figures = gpm_summary(3.3, 14.4, process_cpu_mean=97.7, peak_gpu_mem_fraction=0.008, data_wait_fraction=0.033)
    finding = small_batch.check(figures, workload, H100)
    assert finding is not None and finding.change == {"batch_size": 512}
    assert finding.evidence["process_cpu_percent"] == 97.7
    assert "98% of a core" in finding.suggestion and "torch.compile" in finding.suggestion
    assert launch_bound.check(figures, workload, H100) is None
    # The same host with its memory full: the batch cannot grow, the launches are the cause.
    full = {**figures, "peak_gpu_mem_fraction": 0.7}
    assert small_batch.check(full, workload, H100) is None
    assert launch_bound.check(full, workload, H100) is not None
    # A host that is not pegged: small-batch says nothing about launching.
    calm = small_batch.check({**figures, "process_cpu_mean": 40.0}, workload, H100)
    assert calm is not None and "process_cpu_percent" not in calm.evidence and "core" not in calm.suggestion


@pytest.mark.parametrize(("kernel_running", "sm_active", "fires"),
                         [(95.0, 49.9, True), (95.0, 50.0, False), (40.0, 85.0, False)])
def test_small_batch_judges_sm_activity_where_gpm_has_it(kernel_running, sm_active, fires):
    finding = small_batch.check(gpm_summary(sm_active, kernel_running), {"loaders": [loader()]}, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["signal"] == "sm_active" and "SMs" in finding.title


@pytest.mark.parametrize(("kernel_running", "fires"), [(59.9, True), (60.0, False)])
def test_small_batch_says_kernel_running_is_its_signal_without_gpm(kernel_running, fires):
    finding = small_batch.check(summary(kernel_running), {"loaders": [loader()]}, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["signal"] == "kernel_running" and "sm_active_percent" not in finding.evidence
        assert finding.evidence["kernel_running_percent"] == kernel_running


def test_a_summary_saved_before_the_busy_metric_is_read_as_it_was_meant():
    # Older runs held NVML utilisation in gpu_busy_mean and SM activity apart.
    saved = {"gpu_busy_mean": 95.0, "gpu_sm_active_mean": 30.0, "process_cpu_mean": 50.0, "data_wait_fraction": 0.0,
             "peak_gpu_mem_fraction": 0.2}
    finding = small_batch.check(saved, {"loaders": [loader()]}, H100)
    assert finding is not None
    assert finding.evidence["sm_active_percent"] == 30.0 and finding.evidence["kernel_running_percent"] == 95.0


@pytest.mark.parametrize(("kernel_running", "sm_active", "fires"), [(1.9, 0.0, True), (2.0, 0.0, False)])
def test_gpu_unused_means_no_kernel_ran_not_few_sms_active(kernel_running, sm_active, fires):
    on_cpu = gpm_summary(sm_active, kernel_running, process_cpu_mean=100.0, process_gpu_mem_peak=0.0)
    finding = gpu_unused.check(on_cpu, {"model": model(param_devices=["cpu"])}, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["kernel_running_percent"] == kernel_running


# ------------------------------------------------------------------ fp32-math: the chip's own ratio


@pytest.mark.parametrize(("capability", "ratio"), [((8, 0), 8.0), ((8, 6), 2.0), ((8, 9), 2.0), ((9, 0), 7.4),
                                                   ((12, 0), 2.0)])
def test_fp32_math_gain_uses_the_chips_tf32_ratio(capability, ratio):
    finding = fp32_math.check(summary(80.0), {"model": model(), "cuda": cuda(capability)}, H100)
    assert finding is not None and finding.evidence["tf32_over_fp32"] == ratio
    assert finding.expected_speedup == pytest.approx(1 / (1 - 0.8 * (1 - 1 / ratio)), rel=0.01)


def test_fp32_math_on_an_a40_claims_far_less_than_an_a100():
    a40 = fp32_math.check(summary(80.0), {"model": model(), "cuda": cuda((8, 6))}, H100)
    a100 = fp32_math.check(summary(80.0), {"model": model(), "cuda": cuda((8, 0))}, H100)
    assert a40.expected_speedup == pytest.approx(1.67, abs=0.01) and a100.expected_speedup > 3


def test_fp32_math_is_silent_when_tensor_pipes_already_work():
    workload = {"model": model(), "cuda": cuda((9, 0))}
    assert fp32_math.check(summary(80.0, gpu_tensor_active_mean=35.0), workload, H100) is None
    finding = fp32_math.check(gpm_summary(60.0, 80.0, gpu_tensor_active_mean=0.5), workload, H100)
    assert finding is not None and finding.evidence["tensor_active_percent"] == 0.5
    assert finding.evidence["signal"] == "sm_active"


def test_fp32_math_code_uses_the_tf32_api_the_users_torch_has_and_covers_convolutions():
    new_api = model(tf32_api="fp32_precision", cudnn_allow_tf32=False)
    finding = fp32_math.check(summary(80.0), {"model": new_api, "cuda": cuda((9, 0))}, H100)
    assert 'torch.backends.cuda.matmul.fp32_precision = "tf32"' in finding.code
    assert 'torch.backends.cudnn.conv.fp32_precision = "tf32"' in finding.code
    assert "set_float32_matmul_precision" not in finding.code  # mixing the APIs makes torch raise
    assert "convolutions" in finding.suggestion


def test_fp32_math_code_runs_as_pasted_on_this_torch():
    import torch

    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    new_api = model(tf32_api="fp32_precision", cudnn_allow_tf32=False)
    code = fp32_math.check(summary(80.0), {"model": new_api, "cuda": cuda((9, 0))}, H100).code
    try:
        exec(code, {})  # the whole snippet, in a namespace without even torch: it imports what it uses
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_fp32_math_is_silent_when_tf32_is_on_through_the_new_api():
    workload = {"model": model(tf32_api="fp32_precision", cuda_matmul_allow_tf32=True), "cuda": cuda((9, 0))}
    assert fp32_math.check(summary(80.0), workload, H100) is None


# ------------------------------------------------------------------ gpu-throttled: not the power cap alone


def test_power_cap_at_the_default_limit_is_not_throttling():
    busy_h100 = summary(98.0, gpu_throttle_fraction=0.0, gpu_power_capped_fraction=0.9,
                        gpu_power_limit_ratio=1.0, gpu_clock_ratio_busy=0.72)
    assert gpu_throttled.check(busy_h100, {}, H100) is None


def test_a_lowered_power_limit_at_its_cap_is_named():
    lowered = summary(98.0, gpu_throttle_fraction=0.0, gpu_power_capped_fraction=0.9,
                      gpu_power_limit_ratio=0.6, gpu_clock_ratio_busy=0.7)
    finding = gpu_throttled.check(lowered, {}, H100)
    assert finding is not None and "60% of its default" in finding.title
    assert finding.evidence["power_limit_over_default"] == 0.6


@pytest.mark.parametrize(("share", "fires"), [(0.2, True), (0.19, False)])
def test_thermal_or_hardware_slowdown_is_named_at_the_cap_too(share, fires):
    hot = summary(98.0, gpu_throttle_fraction=share, gpu_power_capped_fraction=0.9, gpu_power_limit_ratio=1.0,
                  gpu_clock_ratio_busy=0.9)
    assert (gpu_throttled.check(hot, {}, H100) is not None) is fires


# ------------------------------------------------------------------ gpu-imbalance


def test_one_process_on_one_gpu_of_eight_is_no_imbalance():
    one_of_eight = summary(98.0, gpus_used=[0], gpus_unused_idle=[1, 2, 3, 4, 5, 6, 7],
                           gpu_busy_by_gpu={"0": 98.0, **{str(i): 0.0 for i in range(1, 8)}})
    assert gpu_imbalance.check(one_of_eight, {"model": model()}, H100) is None


def test_data_parallel_with_idle_gpus_is_named():
    partial = summary(90.0, gpus_used=[0, 1], gpus_unused_idle=[2, 3],
                      gpu_busy_by_gpu={"0": 92.0, "1": 88.0, "2": 0.0, "3": 0.0})
    finding = gpu_imbalance.check(partial, {"model": model(**{"class": "DataParallel"})}, H100)
    assert finding is not None and finding.rule == "gpu-imbalance"
    assert finding.code == "import torch\nnet = torch.nn.DataParallel(net.module)  # every visible GPU"
    assert finding.expected_speedup == 2.0


@pytest.mark.parametrize(("quiet", "fires"), [(60.0, True), (60.1, False)])
def test_used_gpus_doing_unequal_work_are_named(quiet, fires):
    uneven = summary(80.0, gpus_used=[0, 1], gpu_busy_by_gpu={"0": 90.0, "1": quiet})
    finding = gpu_imbalance.check(uneven, {"model": model(**{"class": "DataParallel"})}, H100)
    assert (finding is not None) is fires
    if finding:
        assert finding.evidence["spread_percent"] == 30.0
