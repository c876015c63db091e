"""What only AMD GPUs do: MI250X's average power and metrics-table throttle status, compute partitions,
HIP's visibility variables and torch's ROCm build, older bindings, and amdsmi's error codes."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from gpuwidget.peaks import chip, peak_flops
from gpuwidget.sources.amd import AmdSource
from gpuwidget.sources.amd import source as amd_source
from gpuwidget.sources.gpu import open_gpu_sources

from fakeamdsmi import GIB, AmdSmiRetryException, FakeAmdSmi, make_gpu
from fakenvml import FakeNvml


@pytest.fixture(autouse=True)
def no_nvidia(fake_nvml: Any) -> None:
    fake_nvml(FakeNvml.library_missing())


@pytest.fixture(autouse=True)
def no_visibility_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def ticks(source: AmdSource, fake: FakeAmdSmi, count: int) -> list[dict[str, float]]:
    readings = []
    for _ in range(count):
        readings.append(source.read())
        fake.step()
    return readings


def test_mi250x_reports_its_average_power_where_it_has_no_current_figure(fake_amdsmi):
    fake_amdsmi(FakeAmdSmi.mi250x())
    source = AmdSource()
    reading = source.read()
    assert reading["gpu0.power"] == 480.0 and reading["gpu0.power_limit"] == 560.0
    assert source.describe()[0]["name"] == "AMD Instinct MI250X/MI250" and source.describe()[0]["arch"] == "gfx90a"


def test_without_a_hotspot_sensor_the_edge_temperature_is_read(fake_amdsmi):
    fake = fake_amdsmi(FakeAmdSmi.mi250x().not_supported(0, "temp_hotspot"))
    reading = AmdSource().read()
    assert reading["gpu0.temperature"] == 45.0
    assert fake.count("amdsmi_get_temp_metric") == 2  # hotspot refused, then the edge


@pytest.mark.parametrize(("bits", "slowdown", "capped"), [
    (0, 0.0, 0.0),
    (1 << 0, 0.0, 1.0),  # PPT0: package power tracking holds the clocks
    (1 << 33, 1.0, 0.0),  # TEMP_CORE (SMU_THROTTLER_TEMP_CORE_BIT)
    ((1 << 4) | (1 << 36), 1.0, 1.0),  # SPL and TEMP_HOTSPOT
])
def test_throttle_bits_of_older_bindings_become_the_flags(fake_amdsmi, bits, slowdown, capped):
    fake = FakeAmdSmi.mi250x(throttle_bits=bits)
    fake.int_throttle = True
    fake_amdsmi(fake)
    reading = AmdSource().read()
    assert (reading["gpu0.slowdown"], reading["gpu0.power_capped"]) == (slowdown, capped)


def test_throttle_status_reduced_to_a_bool_says_slowdown_and_leaves_the_cap_unknown(fake_amdsmi):
    fake = fake_amdsmi(FakeAmdSmi.mi250x(throttle_bits=[0, 1]))
    source = AmdSource()
    first = source.read()
    fake.step()
    second = source.read()
    assert first["gpu0.slowdown"] == 0.0 and second["gpu0.slowdown"] == 1.0
    assert "gpu0.power_capped" not in first and "gpu0.power_capped" not in second


def test_a_gpu_in_cpx_mode_is_eight_devices_each_a_partition(fake_amdsmi):
    fake_amdsmi(FakeAmdSmi.cpx(8))
    gpus = open_gpu_sources()
    try:
        devices = gpus.devices()
        assert len(gpus.sources) == 8 and [d["index"] for d in devices] == list(range(8))
        assert {d["compute_partition"] for d in devices} == {"CPX"} and [d["partition_id"] for d in devices] == \
            list(range(8))
        assert all(d["memory_total"] == 196_592 // 8 * 2**20 for d in devices)
        assert not any(d["is_mig"] for d in devices)  # each partition reads its own utilisation
    finally:
        gpus.close()


@pytest.mark.parametrize(("environ", "picked"), [
    ({}, [0, 1, 2, 3]),
    ({"HIP_VISIBLE_DEVICES": "2,0"}, [2, 0]),
    ({"CUDA_VISIBLE_DEVICES": "3"}, [3]),  # HIP honours CUDA's variable where its own is unset
    ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "3"}, [1]),
    ({"ROCR_VISIBLE_DEVICES": "1,2,3", "HIP_VISIBLE_DEVICES": "0"}, [1]),  # HIP picks among ROCr's
    ({"ROCR_VISIBLE_DEVICES": "GPU-a8ff7553"}, [2]),  # a UUID prefix
    ({"HIP_VISIBLE_DEVICES": "0,7,1"}, [0]),  # an invalid entry ends the list
    ({"HIP_VISIBLE_DEVICES": ""}, []),
])
def test_hips_visibility_variables_pick_and_order_the_devices(fake_amdsmi, monkeypatch, environ, picked):
    fake_amdsmi(FakeAmdSmi.mi300x(4))
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    source = AmdSource()
    assert [d["driver_index"] for d in source.describe()] == picked
    assert [d["id"] for d in source.describe()] == [f"gpu{i}" for i in range(len(picked))]
    if not picked:
        assert not source.available and "visible to HIP" in (source.unavailable_reason or "")
        assert "HIP_VISIBLE_DEVICES=''" in (source.unavailable_reason or "")


def test_the_servers_view_lists_every_device_whatever_the_variables_say(fake_amdsmi, monkeypatch):
    fake_amdsmi(FakeAmdSmi.mi300x(3))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert [d["driver_index"] for d in AmdSource(every_device=True).describe()] == [0, 1, 2]


def test_torchs_rocm_build_numbers_the_devices_once_it_has_started_hip(fake_amdsmi, monkeypatch):
    fake = fake_amdsmi(FakeAmdSmi.mi300x(2))
    addresses = [fake.gpu(1).bdf, fake.gpu(0).bdf]  # torch (HIP) put the second one first
    torch = types.SimpleNamespace(
        version=types.SimpleNamespace(hip="6.3.42131", cuda=None),
        cuda=types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2,
                                   get_device_properties=lambda i: types.SimpleNamespace(pci_bus_id=addresses[i])))
    from gpuwidget.sources.amd import devices

    monkeypatch.setattr(devices, "_torch", lambda: torch)
    assert [d["driver_index"] for d in AmdSource().describe()] == [1, 0]
    torch.version.hip = None  # a CUDA build's torch.cuda says nothing about AMD devices
    assert [d["driver_index"] for d in AmdSource().describe()] == [0, 1]


def test_older_bindings_list_process_handles_and_their_info(fake_amdsmi):
    fake = FakeAmdSmi.mi300x(processes=[(os.getpid(), 3 * GIB), (os.getppid(), GIB)])
    fake.old_process_api = True
    fake_amdsmi(fake)
    source = AmdSource()
    assert source.read()["gpu0.proc_mem"] == 3 * GIB
    assert source.processes() == {"gpu0": sorted([(os.getpid(), 3 * GIB), (os.getppid(), GIB)])}


def test_in_a_container_own_memory_is_absent_not_zero(fake_amdsmi):
    host_pid = FakeNvml().host_pid()
    fake = fake_amdsmi(FakeAmdSmi.mi300x(processes=[(host_pid, 3 * GIB)]))
    source = AmdSource()
    readings = ticks(source, fake, 3)
    assert all("gpu0.proc_mem" not in r for r in readings)
    assert source.describe()[0]["foreign_pid_namespace"] is True
    assert sum("own PID namespace" in e.message for e in source.errors) == 1


def test_bindings_without_a_function_lose_its_readings_and_say_so_once(fake_amdsmi):
    fake = fake_amdsmi(FakeAmdSmi.mi300x().without("amdsmi_get_violation_status", "amdsmi_get_gpu_metrics_info"))
    source = AmdSource()
    readings = ticks(source, fake, 4)
    assert all("gpu0.slowdown" not in r and "gpu0.util" in r for r in readings)
    messages = [e.message for e in source.errors]
    assert sum("has no amdsmi_get_violation_status" in m for m in messages) == 1
    assert sum("has no amdsmi_get_gpu_metrics_info" in m for m in messages) == 1


def test_a_busy_device_loses_a_reading_for_one_tick_not_the_gpu(fake_amdsmi, monkeypatch):
    fake = fake_amdsmi()
    module = sys.modules["amdsmi"]
    activity = module.amdsmi_get_gpu_activity
    answers = iter([AmdSmiRetryException(), None, None])

    def busy_then_fine(handle: Any) -> Any:
        error = next(answers, None)
        if error is not None:
            raise error
        return activity(handle)

    monkeypatch.setattr(module, "amdsmi_get_gpu_activity", busy_then_fine)
    source = AmdSource()
    first, second = ticks(source, fake, 2)
    assert "gpu0.util" not in first and first["gpu0.power"] == 600.0
    assert second["gpu0.util"] == 90.0 and source.errors == [] and not source.closed


def test_a_suspect_answer_with_the_gpu_still_there_skips_a_tick_and_is_not_a_loss(fake_amdsmi, monkeypatch):
    from fakeamdsmi import AMDSMI_STATUS_NOT_FOUND, AmdSmiLibraryException

    fake = fake_amdsmi()
    module = sys.modules["amdsmi"]
    usage = module.amdsmi_get_gpu_vram_usage
    refusals = iter([True, False, False])

    def once_not_found(handle: Any) -> Any:
        if next(refusals, False):
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)
        return usage(handle)

    source = AmdSource()
    monkeypatch.setattr(module, "amdsmi_get_gpu_vram_usage", once_not_found)
    first, second = ticks(source, fake, 2)
    assert first == {} and second["gpu0.mem_used"] == 16 * GIB
    assert source.describe()[0]["lost"] is None and not source.closed


def test_suspect_answers_tick_after_tick_end_the_gpu(fake_amdsmi, monkeypatch):
    from fakeamdsmi import AMDSMI_STATUS_NOT_FOUND, AmdSmiLibraryException

    fake = fake_amdsmi()
    module = sys.modules["amdsmi"]

    def never(handle: Any) -> Any:
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)

    source = AmdSource()
    monkeypatch.setattr(module, "amdsmi_get_gpu_vram_usage", never)
    ticks(source, fake, amd_source.SUSPECT_STRIKES)
    assert source.closed and source.describe()[0]["lost"]


def test_an_amd_driver_without_its_python_bindings_is_said_plainly(fake_amdsmi):
    fake = FakeAmdSmi.missing_library()
    fake.kfd = True  # /dev/kfd: the amdgpu driver is loaded
    fake_amdsmi(fake)
    message = open_gpu_sources().message or ""
    assert message.startswith("no GPU found (no NVIDIA GPU driver (NVML library not found); "
                              "an AMD GPU driver is loaded")
    assert "amdsmi Python package could not be imported" in message


def test_a_mixed_host_of_two_amd_models_describes_each(fake_amdsmi):
    fake = FakeAmdSmi([make_gpu(0), make_gpu(1, market_name="AMD Instinct MI325X", vram_total_mib=262_128)])
    fake_amdsmi(fake)
    gpus = open_gpu_sources()
    try:
        assert [d["name"] for d in gpus.devices()] == ["AMD Instinct MI300X", "AMD Instinct MI325X"]
        assert gpus.devices()[1]["memory_total"] == 256 * GIB - 16 * 2**20
    finally:
        gpus.close()


@pytest.mark.parametrize(("name", "row", "bf16_tflops", "fp8_tflops", "tf32_tflops"), [
    ("AMD Instinct MI300X", "MI300X", 1307.4, 2614.9, 653.7),
    ("AMD Instinct MI325X", "MI325X", 1307.4, 2614.9, 653.7),
    ("AMD Instinct MI250X/MI250", "MI250X (one GCD)", 191.5, None, None),  # amdsmi's name; a GCD: half the module
])
def test_amd_chips_have_dense_peaks_with_their_datasheet(name, row, bf16_tflops, fp8_tflops, tf32_tflops):
    found = chip(name)
    assert found is not None and found.chip == row and "datasheet" in found.source
    assert peak_flops(name, "bf16") == pytest.approx(bf16_tflops * 1e12)
    for dtype, tflops in (("fp8", fp8_tflops), ("tf32", tf32_tflops)):
        assert peak_flops(name, dtype) == (None if tflops is None else pytest.approx(tflops * 1e12))


MI300X_MACHINE = {"gpus": [{"index": 0, "vendor": "amd", "name": "AMD Instinct MI300X"}], "usable_cpus": 8}


@pytest.mark.parametrize(("machine", "tool"), [
    (MI300X_MACHINE, "!amd-smi metric --power --clock --temperature"),
    ({"gpus": [{"index": 0, "name": "NVIDIA H100"}], "usable_cpus": 8},  # a run saved before vendors: NVIDIA
     "!nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE"),
])
def test_a_throttled_gpu_is_sent_to_its_own_vendors_tool_and_the_code_runs(ip, machine, tool):
    from gpuwidget.advice.rules import gpu_throttled

    hot: Any = {"duration_s": 10.0, "gpu_busy_mean": 98.0, "gpu_busy_metric": "kernel_running", "gpus_judged": 1,
                "gpu_throttle_fraction": 0.5, "gpu_power_capped_fraction": 0.0, "gpu_clock_ratio_busy": 0.7}
    finding = gpu_throttled.check(hot, {}, machine)
    assert finding is not None and finding.code == tool
    assert tool[1:].split(" -")[0] in finding.suggestion
    assert ip.run_cell(finding.code).success  # a shell escape: runs (and says so) where the tool is missing


def test_a_run_saved_before_vendors_loads_with_the_drivers_index(tmp_path):
    import json
    from pathlib import Path

    from gpuwidget.run import Run

    # The dry run's small_batch run as the GPU check saved it before vendors were named (c9dbe57).
    saved = Path(__file__).parent / "fixtures" / "old-runs" / "before-vendors.json"
    assert '"nvml_index":0' in saved.read_text()  # written with the old name
    run = Run.load(saved)
    [gpu] = run.machine["gpus"]
    assert gpu["driver_index"] == 0 and gpu["vendor"] == "nvidia" and "nvml_index" not in gpu
    again = Run.load(run.save(tmp_path / "again.json"))
    assert again.machine["gpus"] == run.machine["gpus"]
    assert json.loads((tmp_path / "again.json").read_text())["machine"]["gpus"][0]["driver_index"] == 0
