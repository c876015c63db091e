"""CUDA's numbering of NVML's devices, as plain logic over device records (no driver involved)."""

from __future__ import annotations

import pytest

from gpuwidget.facts import uuid_key
from gpuwidget.sources.nvml.devices import DeviceInfo, _cuda_order, _cuda_visible, _Found, _torch_order


def gpu(index: int, name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0),
        memory: int = 80) -> _Found:
    uuid = f"GPU-{index:08x}-0000-0000-0000-{index:012x}"
    return _Found(DeviceInfo(index=index, uuid=uuid, name=name, memory_total=memory * 2**30, capability=capability),
                  handle=None)


def names(devices: list[_Found]) -> list[int]:
    return [device.info.index for device in devices]


def test_identical_gpus_keep_pci_order_whatever_the_device_order():
    gpus = [gpu(0), gpu(1), gpu(2)]
    assert [names(_cuda_order(gpus, order)[0]) for order in (None, "FASTEST_FIRST", "PCI_BUS_ID")] == [[0, 1, 2]] * 3
    assert _cuda_order(gpus, None)[1] == "pci"


def test_mixed_models_put_the_fastest_first_by_default_and_pci_order_on_request():
    gpus = [gpu(0, "NVIDIA A40", (8, 6), 48), gpu(1), gpu(2, "NVIDIA A100-SXM4-80GB", (8, 0), 80)]
    # Newest compute capability first (9.0, 8.6, 8.0): a guess, which torch's UUIDs later replace.
    assert _cuda_order(gpus, None) == ([gpus[1], gpus[0], gpus[2]], "guessed")
    assert _cuda_order(gpus, " pci_bus_id ") == (gpus, "pci")


def test_cuda_visible_devices_ordinals_count_in_cudas_order_not_nvmls():
    ordered, _ = _cuda_order([gpu(0, "NVIDIA A40", (8, 6), 48), gpu(1)], None)
    assert names(_cuda_visible(ordered, "0")) == [1]  # CUDA's device 0 is the H100, NVML's 1
    assert names(_cuda_visible(ordered, "1,0")) == [0, 1]


@pytest.mark.parametrize(("value", "visible"), [("GPU-00000002", [2]), ("2,GPU-00000001", [2]), ("0,0", []),
                                                ("1,7,0", [1]), ("", [])])
def test_cuda_visible_devices_follows_cudas_rules(value, visible):
    assert names(_cuda_visible([gpu(0), gpu(1), gpu(2)], value)) == visible


def test_torchs_uuids_order_the_devices_only_when_they_name_exactly_them():
    visible = [gpu(0), gpu(1)]
    torch_says = [visible[1].info.uuid[4:].upper(), visible[0].info.uuid[4:]]
    assert _torch_order(visible, torch_says) == [visible[1], visible[0]]
    assert _torch_order(visible, torch_says[:1]) is None
    assert _torch_order(visible, [torch_says[0], torch_says[0]]) is None
    assert _torch_order(visible, None) is None


def test_uuid_key_makes_nvml_and_torch_spellings_equal():
    assert uuid_key("GPU-58C6ba0a-1111") == uuid_key("58c6ba0a-1111") == "58c6ba0a-1111"
    assert uuid_key("MIG-abcd") == "abcd"
