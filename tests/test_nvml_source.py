"""NvmlSource against a fake NVML: units, unsupported fields, lost GPUs, drivers, MIG, device selection."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from gpuwidget.sources.base import Source
from gpuwidget.sources.nvml import NvmlSource, list_devices

import fakenvml
from fakenvml import GIB, FakeNvml

fake_nvml = fakenvml.fake_nvml  # the fixture lives with the fake

ROOT = Path(__file__).resolve().parents[1]


def ticks(source: NvmlSource, fake: FakeNvml, count: int) -> list[dict[str, float]]:
    """``count`` reads, one fake tick (0.1 s) apart."""
    readings = []
    for _ in range(count):
        readings.append(source.read())
        fake.step()
    return readings


def gpu_ids(reading: dict[str, float]) -> set[str]:
    return {key.split(".")[0] for key in reading}


# -- values and units ----------------------------------------------------------------------------------


def test_one_gpu_reports_every_metric_in_si_units(fake_nvml):
    fake = fake_nvml(FakeNvml.single(gpm=False))
    source = NvmlSource()
    reading = source.read()

    assert isinstance(source, Source)
    assert source.available and source.unavailable_reason is None
    assert reading["gpu0.util"] == 87.0
    assert reading["gpu0.mem_util"] == 35.0
    assert reading["gpu0.mem_used"] == 20 * GIB  # bytes, from the v2 struct
    assert reading["gpu0.mem_total"] == 80 * GIB
    assert reading["gpu0.power"] == 250.0  # W from 250000 mW
    assert reading["gpu0.power_limit"] == 700.0
    assert reading["gpu0.temperature"] == 61.0
    assert reading["gpu0.sm_clock"] == 1755e6  # Hz from MHz
    assert reading["gpu0.sm_clock_max"] == 1980e6
    assert (reading["gpu0.slowdown"], reading["gpu0.power_capped"]) == (0.0, 0.0)
    assert reading["gpu0.pcie_tx"] == 2048 * 1024  # bytes/s from KiB/s
    assert reading["gpu0.pcie_rx"] == 4096 * 1024
    assert reading["gpu0.proc_mem"] == 0.0
    assert all(isinstance(value, float) for value in reading.values())
    assert source.errors == []
    assert fake.unfaked_calls == []


def test_values_follow_the_gpu_from_tick_to_tick(fake_nvml):
    fake = fake_nvml(
        FakeNvml.single(power_mw=[100_000, 200_000, 300_000], util=[0, 50, 100, 100, 100],
                        clock_events=[0, 0, 0x8, 0x4, 0x1])
    )
    source = NvmlSource()

    readings = ticks(source, fake, 5)

    assert [r["gpu0.power"] for r in readings[:3]] == [100.0, 200.0, 300.0]
    assert [r["gpu0.util"] for r in readings[:3]] == [0.0, 50.0, 100.0]
    # NVML's clock-event bits as the vendor-neutral flags: hardware slowdown (0x8), then the software
    # power cap (0x4); while the GPU idles (0x1) its low clocks are on purpose: neither flag.
    assert [r.get("gpu0.slowdown") for r in readings] == [0.0, 0.0, 1.0, 0.0, None]
    assert [r.get("gpu0.power_capped") for r in readings] == [0.0, 0.0, 0.0, 1.0, None]


def test_util_is_the_mean_of_the_drivers_samples_since_the_last_tick(fake_nvml):
    fake = fake_nvml(FakeNvml.single(util=5, util_samples=[[10, 90], [20, 40], [0, 0, 30]]))
    source = NvmlSource()

    first = source.read()["gpu0.util"]  # the buffer reaches back before us: newest sample only
    fake.step()
    second = source.read()["gpu0.util"]
    again = source.read()["gpu0.util"]  # no newer sample (NotFound): the driver's current figure
    fake.step()
    third = source.read()["gpu0.util"]

    assert (first, second, again, third) == (90.0, 30.0, 5.0, 10.0)
    assert source.errors == []


def test_gpm_reports_sm_and_tensor_activity_from_sample_pairs_100ms_apart(fake_nvml):
    fake = fake_nvml(FakeNvml.single(tensor_active=[10.0, 20.0, 30.0]))
    source = NvmlSource()

    readings = ticks(source, fake, 3)

    assert "gpu0.sm_active" not in readings[0]  # one sample is not a pair yet
    assert readings[1]["gpu0.sm_active"] == 60.0
    assert readings[1]["gpu0.sm_occupancy"] == 30.0
    assert readings[1]["gpu0.dram_active"] == 40.0
    assert [r["gpu0.tensor_active"] for r in readings[1:]] == [20.0, 30.0]
    assert readings[2]["gpu0.pcie_tx"] == 3 * 1024 * 1024  # GPM's MiB/s, without blocking
    assert fake.count("nvmlDeviceGetPcieThroughput") == 0
    assert source.errors == []  # no pair closer than 100 ms was asked for


def test_gpm_pairs_are_never_closer_than_100ms_when_ticks_are_faster(fake_nvml):
    fake = fake_nvml(FakeNvml(FakeNvml.single().devices, tick_s=0.04))
    source = NvmlSource()

    readings = ticks(source, fake, 20)

    assert source.errors == []
    assert fake.count("nvmlGpmMetricsGet") <= 8  # 0.8 s of ticks, one pair per >= 100 ms
    assert all("gpu0.sm_active" in r for r in readings[3:])  # last value repeats in between


# -- several GPUs, selection and CUDA_VISIBLE_DEVICES ---------------------------------------------------


def test_eight_gpus_all_report(fake_nvml):
    fake_nvml(FakeNvml.gpus(8))
    reading = NvmlSource().read()

    assert gpu_ids(reading) == {f"gpu{i}" for i in range(8)}
    assert all(f"gpu{i}.mem_used" in reading and f"gpu{i}.util" in reading for i in range(8))


def test_gpus_argument_selects_cuda_devices(fake_nvml):
    fake_nvml(FakeNvml.gpus(4))
    source = NvmlSource(gpus=[1])

    assert gpu_ids(source.read()) == {"gpu1"}
    assert [d["index"] for d in source.describe()] == [1]


def test_a_requested_gpu_that_is_not_visible_is_an_error_not_a_crash(fake_nvml):
    fake_nvml(FakeNvml.gpus(2))
    source = NvmlSource(gpus=[1, 5])

    assert gpu_ids(source.read()) == {"gpu1"}
    assert source.missing == [5]
    assert source.visible_count == 2
    assert any("GPU 5 requested" in error.message for error in source.errors)


def test_asking_only_for_gpus_that_are_not_visible_makes_the_source_unavailable(fake_nvml):
    fake_nvml(FakeNvml.gpus(2))
    source = NvmlSource(gpus=[3])

    assert not source.available
    assert source.unavailable_reason == "GPU 3 is not visible to CUDA (2 visible)"
    assert source.missing == [3] and source.describe() == []
    assert source.read() == {}


def test_cuda_visible_devices_by_index_renumbers_like_cuda(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.gpus(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    devices = NvmlSource().describe()

    assert [(d["id"], d["driver_index"]) for d in devices] == [("gpu0", 2), ("gpu1", 0)]
    assert devices[0]["uuid"] == fake.gpu(2).uuid


def test_cuda_visible_devices_by_uuid_prefix(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.gpus(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", fake.gpu(3).uuid[:12])  # "GPU-000000a3"
    devices = NvmlSource().describe()

    assert [(d["id"], d["uuid"]) for d in devices] == [("gpu0", fake.gpu(3).uuid)]


@pytest.mark.parametrize(
    ("value", "visible_nvml_indexes"),
    [
        ("1,x,2", [1]),  # an invalid entry ends the list there
        ("1,7,2", [1]),  # so does an ordinal with no GPU behind it
        ("0,GPU-000000a2", [0]),  # switching from ordinals to UUIDs is invalid
        ("GPU-000000a", []),  # an ambiguous prefix matches nothing
        ("0,1,0", []),  # a repeated device hides them all
        (" 3 , 1", [3, 1]),  # spaces are ignored
        ("-1", []),  # the usual way to hide every GPU
    ],
)
def test_cuda_visible_devices_follows_cudas_parsing_rules(
    fake_nvml, monkeypatch, value, visible_nvml_indexes
):
    fake_nvml(FakeNvml.gpus(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    source = NvmlSource()

    assert [d["driver_index"] for d in source.describe()] == visible_nvml_indexes
    assert source.available == bool(visible_nvml_indexes)


def test_empty_cuda_visible_devices_means_no_gpu(fake_nvml, monkeypatch):
    fake_nvml(FakeNvml.gpus(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    source = NvmlSource()

    assert not source.available
    assert source.unavailable_reason == "no NVIDIA GPU visible to CUDA (CUDA_VISIBLE_DEVICES='')"
    assert source.read() == {}


# -- MIG ---------------------------------------------------------------------------------------------


def test_mig_instance_is_shown_as_itself(fake_nvml):
    fake = fake_nvml(FakeNvml.mig())
    source = NvmlSource()
    reading = ticks(source, fake, 3)[-1]
    (device,) = source.describe()

    # CUDA sees one MIG instance: the first of the first MIG-enabled GPU.
    assert device["name"] == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert device["is_mig"] and device["parent_uuid"] == fake.gpu(0).uuid
    assert reading["gpu0.mem_total"] == 20 * GIB  # the instance's memory, not the GPU's 40 GiB
    assert reading["gpu0.mem_used"] == 1 * GIB
    for whole_gpu_metric in ("util", "mem_util", "power", "temperature", "pcie_tx"):
        assert f"gpu0.{whole_gpu_metric}" not in reading
    assert source.errors == []


def test_cuda_visible_devices_by_mig_uuid(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.mig(extra_gpus=1))
    second = fake.gpu(0).instances[1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", second.uuid)
    source = NvmlSource()

    assert [d["uuid"] for d in source.describe()] == [second.uuid]
    assert source.read()["gpu0.mem_total"] == 10 * GIB


def test_only_one_mig_instance_is_visible_to_cuda(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.mig())
    first, second = fake.gpu(0).instances
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{second.uuid},{first.uuid}")

    assert [d["uuid"] for d in NvmlSource().describe()] == [second.uuid]


def test_mig_instance_gets_gpm_activity_through_its_parent(fake_nvml):
    fake = fake_nvml(FakeNvml.mig())
    fake.gpu(0).gpm = True
    fake.set(fake.gpu(0).instances[0].uuid, tensor_active=12.0)
    source = NvmlSource()

    reading = ticks(source, fake, 3)[-1]

    assert reading["gpu0.tensor_active"] == 12.0
    assert fake.count("nvmlGpmMigSampleGet") == 3 and fake.count("nvmlGpmSampleGet") == 0
    assert source.errors == []


def test_cuda_visible_devices_legacy_mig_form(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.mig())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{fake.gpu(0).uuid}/5/0")

    assert [d["uuid"] for d in NvmlSource().describe()] == [fake.gpu(0).instances[1].uuid]


def test_list_devices_shows_every_device_and_which_cuda_sees(fake_nvml):
    fake = fake_nvml(FakeNvml.mig(extra_gpus=1))
    devices = list_devices()

    assert [(d.uuid, d.is_mig, d.cuda_index) for d in devices] == [
        (fake.gpu(0).uuid, False, None),  # MIG parent: CUDA uses its instances
        (fake.gpu(0).instances[0].uuid, True, 0),
        (fake.gpu(0).instances[1].uuid, True, None),
        (fake.gpu(1).uuid, False, None),  # hidden by CUDA while a MIG instance is visible
    ]
    assert devices[1].parent_uuid == fake.gpu(0).uuid and devices[1].memory_total == 20 * GIB
    assert devices[3].pci_bus_id == "00000000:19:00.0"
    json.dumps([d.to_dict() for d in devices])
    assert fake.inits == 0  # list_devices shuts NVML down again


# -- degraded hardware and drivers ----------------------------------------------------------------------


def test_unsupported_field_is_absent_not_zero_and_the_rest_remains(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(2).not_supported(0, "power", "temperature"))
    source = NvmlSource()
    reading = ticks(source, fake, 5)[-1]

    assert "gpu0.power" not in reading and "gpu0.temperature" not in reading
    assert reading["gpu0.util"] == 87.0 and reading["gpu0.power_limit"] == 700.0
    assert reading["gpu1.power"] == 250.0
    assert source.errors == []
    assert fake.count("nvmlDeviceGetPowerUsage", 0) == 1  # not asked again once NotSupported


def test_lost_gpu_stops_alone_with_its_error_recorded(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(2).lose_gpu(1, at_tick=3))
    source = NvmlSource()

    readings = ticks(source, fake, 6)

    assert [gpu_ids(r) for r in readings] == [{"gpu0", "gpu1"}] * 3 + [{"gpu0"}] * 3
    assert [(e.device, "GPU lost" in e.message) for e in source.errors] == [("gpu1", True)]
    assert "GPU is lost" in source.errors[0].message
    assert source.describe()[1]["lost"]
    assert not source.closed


def test_unknown_error_on_every_tick_ends_the_device_after_three(fake_nvml, monkeypatch):
    fake_nvml(FakeNvml.gpus(2))

    def broken(handle: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    source = NvmlSource(gpus=[0])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", broken)

    assert [source.read() for _ in range(3)] == [{}, {}, {}]
    assert source.closed  # its only GPU is gone
    assert any("Unknown Error" in e.message and "lost" in e.message for e in source.errors)


def test_unknown_error_with_the_uuid_unanswered_ends_the_device_at_once(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.gpus(2))
    source = NvmlSource()
    fake.unknown_at(1, "nvmlDeviceGetPowerUsage", 1).unknown_at(1, "nvmlDeviceGetUUID", 1)
    fake.step()

    assert gpu_ids(source.read()) == {"gpu0"}
    assert source.describe()[1]["lost"]


def test_one_unknown_error_loses_a_tick_not_the_gpu(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(2).unknown_at(1, "nvmlDeviceGetPowerUsage", 2))
    source = NvmlSource()

    readings = ticks(source, fake, 6)

    assert [gpu_ids(r) for r in readings] == [{"gpu0", "gpu1"}] * 2 + [{"gpu0"}] + [{"gpu0", "gpu1"}] * 3
    assert not source.describe()[1]["lost"]
    assert any("Unknown Error" in e.message and "still answers" in e.message for e in source.errors)


def test_one_unknown_error_while_listing_gpus_does_not_leave_the_gpu_out(fake_nvml):
    fake_nvml(FakeNvml.gpus(2).unknown_at(1, "nvmlDeviceGetName", 0))
    assert [d["driver_index"] for d in NvmlSource().describe()] == [0, 1]


def test_every_gpu_lost_closes_the_source(fake_nvml):
    fake = fake_nvml(FakeNvml.single().lose_gpu(0, at_tick=1))
    source = NvmlSource()

    readings = ticks(source, fake, 3)

    assert readings[0] and readings[1:] == [{}, {}]
    assert source.closed


@pytest.mark.parametrize(
    ("scenario", "detail"),
    [
        (FakeNvml.library_missing, "NVML library not found"),
        (FakeNvml.driver_not_loaded, "driver is not loaded"),
    ],
)
def test_no_driver_means_unavailable_with_a_reason(fake_nvml, scenario, detail):
    fake_nvml(scenario())
    source = NvmlSource()

    assert not source.available
    assert detail in source.unavailable_reason
    assert source.read() == {} and source.read() == {}
    assert source.describe() == []
    assert list_devices() == []
    source.close()


def test_zero_gpus_means_unavailable(fake_nvml):
    fake = fake_nvml(FakeNvml.no_devices())
    source = NvmlSource()

    assert not source.available
    assert source.unavailable_reason == "the NVIDIA driver lists no GPU"
    assert source.read() == {}
    source.close()
    assert fake.shutdowns == 1


def test_a_bindings_error_loses_the_field_not_the_tick(fake_nvml, monkeypatch):
    fake = fake_nvml()

    def broken(handle: object) -> int:
        raise TypeError("struct layout changed")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", broken)
    source = NvmlSource()
    readings = ticks(source, fake, 5)

    assert all("gpu0.power" not in r and "gpu0.util" in r for r in readings)
    assert len(source.errors) == 1 and "struct layout changed" in source.errors[0].message


def test_old_driver_falls_back_and_logs_each_missing_function_once(fake_nvml, caplog):
    fake = fake_nvml(FakeNvml.old_driver().processes(0, compute=[(os.getpid(), 3 * GIB)]))
    caplog.set_level(logging.WARNING, logger="gpuwidget")
    source = NvmlSource()

    readings = ticks(source, fake, 30)

    last = readings[-1]
    assert last["gpu0.util"] == 87.0  # from nvmlDeviceGetUtilizationRates
    assert last["gpu0.slowdown"] == 0.0  # from ...ThrottleReasons
    assert last["gpu0.mem_used"] == 20 * GIB + GIB // 2  # the v1 struct counts reserved memory
    assert last["gpu0.proc_mem"] == 3 * GIB  # from the _v2 process list
    assert "gpu0.sm_active" not in last
    assert last["gpu0.pcie_tx"] == 2048 * 1024
    messages = [record.getMessage() for record in caplog.records]
    assert fake.count("nvmlDeviceGetSamples") == 30  # real drivers have it since Kepler
    for function in ("nvmlGpmQueryDeviceSupport",):
        logged = [m for m in messages if function in m]
        assert len(logged) == 1, messages
        assert "older than nvidia-ml-py" in logged[0] and "470.256.02" in logged[0]
        assert fake.count(function) == 1  # not asked again
    # Functions with an older stand-in are not worth a warning.
    for quiet in ("ClocksEventReasons", "MemoryInfo_v2", "RunningProcesses_v3"):
        assert not any(quiet in m for m in messages)
    assert fake.unfaked_calls == []


def test_new_driver_logs_nothing(fake_nvml, caplog):
    fake = fake_nvml(FakeNvml.new_driver())
    caplog.set_level(logging.WARNING, logger="gpuwidget")
    source = NvmlSource()
    ticks(source, fake, 10)

    assert caplog.records == [] and source.errors == []


# -- processes -----------------------------------------------------------------------------------------


def test_proc_mem_sums_only_our_pids(fake_nvml):
    fake_nvml(
        FakeNvml.single().processes(
            0,
            compute=[(100, 1 * GIB), (200, 5 * GIB)],
            graphics=[(101, 2 * GIB), (100, 1 * GIB)],  # 100 has both contexts: counted once
        )
    )
    source = NvmlSource(pids=lambda: [100, 101])

    assert source.read()["gpu0.proc_mem"] == 3 * GIB


def test_proc_mem_by_default_counts_this_process_and_its_children(fake_nvml):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fake = fake_nvml(
            FakeNvml.single().processes(
                0, compute=[(os.getpid(), 2 * GIB), (child.pid, 1 * GIB), (2**22 + 12345, 7 * GIB), (os.getppid(), GIB)]
            )
        )
        source = NvmlSource()
        readings = ticks(source, fake, 3)
    finally:
        child.kill()
        child.wait()

    assert [r["gpu0.proc_mem"] for r in readings] == [3 * GIB] * 3


def test_no_permission_on_processes_drops_proc_mem_and_records_it_once(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(2).no_permission(0, "processes"))
    source = NvmlSource()

    readings = ticks(source, fake, 10)

    assert all("gpu0.proc_mem" not in r and "gpu0.util" in r for r in readings)
    assert all(r["gpu1.proc_mem"] == 0.0 for r in readings)
    assert [(e.device, "permission" in e.message) for e in source.errors] == [("gpu0", True)]


def test_process_listed_without_its_memory_drops_proc_mem(fake_nvml):
    fake = fake_nvml(FakeNvml.single().processes(0, compute=[(os.getpid(), None)]))
    source = NvmlSource()

    readings = ticks(source, fake, 3)

    assert all("gpu0.proc_mem" not in r for r in readings)
    assert len(source.errors) == 1


# -- cost and life cycle -------------------------------------------------------------------------------


def test_pcie_is_read_at_most_once_per_second_per_gpu(fake_nvml):
    fake = fake_nvml(FakeNvml.single(gpm=False))
    source = NvmlSource()

    readings = ticks(source, fake, 35)  # 3.5 s at 10 Hz

    calls = fake.count("nvmlDeviceGetPcieThroughput")
    assert 2 * 3 <= calls <= 2 * 4  # TX and RX, at 0 s, ~1 s, ~2 s, ~3 s
    assert all("gpu0.pcie_tx" in r for r in readings)  # the last value repeats in between


def test_pcie_blocks_for_at_most_one_gpu_per_tick(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(8, gpm=False))
    source = NvmlSource()
    per_tick = []
    for _ in range(40):
        before = fake.count("nvmlDeviceGetPcieThroughput")
        source.read()
        per_tick.append(fake.count("nvmlDeviceGetPcieThroughput") - before)
        fake.step()

    assert max(per_tick) == 2
    for index in range(8):
        assert 2 <= fake.count("nvmlDeviceGetPcieThroughput", index) <= 2 * 4


def test_static_facts_are_not_asked_every_tick(fake_nvml):
    fake = fake_nvml()
    source = NvmlSource()
    readings = ticks(source, fake, 20)

    assert all("gpu0.sm_clock_max" in r and "gpu0.power_limit" in r for r in readings)
    assert fake.count("nvmlDeviceGetMaxClockInfo") == 1
    assert fake.count("nvmlDeviceGetEnforcedPowerLimit") == 1  # re-read every 10 s


def test_close_is_idempotent_and_shuts_nvml_down_once(fake_nvml):
    fake = fake_nvml()
    source = NvmlSource()
    ticks(source, fake, 3)

    source.close()
    source.close()

    assert fake.shutdowns == 1 and fake.inits == 0
    assert fake.gpm_samples_alive == 0
    assert source.read() == {}
    assert source.closed


def test_describe_is_json_and_says_what_was_found(fake_nvml):
    fake = fake_nvml(FakeNvml.gpus(2))
    source = NvmlSource()
    description = json.loads(json.dumps(source.describe()))

    assert source.available and source.driver_version == "580.65.06"
    assert [d["uuid"] for d in description] == [fake.gpu(0).uuid, fake.gpu(1).uuid]
    assert description[0]["name"] == "NVIDIA H100 80GB HBM3" and description[0]["vendor"] == "nvidia"
    assert description[0]["memory_total"] == 80 * GIB
    assert description[0]["gpm"] is True


def test_importing_the_module_does_not_import_pynvml():
    code = "import sys, gpuwidget.sources.nvml; print('pynvml' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.strip() == "False"


def test_one_tick_is_cheap_against_a_zero_latency_driver(fake_nvml):
    import time

    fake = fake_nvml(FakeNvml.gpus(8))
    source = NvmlSource()
    ticks(source, fake, 5)
    started = time.process_time()
    count = 200
    for _ in range(count):
        source.read()
        fake.step()
    per_gpu_tick = (time.process_time() - started) / count / 8
    # Budget: 200 us of our own CPU per GPU per tick; this figure includes the fake's own work,
    # and a loose factor keeps slow CI machines from failing it.
    assert per_gpu_tick < 3 * 200e-6, f"{per_gpu_tick * 1e6:.0f} us per GPU per tick"
    assert math.isfinite(per_gpu_tick)


# -- the driver as strict as the hardware (issue 15) -------------------------------------------------


def test_idle_gpu_with_no_new_samples_reads_idle_not_its_last_busy_value(fake_nvml):
    # The driver records no sample while the GPU is idle; the last busy mean must not repeat.
    fake = fake_nvml(FakeNvml.single(util=[97, 97, 0, 0, 0, 0, 0, 0]))
    source = NvmlSource()

    utils = [r["gpu0.util"] for r in ticks(source, fake, 8)]

    assert utils == [97.0, 97.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert fake.count("nvmlDeviceGetSamples") == 8 and source.errors == []


def test_power_limit_default_pcie_link_and_nvlink_are_reported(fake_nvml):
    fake = fake_nvml(FakeNvml.single(power_limit_mw=500_000, pcie_gen=[1, 4], pcie_width=8))
    source = NvmlSource()

    first, second, *_ = ticks(source, fake, 12)

    assert first["gpu0.power_limit"] == 500.0 and first["gpu0.power_limit_default"] == 700.0
    assert (first["gpu0.pcie_gen"], first["gpu0.pcie_width"]) == (1.0, 8.0)
    assert (first["gpu0.pcie_gen_max"], first["gpu0.pcie_width_max"]) == (5.0, 16.0)
    assert second["gpu0.pcie_gen"] == 1.0  # the link is re-read once a second, not every tick
    assert source.read()["gpu0.pcie_gen"] == 4.0
    assert second["gpu0.nvlink_tx"] == 100.0 * 2**20 and second["gpu0.nvlink_rx"] == 120.0 * 2**20
    device = source.describe()[0]
    assert (device["power_limit_default"], device["pcie_gen_max"], device["capability"]) == (700.0, 5, [9, 0])


def test_mixed_gpus_are_numbered_fastest_first_like_cuda(fake_nvml, monkeypatch):
    fake_nvml(FakeNvml.mixed())
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    source = NvmlSource()

    described = source.describe()
    assert [(d["id"], d["name"], d["driver_index"]) for d in described] == [
        ("gpu0", "NVIDIA H100 80GB HBM3", 1), ("gpu1", "NVIDIA A40", 0)]
    assert source.cuda_order == "guessed"
    # An ordinal in CUDA_VISIBLE_DEVICES counts in CUDA's order too.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [d["name"] for d in NvmlSource().describe()] == ["NVIDIA H100 80GB HBM3"]


def test_pci_bus_id_order_keeps_nvmls_numbering(fake_nvml, monkeypatch):
    fake_nvml(FakeNvml.mixed())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    source = NvmlSource()
    assert [d["name"] for d in source.describe()] == ["NVIDIA A40", "NVIDIA H100 80GB HBM3"]
    assert source.cuda_order == "pci"


def test_torchs_uuids_fix_the_order_once_torch_has_started_cuda(fake_nvml, monkeypatch):
    fake = fake_nvml(FakeNvml.mixed())
    import gpuwidget.sources.nvml.devices as nvml_devices

    # torch numbers the A40 first (say, CUDA's heuristic preferred it): its UUIDs decide.
    a40, h100 = fake.gpu(0).uuid, fake.gpu(1).uuid
    monkeypatch.setattr(nvml_devices, "_torch_uuids", lambda: [a40[4:], h100[4:]])
    source = NvmlSource()
    assert [d["uuid"] for d in source.describe()] == [a40, h100]
    assert source.cuda_order == "torch"


def test_in_a_container_own_memory_is_absent_not_zero_and_the_namespace_is_said(fake_nvml):
    fake = fake_nvml(FakeNvml.single().in_container(used=3 * GIB))
    source = NvmlSource()

    reading = ticks(source, fake, 3)[-1]

    assert "gpu0.proc_mem" not in reading
    assert source.foreign_pid_namespace is True and source.describe()[0]["foreign_pid_namespace"] is True
    assert sum("own PID namespace" in e.message for e in source.errors) == 1


def test_a_nested_pid_namespace_is_matched_through_nspid(fake_nvml, monkeypatch, tmp_path):
    fake = fake_nvml(FakeNvml.single())
    host_pid = fake.host_pid()
    fake.processes(0, compute=[(host_pid, 3 * GIB)])
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nNSpid:\t{host_pid}\t{os.getpid()}\n")
    import gpuwidget.sources.pids as pids

    monkeypatch.setattr(pids, "PROC_SELF_STATUS", str(status))
    source = NvmlSource()

    assert source.read()["gpu0.proc_mem"] == 3 * GIB
    assert source.foreign_pid_namespace is True


def test_early_r535_process_struct_is_detected_and_v2_used(fake_nvml):
    other = os.getppid()
    fake = fake_nvml(FakeNvml.single().r535_process_struct()
                     .processes(0, compute=[(other, 5 * GIB), (os.getpid(), 3 * GIB)]))
    source = NvmlSource()

    reading = ticks(source, fake, 3)[-1]

    assert reading["gpu0.proc_mem"] == 3 * GIB  # misread, our entry would be garbage
    assert source.processes()["gpu0"] == sorted([(other, 5 * GIB), (os.getpid(), 3 * GIB)])
    assert sum("R535" in e.message for e in source.errors) == 1
    assert fake.count("nvmlDeviceGetComputeRunningProcesses_v2") >= 3


def test_shutting_nvml_down_more_often_than_it_started_is_no_error(fake_nvml):
    fake = fake_nvml()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    pynvml.nvmlShutdown()  # nvml.h: no error when called more times than nvmlInit
    assert fake.inits == 0 and fake.shutdowns == 1
