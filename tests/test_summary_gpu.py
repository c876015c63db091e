"""The summary's GPU figures: judged on the GPUs the workload used, read as NVIDIA's counters mean."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwidget.figures.summary import gpu_scope_note, gpu_scope_notes, summarize
from gpuwidget.run import Run
from gpuwidget.trace import Trace

GIB = 2**30


def eight_gpus(ticks: int = 40, own_gpu: int | None = 0, **extra: Any) -> Trace:
    """GPU 0 at 98% with this process's memory on it, GPUs 1-7 idle, ``extra`` columns per tick."""
    trace = Trace()
    for tick in range(ticks):
        row = {"cpu.util": 20.0}
        for index in range(8):
            row[f"gpu{index}.util"] = 98.0 if index == 0 else 0.0
            row[f"gpu{index}.mem_used"] = 60 * GIB if index == 0 else 0.5 * GIB
            row[f"gpu{index}.mem_total"] = 80 * GIB
            row[f"gpu{index}.proc_mem"] = 60 * GIB if index == own_gpu else 0.0
        row.update({name: value(tick) if callable(value) else value for name, value in extra.items()})
        trace.append(tick * 0.1, row)
    return trace


def test_seven_idle_gpus_do_not_dilute_the_one_that_trained():
    summary = summarize(eight_gpus(), {}, duration_s=4.0)

    assert summary["gpu_busy_mean"] == pytest.approx(98.0)  # not 12.25
    assert summary["gpu_busy_basis"] == "used" and summary["gpus_used"] == [0]
    assert summary["gpus_unused_idle"] == [1, 2, 3, 4, 5, 6, 7]
    assert summary["gpu_busy_by_gpu"]["3"] == 0.0  # every GPU is still listed
    assert summary["gpu_idle_gaps"] == 0
    assert gpu_scope_note(summary) == "GPUs 1-7 were idle and unused by this kernel."


def test_torchs_devices_say_which_gpus_were_used_when_nvml_lists_no_process():
    trace = eight_gpus(own_gpu=None)
    workload = {"cuda": {"devices": [{"index": 0, "total_memory": 80 * GIB, "peak_allocated": 50 * GIB,
                                      "peak_reserved": 55 * GIB, "capability": [9, 0]}]}}
    summary = summarize(trace, workload, duration_s=4.0)
    assert summary["gpus_used"] == [0] and summary["gpu_busy_mean"] == pytest.approx(98.0)


def test_without_any_sign_of_use_every_gpu_is_judged_and_the_basis_says_so():
    summary = summarize(eight_gpus(own_gpu=None), {}, duration_s=4.0)
    assert summary["gpu_busy_basis"] == "visible"
    assert summary["gpu_busy_mean"] == pytest.approx(98.0 / 8)
    assert summary["gpus_unused_idle"] == [] and gpu_scope_note(summary) is None


def test_another_users_busy_gpu_is_named_apart_not_judged():
    trace = Trace()
    for tick in range(20):
        trace.append(tick * 0.1, {"gpu0.util": 40.0, "gpu0.proc_mem": 2.0 * GIB,
                                  "gpu1.util": 99.0, "gpu1.proc_mem": 0.0})
    summary = summarize(trace, {}, duration_s=2.0)
    assert summary["gpu_busy_mean"] == pytest.approx(40.0)
    assert summary["gpus_unused_busy"] == [1]
    assert gpu_scope_note(summary) == "GPU 1 was busy with other work, not this kernel's."


def test_torch_devices_map_to_the_drivers_gpus_by_uuid_on_a_mixed_host():
    # The source guessed CUDA's order (gpu0 = H100); torch says its device 0 is the A40.
    trace = Trace()
    for tick in range(20):
        trace.append(tick * 0.1, {"gpu0.util": 0.0, "gpu0.mem_used": 1.0 * GIB, "gpu0.mem_total": 80.0 * GIB,
                                  "gpu1.util": 90.0, "gpu1.mem_used": 30.0 * GIB, "gpu1.mem_total": 48.0 * GIB})
    machine = {"gpus": [{"index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H100 80GB HBM3"},
                        {"index": 1, "uuid": "GPU-bbbb", "name": "NVIDIA A40"}]}
    workload = {"cuda": {"devices": [{"index": 0, "uuid": "bbbb", "total_memory": 48 * GIB,
                                      "peak_allocated": 20 * GIB, "peak_reserved": 24 * GIB,
                                      "capability": [8, 6]}]}}
    summary = summarize(trace, workload, duration_s=2.0, machine=machine)
    assert summary["gpus_used"] == [1] and summary["gpu_busy_mean"] == pytest.approx(90.0)
    assert summary["peak_gpu_mem_fraction"] == pytest.approx(30 / 48)
    assert summary["gpus_unused_idle"] == [0]


def test_idle_clock_samples_are_not_throttling():
    # Busy half the time at full clocks; idle half at 210 MHz, where the source gives no slowdown flags
    # (NVML's idle reason: the clocks are low on purpose) and util reads low.
    busy = lambda t: t % 2 == 0  # noqa: E731
    trace = Trace()
    for tick in range(40):
        flags = {"gpu0.slowdown": 0.0, "gpu0.power_capped": 0.0} if busy(tick) else {}
        trace.append(tick * 0.1, {"gpu0.util": 97.0 if busy(tick) else 0.0, "gpu0.proc_mem": GIB,
                                  "gpu0.sm_clock": 1.98e9 if busy(tick) else 2.1e8, "gpu0.sm_clock_max": 1.98e9,
                                  **flags})
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpu_clock_ratio_busy"] == pytest.approx(1.0)
    assert summary["gpu_throttle_fraction"] == 0.0


def test_power_cap_at_the_default_limit_is_counted_apart_from_slowdowns():
    trace = eight_gpus(**{"gpu0.slowdown": 0.0, "gpu0.power_capped": 1.0, "gpu0.sm_clock": 1.7e9,
                          "gpu0.sm_clock_max": 1.98e9,
                          "gpu0.power_limit": 700.0, "gpu0.power_limit_default": 700.0})
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpu_throttle_fraction"] == 0.0
    assert summary["gpu_power_capped_fraction"] == 1.0
    assert summary["gpu_power_limit_ratio"] == 1.0
    thermal = eight_gpus(**{"gpu0.slowdown": lambda t: float(t % 2), "gpu0.power_capped": 0.0})
    assert summarize(thermal, {}, duration_s=4.0)["gpu_throttle_fraction"] == pytest.approx(0.5)


def test_sm_tensor_and_nvlink_activity_are_means_over_the_used_gpus():
    trace = eight_gpus(**{"gpu0.sm_active": 30.0, "gpu0.tensor_active": 5.0, "gpu1.sm_active": 0.0,
                          "gpu0.nvlink_tx": 2e9, "gpu1.nvlink_tx": 0.0})
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpu_sm_active_mean"] == 30.0 and summary["gpu_tensor_active_mean"] == 5.0
    assert summary["gpu_nvlink_tx_mean"] == 2e9 and "gpu_nvlink_rx_mean" not in summary


def test_a_pcie_link_below_its_generation_or_width_is_named():
    trace = eight_gpus(**{"gpu0.pcie_gen": 3.0, "gpu0.pcie_width": 8.0, "gpu0.pcie_gen_max": 5.0,
                          "gpu0.pcie_width_max": 16.0})
    summary = summarize(trace, {}, duration_s=4.0)
    assert summary["gpus_pcie_degraded"] == [0]
    assert summary["gpu_pcie_link_by_gpu"]["0"] == {"pcie_gen": 3, "pcie_width": 8, "pcie_gen_max": 5,
                                                    "pcie_width_max": 16}


def test_in_a_container_torchs_reserved_memory_stands_in_for_nvmls_zero():
    trace = eight_gpus(own_gpu=None)
    workload = {"cuda": {"devices": [{"index": 0, "total_memory": 80 * GIB, "peak_allocated": 50 * GIB,
                                      "peak_reserved": 55 * GIB, "capability": [9, 0]}]}}
    summary = summarize(trace, workload, duration_s=4.0)
    assert summary["gpu_pid_namespace_foreign"] is True
    assert summary["process_gpu_mem_peak"] == 55 * GIB and summary["process_gpu_mem_source"] == "torch"


# ------------------------------------------------------------------ the busy figure: SM active over kernel running


def gpm_trace(sm_active: float = 6.0, kernel_running: float = 92.0, ticks: int = 20) -> Trace:
    """One H100 this process trained on: tiny kernels keep a kernel running while few SMs work."""
    trace = Trace()
    for tick in range(ticks):
        trace.append(tick * 0.1, {"cpu.util": 20.0, "gpu0.util": kernel_running, "gpu0.sm_active": sm_active,
                                  "gpu0.mem_used": 10 * GIB, "gpu0.mem_total": 80 * GIB, "gpu0.proc_mem": 8 * GIB})
    return trace


def test_busy_figure_is_sm_active_where_gpm_exists_and_kernel_running_stays_beside_it():
    summary = summarize(gpm_trace(), {}, duration_s=2.0)
    assert summary["gpu_busy_metric"] == "sm_active"
    assert summary["gpu_busy_mean"] == pytest.approx(6.0) and summary["gpu_sm_active_mean"] == pytest.approx(6.0)
    assert summary["gpu_kernel_running_mean"] == pytest.approx(92.0)
    assert summary["gpu_busy_by_gpu"] == {"0": pytest.approx(6.0)}
    assert summary["gpu_kernel_running_by_gpu"] == {"0": pytest.approx(92.0)}
    assert summary["gpu_idle_gaps"] == 0  # 6% of the SMs all along: not idle by IDLE_UTIL_PERCENT (5)
    assert "gpu_busy_missing" not in summary


def test_without_gpm_the_busy_figure_is_kernel_running():
    summary = summarize(eight_gpus(), {}, duration_s=4.0)
    assert summary["gpu_busy_metric"] == "kernel_running"
    assert summary["gpu_busy_mean"] == summary["gpu_kernel_running_mean"] == pytest.approx(98.0)


def test_one_judged_gpu_without_gpm_makes_kernel_running_the_figure_for_all():
    # A mixed host: the two GPUs used, an H100 (GPM) and an A40 (none); one figure must mean one thing.
    trace = Trace()
    for tick in range(20):
        trace.append(tick * 0.1, {"gpu0.util": 90.0, "gpu0.sm_active": 40.0, "gpu0.proc_mem": GIB,
                                  "gpu1.util": 70.0, "gpu1.proc_mem": GIB})
    summary = summarize(trace, {}, duration_s=2.0)
    assert summary["gpu_busy_metric"] == "kernel_running" and summary["gpu_busy_mean"] == pytest.approx(80.0)
    assert summary["gpu_sm_active_mean"] == pytest.approx(40.0)  # still there for the rules


@pytest.mark.parametrize(("kernel_running", "said"), [(80.0, True), (79.9, False)])
def test_one_line_says_why_kernel_running_reads_far_above_sm_active(kernel_running, said):
    summary = summarize(gpm_trace(sm_active=50.0, kernel_running=kernel_running), {}, duration_s=2.0)
    notes = gpu_scope_notes(summary)
    assert any("a few small kernels keep the GPU" in note for note in notes) is said


def test_headline_reads_sm_active_where_gpm_exists_and_labels_nvidia_smi_utilisation():
    trace = gpm_trace()
    run = Run(trace=trace, summary=summarize(trace, {}, duration_s=2.0), finished=True,
              machine={"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "gpm": True}]})
    text, page = (run._repr_mimebundle_()[kind] for kind in ("text/plain", "text/html"))
    assert "SM active 6% · kernel running (nvidia-smi) 92%" in text
    assert "GPU busy" not in text
    assert ("A kernel was running 92% of the time but only 6% of the SMs were active: a few small kernels keep "
            "the GPU \"busy\" for nvidia-smi while most of its SMs idle.") in text
    assert "GPU0 NVIDIA H100 80GB HBM3: SM active 6%, kernel running (nvidia-smi) 92%" in text
    assert ">SM active<" in page and ">kernel running (nvidia-smi)<" in page
    chart = next(line for line in page.split("alt='")[1:2])
    assert "GPU0 SM active mean 6%" in chart and "GPU0 kernel running mean 92%" in chart


def test_a_saved_run_from_before_the_busy_metric_still_reads_utilisation_as_kernel_running():
    run = Run(trace=Trace(), summary={"duration_s": 1.0, "gpu_busy_mean": 81.0, "gpu_busy_by_gpu": {"0": 81.0}},
              finished=True, machine={"gpus": [{"index": 0, "name": "NVIDIA A100"}]})
    text = run._repr_mimebundle_()["text/plain"]
    assert "kernel running (nvidia-smi) 81%" in text and "SM active" not in text
