"""Workload probes: what they record, when they install, and that they always leave."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.utils.data import DataLoader, TensorDataset

from gpuwidget.probes import Probes
from gpuwidget.probes.torch_data import DataLoaderProbe, batch_device, first_dim, loader_settings
from gpuwidget.probes.torch_model import TOP_LEVEL_CALLS, CudaMemoryProbe, ModelProbe
from gpuwidget.trace import Trace

# Judges measured waits and compute against real sleeps: alone, in make test's serial pass (tests/conftest.py).
pytestmark = pytest.mark.serial


def test_waits_and_steps_are_spans_and_the_rest_is_compute():
    trace = Trace()
    probe = DataLoaderProbe(trace)
    loader = DataLoader(TensorDataset(torch.zeros(40, 3)), batch_size=8)
    probe.install()
    try:
        for _ in loader:
            time.sleep(0.02)  # the model's work: between next() calls, never a data wait
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    facts = stats.facts({id(loader): "val_loader"})
    assert facts["name"] == "val_loader" and facts["steps"] == 5 and facts["samples"] == 40
    assert facts["compute_total_s"] == pytest.approx(0.1, abs=0.03)
    assert facts["wait_total_s"] < 0.02
    assert len(trace.spans("loader.wait")) == 5
    # Five steps, the last one closed by the next() that ended the epoch.
    assert len(trace.spans("step")) == 5 and len(facts["step_times"]) == 5


def test_persistent_workers_iterator_counts_epochs_without_a_step_across_them():
    trace = Trace()
    probe = DataLoaderProbe(trace)
    loader = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=8, num_workers=1, persistent_workers=True)
    probe.install()
    try:
        for _ in range(3):
            for _ in loader:
                pass
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    assert stats.epochs == 3 and stats.steps == 6
    assert len(stats.step_times) == 6


@pytest.mark.parametrize(
    ("batch", "samples"),
    [(torch.zeros(7, 3), 7), ((torch.zeros(5), torch.zeros(5)), 5), ({"input_ids": torch.zeros(4, 9)}, 4),
     ([[torch.zeros(3, 1)]], 3), ("not a tensor", 0), (torch.tensor(1.0), 1)],
)
def test_samples_per_batch_is_the_first_dimension_of_the_first_tensor(batch, samples):
    assert first_dim(batch) == samples


@pytest.mark.parametrize(("device", "batches"), [("cpu", lambda data: data), ("meta", lambda data: data.to("meta"))])
def test_the_loader_facts_say_where_its_batches_live(device, batches):
    # "meta" stands for a dataset held on the GPU (no GPU here): anything but "cpu" has nothing to pin.
    probe = DataLoaderProbe(Trace())
    loader = DataLoader(TensorDataset(batches(torch.zeros(64, 3))), batch_size=4)
    probe.install()
    try:
        for _ in loader:
            pass
    finally:
        probe.uninstall()
    (stats,) = probe.stats
    assert stats.facts({})["batch_device"] == device


@pytest.mark.parametrize(("batch", "device"),
                         [((torch.zeros(2), 1), "cpu"), ({"ids": [torch.zeros(1, device="meta")]}, "meta"),
                          (["text"], None), (3, None)])
def test_batch_device_is_the_first_tensors(batch, device):
    assert batch_device(batch) == device


def test_loader_settings_are_plain_data():
    loader = DataLoader(TensorDataset(torch.zeros(10, 2)), batch_size=4, shuffle=True, num_workers=2,
                        prefetch_factor=3, persistent_workers=True, drop_last=True)
    settings = loader_settings(loader)
    assert settings == {**settings, "batch_size": 4, "shuffle": True, "num_workers": 2, "prefetch_factor": 3,
                        "persistent_workers": True, "drop_last": True, "dataset_len": 10,
                        "default_collate": True, "custom_sampler": False}


def test_probes_wait_for_torch_then_install_from_the_sampler_thread(monkeypatch):
    probes = Probes(Trace())
    monkeypatch.delitem(sys.modules, "torch.utils.data")
    probes.poll()
    assert probes._data is None  # never imports torch itself
    monkeypatch.undo()
    probes.poll()
    try:
        assert probes._data is not None and probes._data.installed
    finally:
        probes.uninstall()
    assert not probes._data.installed


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_model_probe_finds_the_model_its_dtypes_and_autocast_then_unhooks_itself():
    probe = ModelProbe()
    net, loss = Net(), torch.nn.CrossEntropyLoss()
    probe.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(TOP_LEVEL_CALLS):
                loss(net(torch.randn(3, 4)).float(), torch.zeros(3, dtype=torch.long))
        # After its first top-level calls the probe removed its global hooks by itself.
        assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    finally:
        probe.uninstall()
    facts = probe.facts({id(net): "net"})
    assert facts["name"] == "net" and facts["class"] == "Net"
    assert facts["param_dtypes"] == {"float32": sum(p.numel() for p in net.parameters())}
    assert facts["param_devices"] == ["cpu"]
    assert facts["autocast"] == {"enabled": True, "dtype": "bfloat16", "device_type": "cpu"}
    assert facts["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_model_probe_survives_a_forward_that_raises():
    probe = ModelProbe()

    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("shape mismatch")

    probe.install()
    try:
        with pytest.raises(ValueError):
            Broken()(torch.zeros(1))
        net = Net()
        net(torch.zeros(2, 4))  # still seen as a top-level call after the failure
    finally:
        probe.uninstall()
    assert probe.facts({id(net): "net"})["name"] == "net"


def test_cuda_memory_facts_where_cuda_is_present(monkeypatch):
    calls = []
    fake = SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, device_count=lambda: 1,
        reset_peak_memory_stats=lambda i: calls.append(("reset", i)),
        get_device_properties=lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30),
        get_device_capability=lambda i: (9, 0),
        max_memory_allocated=lambda i: 30 * 2**30, max_memory_reserved=lambda i: 34 * 2**30,
    )
    monkeypatch.setattr(torch, "cuda", fake)
    probe = CudaMemoryProbe()
    probe.install()
    facts = probe.facts()
    assert calls == [("reset", 0)] and facts["peak_since_cell_start"]
    (device,) = facts["devices"]
    assert device == {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "total_memory": 141 * 2**30,
                      "peak_allocated": 30 * 2**30, "peak_reserved": 34 * 2**30}


def test_no_cuda_means_no_cuda_facts():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    probe = CudaMemoryProbe()
    probe.install()
    assert probe.facts() is None


WAIT_S = 400e-6  # a wait of a fraction of a millisecond, about as long as the step's own work


class ShortWaits(torch.utils.data.Dataset):
    """Each sample takes 400 us in ``__getitem__``: asleep (a storage read) or on the CPU (decoding).

    The loader's own work for a batch of one (its sampler, fetch and collate) is CPU a sleeping wait
    takes too: ~50 us here, 0.20 of a 150 us sleep's wait on a quiet VM and 0.35 once on a fresh one
    beside a busy neighbour, over the 0.25 that reads as asleep. Against 400 us it is ~0.10."""

    def __init__(self, asleep: bool) -> None:
        self.asleep = asleep

    def __len__(self) -> int:
        return 800

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.asleep:
            time.sleep(WAIT_S)
        else:  # on the clock that makes no system call: torch's own math makes none either
            end = time.perf_counter() + WAIT_S
            while time.perf_counter() < end:
                pass
        return torch.zeros(1)


@pytest.mark.parametrize("asleep", [True, False], ids=["asleep", "computing"])
def test_a_short_wait_reads_the_cpu_it_took_not_the_work_before_it(asleep: bool):
    """Waits of a fraction of a millisecond after 0.3 ms of the loop's own work each. schedstat's on-CPU
    figure, read by the thread itself, measured the work *before* each wait (at 7a85613 the sleeping
    loader read 1.35 CPU seconds a wall second, as if it computed): the thread's CPU clock reads the wait."""
    probe = DataLoaderProbe(Trace())
    loader = DataLoader(ShortWaits(asleep), batch_size=1)
    probe.install()
    try:
        for _ in loader:
            end = time.perf_counter() + 300e-6  # the step's own work, with no system call
            while time.perf_counter() < end:
                pass
    finally:
        probe.uninstall()
    facts = probe.stats[0].facts({})
    assert facts["wait_cpu_clock"] == "thread" and facts["wait_samples"] >= 64
    if asleep:
        assert facts["wait_cpu_ratio"] < 0.25  # IO_WAIT_RATIO: asleep
    else:
        assert facts["wait_cpu_ratio"] > 0.5  # CPU_WORK_RATIO: computing
