"""Finding AMD GPUs and numbering them as HIP (and so torch's ROCm build) does.

amdsmi lists one processor handle per device the driver exposes: a whole GPU, or each of its compute
partitions (XCPs) when the GPU is split (CPX, DPX... mode, MIG's counterpart), in the order amd-smi
numbers them (``driver_index``). A process sees the devices ``ROCR_VISIBLE_DEVICES`` leaves (applied
first, by the ROCm runtime), then among those the ones ``HIP_VISIBLE_DEVICES`` names, or
``CUDA_VISIBLE_DEVICES`` where HIP's own is unset (HIP honours it, as torch's ROCm build documents).
Entries are indexes or UUIDs (``GPU-<uuid>``, any unique prefix); an invalid entry ends the list there.

The matching is plain logic over :class:`Found` records (tests build them without a driver); only
:func:`enumerate_devices` asks the driver, through :mod:`.driver`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwidget.facts import uuid_key
from gpuwidget.sources.amd.driver import MIB, Absent, _DeviceSuspect, _Driver

# The environment variables that pick the devices a process sees, in the order they apply.
VISIBILITY = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


@dataclass
class Found:
    """One device as amdsmi lists it, with the static facts read once."""

    handle: Any
    driver_index: int
    uuid: str
    name: str
    bdf: str | None = None
    memory_total: int | None = None  # bytes
    arch: str | None = None  # "gfx942"
    serial: str | None = None
    compute_partition: str | None = None  # "SPX", "CPX"...
    memory_partition: str | None = None  # "NPS1"...
    partition_id: int | None = None  # this device's partition on its GPU (0 for a whole GPU)


def enumerate_devices(driver: _Driver) -> list[Found]:
    """Every device amdsmi lists, in its order; a device that does not answer is left out."""
    handles = driver.query("amdsmi_get_processor_handles")
    if isinstance(handles, Absent):
        return []
    found: list[Found] = []
    for index, handle in enumerate(handles):
        try:
            device = _describe(driver, handle, index)
        except _DeviceSuspect as gone:
            driver.report_once(f"GPU {index} does not answer and is left out ({gone})", f"amd{index}")
            continue
        if device is not None:
            found.append(device)
    return found


def _describe(driver: _Driver, handle: Any, index: int) -> Found | None:
    uuid = driver.query("amdsmi_get_gpu_device_uuid", handle)
    if isinstance(uuid, Absent):
        return None
    asic = driver.query("amdsmi_get_gpu_asic_info", handle)
    asic = asic if isinstance(asic, Mapping) else {}
    vram = driver.query("amdsmi_get_gpu_vram_usage", handle)
    total = vram.get("vram_total") if isinstance(vram, Mapping) else None
    board = driver.query("amdsmi_get_gpu_board_info", handle, quiet=True)
    kfd = driver.query("amdsmi_get_gpu_kfd_info", handle, quiet=True)
    bdf = driver.query("amdsmi_get_gpu_device_bdf", handle)
    serial = (_text(board.get("product_serial")) if isinstance(board, Mapping) else None) or \
        _text(asic.get("asic_serial"))
    return Found(
        handle=handle,
        driver_index=index,
        uuid=str(uuid),
        name=_text(asic.get("market_name")) or "AMD GPU",
        bdf=None if isinstance(bdf, Absent) else str(bdf),
        memory_total=int(total) * MIB if isinstance(total, int) else None,
        arch=_text(asic.get("target_graphics_version")),
        serial=serial,
        compute_partition=_text(driver.query("amdsmi_get_gpu_compute_partition", handle, quiet=True)),
        memory_partition=_text(driver.query("amdsmi_get_gpu_memory_partition", handle, quiet=True)),
        partition_id=_whole(kfd.get("current_partition_id")) if isinstance(kfd, Mapping) else None,
    )


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Absent):
        return None
    text = str(value).strip()
    return None if not text or text.upper() == "N/A" else text


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pick(devices: list[Found], value: str) -> list[Found]:
    """The devices one visibility variable names, in its order (up to its first invalid entry)."""
    chosen: list[Found] = []
    for raw in value.split(","):
        entry = raw.strip()
        device: Found | None = None
        if entry.isdigit():
            position = int(entry)
            device = devices[position] if position < len(devices) else None
        elif entry:
            prefix = uuid_key(entry)
            matches = [d for d in devices if uuid_key(d.uuid).startswith(prefix)]
            device = matches[0] if len(matches) == 1 else None
        if device is None or any(device is seen for seen in chosen):
            break  # as the runtimes do: an invalid entry ends the list
        chosen.append(device)
    return chosen


def visible(devices: list[Found], environ: Mapping[str, str] | None = None) -> list[Found]:
    """The devices a HIP process sees, in HIP's order (torch.cuda's on a ROCm build)."""
    env = os.environ if environ is None else environ
    shown = list(devices)
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None:
        shown = _pick(shown, rocr)
    hip = env.get("HIP_VISIBLE_DEVICES")
    if hip is None:
        hip = env.get("CUDA_VISIBLE_DEVICES")
    if hip is not None:
        shown = _pick(shown, hip)
    return shown


def visibility(environ: Mapping[str, str] | None = None) -> str | None:
    """The visibility variables that are set, as one line for messages ("HIP_VISIBLE_DEVICES='1'")."""
    env = os.environ if environ is None else environ
    parts = [f"{name}={env[name]!r}" for name in VISIBILITY if name in env]
    return ", ".join(parts) or None


def _torch() -> Any:
    """torch where the process imported it; gpuwidget never imports it (nor starts HIP) itself."""
    import sys

    return sys.modules.get("torch")


def torch_is_rocm() -> bool:
    """True where the process's torch is the ROCm build (``torch.version.hip``): its ``torch.cuda`` is HIP."""
    return bool(getattr(getattr(_torch(), "version", None), "hip", None))


def in_torch_order(shown: Sequence[Found]) -> list[Found]:
    """``shown`` in torch's order where torch (ROCm) has started HIP and names the same devices by PCI
    address; else as HIP numbers them (the order above)."""
    torch = _torch()
    try:
        if torch is None or not torch_is_rocm() or not torch.cuda.is_initialized():
            return list(shown)
        addresses = [str(getattr(torch.cuda.get_device_properties(i), "pci_bus_id", "") or "").lower()
                     for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a torch without these properties: HIP's own order
        return list(shown)
    by_bdf = {(device.bdf or "").lower(): device for device in shown}
    ordered = [by_bdf.get(address) for address in addresses]
    if len(ordered) != len(shown) or any(device is None for device in ordered):
        return list(shown)
    return [device for device in ordered if device is not None]
