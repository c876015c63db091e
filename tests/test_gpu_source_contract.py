"""The GpuSource contract, one suite run against both vendors' fakes (tests/fakenvml.py, tests/fakeamdsmi.py).

Whatever the vendor, :func:`gpuwidget.sources.gpu.open_gpu_sources` gives one source per GPU, each a
:class:`~gpuwidget.sources.gpu.GpuSource`: typed descriptions, the same columns in SI units, a field the
GPU lacks absent (never 0), slowdown and power-cap flags per tick, processes and their memory, a lost
GPU ended alone, and a GPU whose driver call hangs dropped by the sampler while the others go on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest

from gpuwidget import sampler
from gpuwidget.sampler import Sampler
from gpuwidget.sources.gpu import GpuSource, GpuSources, open_gpu_sources
from gpuwidget.trace import Trace

from fakeamdsmi import FakeAmdSmi
from fakenvml import GIB, FakeNvml


class NvidiaKit:
    """Scenarios on the fake NVML, with AMD's library missing."""

    vendor = "nvidia"
    source_name = "nvml"
    name = "NVIDIA H100 80GB HBM3"
    memory_total = 80 * GIB

    def __init__(self, install_nvml: Callable[..., FakeNvml], install_amd: Callable[..., FakeAmdSmi]) -> None:
        self._install, self._install_amd = install_nvml, install_amd
        self.fake: FakeNvml | None = None

    def gpus(self, count: int, **fields: Any) -> None:
        fields = {"power_mw": fields.pop("power_w", 250) * 1000, "util": fields.pop("util", 87), **fields}
        self._install_amd(FakeAmdSmi.missing_library())
        self.fake = self._install(FakeNvml.gpus(count, **fields))

    def no_driver(self) -> None:
        self._install_amd(FakeAmdSmi.missing_library())
        self._install(FakeNvml.library_missing())

    def driver_not_loaded(self) -> None:
        self._install_amd(FakeAmdSmi.missing_library())
        self._install(FakeNvml.driver_not_loaded())

    def step(self, ticks: int = 1) -> None:
        assert self.fake is not None
        self.fake.step(ticks)

    def power_unsupported(self, index: int) -> None:
        assert self.fake is not None
        self.fake.not_supported(index, "power")

    def slowed(self, index: int, thermal: list[bool], capped: list[bool]) -> None:
        assert self.fake is not None
        self.fake.set(index, clock_events=[(0x40 if t else 0) | (0x4 if c else 0) for t, c in zip(thermal, capped)])

    def lose(self, index: int, at_tick: int) -> None:
        assert self.fake is not None
        self.fake.lose_gpu(index, at_tick)

    def processes(self, index: int, listed: list[tuple[int, int]]) -> None:
        assert self.fake is not None
        self.fake.processes(index, compute=listed)

    def real_time(self) -> None:
        assert self.fake is not None
        self.fake.real_time = True

    def inits(self) -> int:
        assert self.fake is not None
        return self.fake.inits


class AmdKit:
    """Scenarios on the fake amdsmi (MI300X), with NVIDIA's driver missing."""

    vendor = "amd"
    source_name = "amdsmi"
    name = "AMD Instinct MI300X"
    memory_total = 196_592 * 2**20

    def __init__(self, install_nvml: Callable[..., FakeNvml], install_amd: Callable[..., FakeAmdSmi]) -> None:
        self._install_nvml, self._install = install_nvml, install_amd
        self.fake: FakeAmdSmi | None = None

    def gpus(self, count: int, **fields: Any) -> None:
        fields = {"current_socket_power": fields.pop("power_w", 250), "gfx_activity": fields.pop("util", 87),
                  **fields}
        self._install_nvml(FakeNvml.library_missing())
        self.fake = self._install(FakeAmdSmi.mi300x(count, **fields))

    def no_driver(self) -> None:
        self._install_nvml(FakeNvml.library_missing())
        self._install(FakeAmdSmi.missing_library())

    def driver_not_loaded(self) -> None:
        self._install_nvml(FakeNvml.library_missing())
        fake = FakeAmdSmi.driver_not_loaded()
        fake.kfd = True  # the driver is installed (its device node exists) but does not answer
        self._install(fake)

    def step(self, ticks: int = 1) -> None:
        assert self.fake is not None
        self.fake.step(ticks)

    def power_unsupported(self, index: int) -> None:
        assert self.fake is not None
        self.fake.not_supported(index, "amdsmi_get_power_info")

    def slowed(self, index: int, thermal: list[bool], capped: list[bool]) -> None:
        assert self.fake is not None
        self.fake.set(index, thermal_active=thermal, ppt_active=capped)

    def lose(self, index: int, at_tick: int) -> None:
        assert self.fake is not None
        self.fake.lose_gpu(index, at_tick)

    def processes(self, index: int, listed: list[tuple[int, int]]) -> None:
        assert self.fake is not None
        self.fake.set(index, processes=listed)

    def real_time(self) -> None:
        assert self.fake is not None
        self.fake.real_time = True

    def inits(self) -> int:
        assert self.fake is not None
        return self.fake.inits


@pytest.fixture(params=[NvidiaKit, AmdKit], ids=["nvidia", "amd"])
def kit(request: pytest.FixtureRequest, fake_nvml: Callable[..., FakeNvml],
        fake_amdsmi: Callable[..., FakeAmdSmi]) -> Iterator[Any]:
    yield request.param(fake_nvml, fake_amdsmi)


@pytest.fixture
def opened() -> Iterator[Callable[..., GpuSources]]:
    """open_gpu_sources(), closed when the test ends."""
    made: list[GpuSources] = []

    def open_(*args: Any, **kwargs: Any) -> GpuSources:
        made.append(open_gpu_sources(*args, **kwargs))
        return made[-1]

    yield open_
    for gpus in made:
        gpus.close()


# ------------------------------------------------------------------------------- opening


def test_each_gpu_gets_a_source_of_its_own_that_follows_the_protocol(kit, opened):
    kit.gpus(3)
    gpus = opened()

    assert gpus.found and gpus.vendor == kit.vendor and gpus.message is None and gpus.visible_count == 3
    assert len(gpus.sources) == 3
    for index, source in enumerate(gpus.sources):
        assert isinstance(source, GpuSource) and source.name == kit.source_name
        [device] = source.describe()
        assert (device["id"], device["index"], device["driver_index"], device["vendor"]) == (
            f"gpu{index}", index, index, kit.vendor)
        assert device["name"] == kit.name and device["memory_total"] == kit.memory_total
        assert device["lost"] is None and not source.closed and source.busy_with is None
    assert [d["id"] for d in gpus.devices()] == ["gpu0", "gpu1", "gpu2"]
    assert len({d["uuid"] for d in gpus.devices()}) == 3


def test_chosen_gpus_are_opened_and_a_missing_one_is_named(kit, opened):
    kit.gpus(2)
    chosen = opened([1])
    assert [d["id"] for d in chosen.devices()] == ["gpu1"]
    missing = opened([5])
    assert not missing.found and missing.missing == [5] and missing.visible_count == 2
    assert kit.inits() == 1  # the missing selection's sources were closed; [1]'s one is open


def test_without_any_driver_the_message_says_so_for_both_vendors(kit, opened):
    kit.no_driver()
    gpus = opened()
    assert not gpus.found and gpus.sources == [] and gpus.devices() == []
    assert gpus.message == "no GPU found (no NVIDIA or AMD GPU driver)"


def test_a_driver_that_does_not_start_is_named_in_the_message(kit, opened):
    kit.driver_not_loaded()
    message = opened().message
    assert message is not None and message.startswith("no GPU found (")
    assert ("NVIDIA driver is not loaded" if kit.vendor == "nvidia" else "amdsmi failed to start") in message


# ------------------------------------------------------------------------------- readings


def test_readings_are_the_same_columns_in_si_units_whatever_the_vendor(kit, opened):
    kit.gpus(1, power_w=300, util=42)
    [source] = opened().sources
    kit.step()
    reading = source.read()

    assert reading["gpu0.util"] == 42.0  # percent
    assert reading["gpu0.power"] == 300.0  # watts
    assert reading["gpu0.mem_total"] == kit.memory_total  # bytes
    assert 0 < reading["gpu0.mem_used"] < reading["gpu0.mem_total"]
    assert 1e9 < reading["gpu0.sm_clock"] <= reading["gpu0.sm_clock_max"] < 3e9  # hertz
    assert 20.0 < reading["gpu0.temperature"] < 100.0  # degrees C
    assert reading["gpu0.energy_j"] > 1e6  # joules since the driver loaded
    assert reading["gpu0.power_limit"] > 100.0 and reading["gpu0.pcie_gen"] >= 4.0
    assert (reading["gpu0.slowdown"], reading["gpu0.power_capped"]) == (0.0, 0.0)
    assert all(isinstance(value, float) for value in reading.values())
    assert source.errors == []


def test_energy_counts_the_power_drawn_between_ticks(kit, opened):
    kit.gpus(1, power_w=400)
    [source] = opened().sources
    before = source.read()["gpu0.energy_j"]
    kit.step(10)  # one second of fake time
    assert source.read()["gpu0.energy_j"] - before == pytest.approx(400.0, rel=0.01)


def test_a_field_the_gpu_lacks_is_absent_not_zero_and_asked_once(kit, opened):
    kit.gpus(1)
    kit.power_unsupported(0)
    [source] = opened().sources
    readings = []
    for _ in range(5):
        readings.append(source.read())
        kit.step()
    assert all("gpu0.power" not in r and "gpu0.util" in r for r in readings)
    assert source.errors == []  # not supported is a fact about the GPU, not an error


def test_slowdown_and_power_cap_are_flags_per_tick(kit, opened):
    kit.gpus(1)
    kit.slowed(0, thermal=[False, True, False, True], capped=[False, False, True, True])
    [source] = opened().sources
    readings = []
    for _ in range(4):
        readings.append(source.read())
        kit.step()
    assert [r["gpu0.slowdown"] for r in readings] == [0.0, 1.0, 0.0, 1.0]
    assert [r["gpu0.power_capped"] for r in readings] == [0.0, 0.0, 1.0, 1.0]


def test_processes_are_listed_and_our_own_memory_is_counted(kit, opened):
    kit.gpus(2)
    stranger = os.getppid()  # a process that exists but is not ours
    kit.processes(0, [(os.getpid(), 3 * GIB), (stranger, 5 * GIB)])
    gpus = opened()
    listed = {}
    for source in gpus.sources:
        listed.update(source.processes())
    assert listed["gpu0"] == sorted([(os.getpid(), 3 * GIB), (stranger, 5 * GIB)])
    assert listed.get("gpu1", []) == []
    assert gpus.sources[0].read()["gpu0.proc_mem"] == 3 * GIB
    assert gpus.sources[1].read()["gpu1.proc_mem"] == 0.0


# ------------------------------------------------------------------------------- faults


def test_a_lost_gpu_ends_its_own_source_and_the_others_go_on(kit, opened):
    kit.gpus(2)
    kit.lose(1, at_tick=2)
    gpus = opened()
    first, second = gpus.sources
    rows = []
    for _ in range(5):
        rows.append({**first.read(), **second.read()})
        kit.step()
    assert all("gpu0.util" in row for row in rows)
    assert ["gpu1.util" in row for row in rows] == [True, True, False, False, False]
    assert second.closed and not first.closed
    assert second.describe()[0]["lost"] and first.describe()[0]["lost"] is None
    assert any("GPU lost" in error.message for error in second.errors) and first.errors == []
    assert second.processes() == {}


def test_closing_releases_the_driver_once_per_source(kit, opened):
    kit.gpus(2)
    gpus = opened()
    assert kit.inits() == 2
    gpus.close()
    gpus.close()
    assert kit.inits() == 0
    assert all(source.read() == {} and source.closed for source in gpus.sources)


def test_a_gpu_whose_driver_call_hangs_is_dropped_alone_and_the_others_go_on(kit, opened, monkeypatch):
    """Issue 21: one GPU falling off the bus mid-query. Its source is dropped by the sampler's watchdog,
    named by the GPU it was reading; the other GPU's readings and the host's go on."""
    monkeypatch.setattr(sampler, "SOURCE_DEADLINE_S", 0.3)
    monkeypatch.setattr(sampler, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(sampler, "WATCHDOG_LATE_S", 0.1)
    kit.gpus(2)
    kit.real_time()
    gpus = opened()
    released = threading.Event()
    hang_memory_query(kit, 1, released)
    trace = Trace()
    running = Sampler(gpus.sources, trace, interval=0.02).start()
    try:
        deadline = time.monotonic() + 5
        while not running.stats.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        rows = trace.rows_total
        time.sleep(0.3)
        last = trace.last()
    finally:
        running.stop()
        released.set()
    [stalled] = running.stats.stalled
    assert stalled["source"] == "GPU 1" and running.hung_sources == [gpus.sources[1]]
    assert trace.rows_total >= rows + 5, "the other GPU stopped with the hung one"
    assert last is not None and "gpu0.util" in last[1] and "gpu1.util" not in last[1]


def hang_memory_query(kit: Any, index: int, released: threading.Event) -> None:
    """From now on, GPU ``index``'s memory query blocks until ``released`` (the vendor's own function)."""
    if kit.vendor == "nvidia":
        lost, query = kit.fake.gpu(index), pynvml.nvmlDeviceGetMemoryInfo

        def memory_info(gpu: Any, *args: Any) -> Any:
            if gpu is lost:
                released.wait(30)
            return query(gpu, *args)

        pynvml.nvmlDeviceGetMemoryInfo = memory_info  # the fake's patch restores pynvml at the end
        return
    import sys

    module, lost = sys.modules["amdsmi"], kit.fake.gpu(index)
    usage = module.amdsmi_get_gpu_vram_usage

    def vram_usage(handle: Any) -> Any:
        if handle.gpu is lost:
            released.wait(30)
        return usage(handle)

    module.amdsmi_get_gpu_vram_usage = vram_usage
