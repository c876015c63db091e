"""Finding NVIDIA devices and numbering them as CUDA does: MIG instances, CUDA_VISIBLE_DEVICES, and
CUDA_DEVICE_ORDER (CUDA's fastest-first default is not NVML's PCI order on a mixed-model host).

The matching is plain logic over :class:`_Found` records (tests build them without a driver);
only :func:`_enumerate` and :func:`list_devices` ask the driver, through :mod:`.driver`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwidget.facts import uuid_key
from gpuwidget.sources.base import ErrorLog
from gpuwidget.sources.nvml.driver import (
    Absent,
    _DeviceLost,
    _DeviceUnknown,
    _Driver,
    _load_pynvml,
    _memory_info,
    _text,
)


@dataclass(frozen=True)
class DeviceInfo:
    """Static facts about one NVML device (a physical GPU or a MIG instance)."""

    index: int  # NVML index of the physical GPU (for a MIG instance: its parent's)
    uuid: str
    name: str
    memory_total: int | None  # bytes
    is_mig: bool = False
    parent_uuid: str | None = None
    pci_bus_id: str | None = None
    mig_index: int | None = None  # position under the parent (nvmlDeviceGetMigDeviceHandleByIndex)
    cuda_index: int | None = None  # position among CUDA-visible devices; None when CUDA cannot see it
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)
    gpu_instance_id: int | None = None  # a MIG instance's GPU instance id (dcgm-exporter's GPU_I_ID)
    mig_profile: str | None = None  # a MIG instance's profile, "3g.40gb" (dcgm-exporter's GPU_I_PROFILE)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Found:
    """A device as enumerated, with its handle and what CUDA_VISIBLE_DEVICES matching needs."""

    info: DeviceInfo
    handle: Any
    parent_handle: Any = None
    mig_enabled: bool = False
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    instances: list[_Found] = field(default_factory=list)


def _enumerate(driver: _Driver) -> list[_Found]:
    """Every physical GPU in NVML order, with its MIG instances when MIG mode is on."""
    nvml = driver.nvml
    count = driver.query("nvmlDeviceGetCount")
    if isinstance(count, Absent):
        return []
    found: list[_Found] = []
    for index in range(count):
        for attempt in range(2):
            try:
                gpu = _enumerate_one(driver, nvml, index)
            except _DeviceUnknown as unknown:
                if attempt == 0:
                    continue  # NVML_ERROR_UNKNOWN can be transient: ask once more before leaving it out
                driver.report_once(f"GPU {index} answered Unknown Error twice and is left out ({unknown})",
                                   f"nvml{index}")
            except _DeviceLost as lost:
                driver.report_once(f"GPU {index} is lost and left out ({lost})", f"nvml{index}")
            else:
                if gpu is not None:
                    found.append(gpu)
            break
    return found


def _enumerate_one(driver: _Driver, nvml: Any, index: int) -> _Found | None:
    handle = driver.query("nvmlDeviceGetHandleByIndex", index)
    if isinstance(handle, Absent):  # e.g. a GPU this container's cgroup may not open
        return None
    uuid = _text(driver.query("nvmlDeviceGetUUID", handle))
    if uuid is None:
        return None
    pci = driver.query("nvmlDeviceGetPciInfo", handle)
    bus_id = None if isinstance(pci, Absent) else _text(pci.busId)
    memory = _memory_info(driver, handle, None, None)
    mode = driver.query("nvmlDeviceGetMigMode", handle)
    mig_enabled = not isinstance(mode, Absent) and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
    capability = driver.query("nvmlDeviceGetCudaComputeCapability", handle, quiet=True)
    gpu = _Found(
        DeviceInfo(
            index=index,
            uuid=uuid,
            name=_text(driver.query("nvmlDeviceGetName", handle)) or "NVIDIA GPU",
            memory_total=None if isinstance(memory, Absent) else int(memory.total),
            pci_bus_id=bus_id,
            capability=None if isinstance(capability, Absent) else (int(capability[0]), int(capability[1])),
        ),
        handle,
        mig_enabled=mig_enabled,
    )
    if mig_enabled:
        gpu.instances = _mig_instances(driver, gpu)
    return gpu


def _mig_instances(driver: _Driver, parent: _Found) -> list[_Found]:
    slots = driver.query("nvmlDeviceGetMaxMigDeviceCount", parent.handle)
    instances: list[_Found] = []
    for slot in range(0 if isinstance(slots, Absent) else slots):
        handle = driver.query("nvmlDeviceGetMigDeviceHandleByIndex", parent.handle, slot)
        if isinstance(handle, Absent):  # an empty slot answers NotFound
            continue
        uuid = _text(driver.query("nvmlDeviceGetUUID", handle))
        if uuid is None:
            continue
        memory = _memory_info(driver, handle, None, None)
        gi = driver.query("nvmlDeviceGetGpuInstanceId", handle)
        ci = driver.query("nvmlDeviceGetComputeInstanceId", handle)
        name = _text(driver.query("nvmlDeviceGetName", handle)) or f"{parent.info.name} MIG"
        info = DeviceInfo(
            index=parent.info.index,
            uuid=uuid,
            name=name,
            memory_total=None if isinstance(memory, Absent) else int(memory.total),
            is_mig=True,
            parent_uuid=parent.info.uuid,
            pci_bus_id=parent.info.pci_bus_id,
            mig_index=slot,
            capability=parent.info.capability,
            gpu_instance_id=None if isinstance(gi, Absent) else int(gi),
            mig_profile=mig_profile(name),
        )
        instances.append(
            _Found(
                info,
                handle,
                parent_handle=parent.handle,
                gpu_instance_id=None if isinstance(gi, Absent) else int(gi),
                compute_instance_id=None if isinstance(ci, Absent) else int(ci),
            )
        )
    return instances


def mig_profile(name: str) -> str | None:
    """The profile in a MIG instance's name: "NVIDIA H100 80GB HBM3 MIG 3g.40gb" -> "3g.40gb".

    The driver names an instance after its GPU and its profile (as ``nvidia-smi -L`` lists it);
    dcgm-exporter's ``GPU_I_PROFILE`` label is that profile.
    """
    _, found, profile = name.rpartition(" MIG ")
    return profile.strip() or None if found else None


def _leading_integer(entry: str) -> int | None:
    """CUDA reads an ordinal like atoi: leading digits count, the rest of the entry is ignored."""
    digits = ""
    for char in entry:
        if not char.isdigit():
            break
        digits += char
    return int(digits) if digits else None


def _match_prefix(prefix: str, candidates: Iterable[_Found]) -> _Found | None:
    matches = [c for c in candidates if c.info.uuid.lower().startswith(prefix.lower())]
    return matches[0] if len(matches) == 1 else None  # an ambiguous prefix is invalid


def _match_legacy_mig(entry: str, gpus: list[_Found]) -> _Found | None:
    """``MIG-GPU-<gpu uuid>/<gpu instance id>/<compute instance id>`` (drivers before R470)."""
    parts = entry[len("MIG-") :].split("/")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    parent = _match_prefix(parts[0], gpus)
    if parent is None:
        return None
    for instance in parent.instances:
        if (instance.gpu_instance_id, instance.compute_instance_id) == (int(parts[1]), int(parts[2])):
            return instance
    return None


def _cuda_order(gpus: list[_Found], device_order: str | None) -> tuple[list[_Found], str]:
    """The physical GPUs in CUDA's enumeration order, and how that order is known.

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is PCI order, which is NVML's own ("pci"). Unset or
    ``FASTEST_FIRST`` (CUDA's default) puts the device CUDA's heuristic deems fastest first and leaves
    the rest unspecified (CUDA's documentation); identical GPUs stay in PCI order ("pci"). With mixed
    models it is a guess, newest compute capability then most memory first ("guessed"), which
    :func:`_torch_order` replaces by torch's own UUIDs once torch has started CUDA.
    """
    if (device_order or "").strip().upper() == "PCI_BUS_ID" or len({g.info.name for g in gpus}) <= 1:
        return list(gpus), "pci"

    def speed(gpu: _Found) -> tuple[int, int, int, int]:
        major, minor = gpu.info.capability or (0, 0)
        return (-major, -minor, -(gpu.info.memory_total or 0), gpu.info.index)

    return sorted(gpus, key=speed), "guessed"


def _torch_order(visible: list[_Found], torch_uuids: Sequence[str] | None,
                 machine: Sequence[_Found] = ()) -> list[_Found] | None:
    """``visible`` in torch's device order when torch's UUIDs name exactly these devices, else None.

    A MIG instance is the exception: CUDA's choice of one when none is named is not documented
    beyond "the first", so where torch (CUDA itself) names one MIG instance of ``machine`` that one
    is the device, whichever :func:`_cuda_visible` guessed.
    """
    if not torch_uuids:
        return None
    if len(torch_uuids) == 1 and all(device.info.is_mig for device in visible):
        instances = {uuid_key(i.info.uuid): i for gpu in machine for i in gpu.instances}
        named = instances.get(uuid_key(torch_uuids[0]))
        if named is not None:
            return [named]
    if len(torch_uuids) != len(visible):
        return None
    by_uuid = {uuid_key(device.info.uuid): device for device in visible}
    ordered = [by_uuid.get(uuid_key(uuid)) for uuid in torch_uuids]
    if any(device is None for device in ordered) or len({id(d) for d in ordered}) != len(visible):
        return None
    return [device for device in ordered if device is not None]


def _torch_uuids() -> list[str] | None:
    """UUIDs of torch's CUDA devices, in its order, only where torch has already started CUDA.

    gpuwidget never imports torch nor starts CUDA itself (that would change the user's process:
    a CUDA context before fork breaks DataLoader workers); a cell before has usually done both.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - an old torch without .uuid: keep the order CUDA's rules give
        return None


def _cuda_visible(gpus: list[_Found], cuda_visible_devices: str | None, every_instance: bool = False) -> list[_Found]:
    """The devices CUDA shows, in CUDA's order, for a CUDA_VISIBLE_DEVICES value (None: unset).

    ``gpus`` are the physical GPUs in CUDA's enumeration order (:func:`_cuda_order`): an ordinal in
    CUDA_VISIBLE_DEVICES counts in that order, not NVML's.

    Follows CUDA's rules: entries are ordinals, ``GPU-<uuid prefix>`` or ``MIG-<uuid prefix>``
    (or the legacy ``MIG-GPU-<uuid>/<gi>/<ci>``); an invalid, unknown or ambiguous entry, or a switch
    between ordinals and UUIDs, ends the list there; a repeated device hides every device; a process
    sees at most one MIG instance, and when one is visible the non-MIG GPUs are hidden.

    ``every_instance`` is the machine's view, not one CUDA process's (the server's sidebar and
    /metrics): the same selection, but a GPU in MIG mode is listed with every one of its instances
    after it (the GPU itself for its power, temperature and memory), and nothing is hidden.
    """
    if cuda_visible_devices is None:
        chosen = list(gpus)
    else:
        chosen = []
        by_index = dict(enumerate(gpus))
        instances = [instance for gpu in gpus for instance in gpu.instances]
        ordinals: bool | None = None
        for raw in cuda_visible_devices.split(","):
            entry = raw.strip()
            ordinal = _leading_integer(entry)
            device: _Found | None
            if ordinal is not None:
                device = by_index.get(ordinal)
            elif entry.startswith("MIG-GPU-"):
                device = _match_legacy_mig(entry, gpus)
            elif entry.startswith("MIG-"):
                device = _match_prefix(entry, instances)
            elif entry.startswith("GPU-"):
                device = _match_prefix(entry, gpus)
            else:
                device = None
            if device is None or ordinals not in (None, ordinal is not None):
                break
            ordinals = ordinal is not None
            if any(device is seen for seen in chosen):
                return []
            chosen.append(device)
    if every_instance:
        return [each for device in chosen for each in (device, *device.instances)]
    migs = [device for device in chosen if device.info.is_mig]
    if migs:
        return migs[:1]
    visible: list[_Found] = []
    for device in chosen:
        if device.mig_enabled:
            if device.instances:
                return [device.instances[0]]
            continue  # MIG on but no instance: nothing CUDA can use
        visible.append(device)
    return visible


def _visible(gpus: list[_Found], cuda_visible_devices: str | None,
             device_order: str | None, every_instance: bool = False) -> tuple[list[_Found], str]:
    """CUDA's devices in CUDA's order, and how the order is known: "torch" (its UUIDs), "pci", "guessed".

    ``every_instance``: the machine's view (:func:`_cuda_visible`), in that order; torch has no say.
    """
    ordered, how = _cuda_order(gpus, device_order)
    visible = _cuda_visible(ordered, cuda_visible_devices, every_instance)
    if every_instance:
        return visible, how
    exact = _torch_order(visible, _torch_uuids(), gpus)
    return (visible, how) if exact is None else (exact, "torch")


def list_devices() -> list[DeviceInfo]:
    """Every NVIDIA device on the machine (physical GPUs, then each one's MIG instances), with
    ``cuda_index`` set for those this process's CUDA can see. Empty when NVML is unavailable."""
    try:
        nvml = _load_pynvml()
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        driver = _Driver(nvml, ErrorLog("nvml"))
        gpus = _enumerate(driver)
        visible, _ = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
        cuda_index = {id(device): position for position, device in enumerate(visible)}
        devices: list[DeviceInfo] = []
        for gpu in gpus:
            for device in (gpu, *gpu.instances):
                position = cuda_index.get(id(device))
                info = device.info if position is None else _with_cuda_index(device.info, position)
                devices.append(info)
        return devices
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _with_cuda_index(info: DeviceInfo, position: int) -> DeviceInfo:
    return DeviceInfo(**{**asdict(info), "cuda_index": position})
