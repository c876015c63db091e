"""The server's wire payloads as types: what /devices, /snapshot, /cluster and the stream send.

One TypedDict per interface of ``labextension/src/protocol.ts`` (``IDeviceInfo`` is
:class:`DeviceInfo` here), key for key; ``tests/test_protocol.py`` reads that file and holds
the two equal. Everything stays plain JSON data at run time. Conventions (docs/server-api.md):
times are Unix epoch seconds, metric names and units are the Trace's (``gpu0.util`` percent,
``gpu0.mem_used`` bytes), a metric a device cannot report is absent, and None (``null``) means
"no reading then".

A key the client treats as optional (``name?:`` in protocol.ts, absent from older servers) is
not required here either; the server may still always send it (``stalled`` in the hello).
Where a TypedDict needs both required and optional keys, the required ones are in a base class
(``_...Keys``), as Python 3.10 has no ``NotRequired``.
"""

from __future__ import annotations

from typing import Literal, TypedDict

Reading = float | None  # a metric's value at one time; None: no reading then
Columns = dict[str, list[Reading]]  # metric -> its values, aligned with the times


# --------------------------------------------------------------------------- /devices


class _DeviceKeys(TypedDict):
    id: str  # the metric prefix: "gpu0" for gpu0.util
    index: int
    uuid: str
    name: str


class DeviceInfo(_DeviceKeys, total=False):
    """One GPU (or MIG instance, or AMD compute partition) as ``GET /devices`` describes it
    (``monitor.DEVICE_KEYS``: every key is sent, None where the device has no such fact)."""

    memory_total: int | None  # bytes
    power_limit: float | None  # watts
    is_mig: bool | None
    parent_uuid: str | None
    pci_bus_id: str | None
    vendor: str | None  # "nvidia" or "amd"
    driver_index: int | None  # the driver's (nvidia-smi's, amd-smi's) number; a MIG instance's is its GPU's
    mig_mode: bool | None  # a GPU in MIG mode: its instances follow it in the list
    gpu_instance_id: int | None  # a MIG instance's (dcgm-exporter's GPU_I_ID)
    mig_profile: str | None  # a MIG instance's profile (GPU_I_PROFILE), "3g.40gb"
    compute_partition: str | None  # an AMD GPU's compute partition mode: "SPX", "CPX"...
    memory_partition: str | None  # an AMD GPU's memory partition mode: "NPS1"...
    partition_id: int | None  # an AMD compute partition's number on its GPU
    serial: str | None  # the board's serial number
    gpm: bool | None  # SM activity is read: the busy figure is sm_active, not util
    foreign_pid_namespace: bool | None  # the server's PID namespace is not the driver's (a container)


class HostInfo(TypedDict):
    cpu_count: int | None
    mem_total: int | None  # bytes


class _DevicesReplyKeys(TypedDict):
    gpu_found: bool
    message: str | None  # why no GPU is shown, or None
    devices: list[DeviceInfo]
    host: HostInfo
    interval: float  # the shared sampler's period, seconds
    history_s: float  # how much history the server keeps, seconds


class DevicesReply(_DevicesReplyKeys, total=False):
    """The body of ``GET /devices``, and the ``devices`` of the hello message."""

    cluster: bool  # the server reads a cluster from Prometheus (only in GET /devices)


# --------------------------------------------------------------------------- sources and devices that stopped


class _StalledSourceKeys(TypedDict):
    source: str  # the sampler's label: "GPU 1"
    since_s: float  # seconds it has not answered, to the message's time


class StalledSource(_StalledSourceKeys, total=False):
    """A source the sampler stopped waiting on."""

    at: float  # when it stopped answering
    devices: list[str]  # the devices whose readings stopped with it


class StaleDevice(TypedDict):
    """A device whose readings stopped: its last values, read at ``t``, ``age_s`` old (both None: never read)."""

    source: str
    hung: bool  # this device stopped answering (False: it stopped with a source that read it too)
    t: float | None
    age_s: float | None
    values: dict[str, Reading]


StaleDevices = dict[str, StaleDevice]  # by device id ("gpu1")


class ProcessInfo(TypedDict):
    """A process holding memory on a GPU; another user's carries only ``user`` and ``memory``."""

    pid: int | None
    memory: int | None  # bytes
    user: str  # "you", "another user", or why the owner is unknown
    name: str | None
    kernel_id: str | None
    notebook: str | None  # server-relative path of the notebook whose kernel owns it


# --------------------------------------------------------------------------- the stream's messages


class _HelloKeys(TypedDict):
    type: Literal["hello"]
    devices: DevicesReply


class HelloMessage(_HelloKeys, total=False):
    stalled: list[StalledSource]
    stale: StaleDevices


class HistoryMessage(TypedDict):
    """What the charts draw of the history: ``monitor.STREAM_HISTORY_METRICS``' columns, times ascending."""

    type: Literal["history"]
    t: list[float]
    columns: Columns


class _SampleKeys(TypedDict):
    type: Literal["sample"]
    t: float | None
    values: dict[str, Reading]


class SampleMessage(_SampleKeys, total=False):
    stalled: list[StalledSource]
    stale: StaleDevices


class ProcessesMessage(TypedDict):
    type: Literal["processes"]
    t: float | None  # None before the first scan of the GPUs' processes
    gpus: dict[str, list[ProcessInfo]]  # by device id


ServerMessage = HelloMessage | HistoryMessage | SampleMessage | ProcessesMessage


# --------------------------------------------------------------------------- /snapshot


class Latest(TypedDict):
    """The newest row of the server's trace (None, {} before the first reading)."""

    t: float | None
    values: dict[str, Reading]


class History(TypedDict):
    """Every column over a window, reduced for plotting (``Monitor.history``)."""

    t: list[float]
    columns: Columns


class _SnapshotKeys(TypedDict):
    devices: DevicesReply
    latest: Latest
    processes: ProcessesMessage | None
    stalled: list[StalledSource]
    stale: StaleDevices


class SnapshotReply(_SnapshotKeys, total=False):
    """The body of ``GET /snapshot?window=S``: what the status bar polls while the sidebar is closed."""

    history: History


# --------------------------------------------------------------------------- /cluster


class ClusterGpu(TypedDict):
    """One GPU of the cluster (values aligned with the reply's times)."""

    gpu: str
    uuid: str | None
    model: str | None
    holder: str | None  # a user, notebook or job, where the server knows
    util: list[Reading]  # 0..1 per step
    memory_used_bytes: list[Reading]
    memory_total_bytes: float | None
    power_w: list[Reading]


class ClusterHost(TypedDict):
    host: str
    gpus: list[ClusterGpu]


class ClusterReply(TypedDict):
    """The body of ``GET /cluster?window_s=S`` (step, start and end None while unconfigured)."""

    configured: bool
    source: Literal["gpuwidget", "dcgm"] | None  # whose series were read
    error: str | None  # why there is no data, or None
    step_s: float | None
    start: float | None
    end: float | None
    selector: str | None
    hosts: list[ClusterHost]
