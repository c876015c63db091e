"""The seam between a GPU vendor's driver and everything above ``sources/``: one protocol, one opener.

Above this module nothing names a vendor's library. A GPU source (:class:`GpuSource`) reads the GPUs
it was opened for, one tick at a time, under the same column names whatever the vendor
(``gpu{index}.<metric>``, SI units, ``index`` as torch numbers the devices):

=================  =========================================================================
``util``           % of time the GPU ran work ("kernel running": NVML utilisation, AMD's GFX activity)
``mem_util``       % of time device memory was read or written (AMD: the memory controller's activity)
``mem_used``       bytes in use; ``mem_total`` bytes
``power``          W; ``power_limit`` W enforced; ``power_limit_default`` W; ``power_limit_min``/``_max`` W
``energy_j``       J since the driver loaded (a cumulative counter)
``temperature``    degrees Celsius (NVIDIA: the GPU sensor; AMD: the hotspot, the edge sensor where absent)
``sm_clock``       Hz of the compute clock (NVIDIA SM, AMD GFX); ``sm_clock_max`` Hz; ``mem_clock`` Hz
``slowdown``       1 when the GPU slowed itself this tick (thermal, hardware slowdown, power brake), else 0
``power_capped``   1 when the GPU held its power limit this tick (NVIDIA's software power cap, AMD's PPT)
``pcie_tx``        bytes/s sent by the GPU; ``pcie_rx`` received; ``pcie_total`` both ways, where the driver
                   gives no direction (AMD)
``pcie_gen``       PCIe generation now; ``pcie_width`` lanes; ``pcie_gen_max``/``pcie_width_max``
``proc_mem``       bytes held on the device by the watched process and its children
``sm_active``      % of compute units (SMs) busy; ``tensor_active`` % of time a matrix (tensor) pipe was
                   busy; ``sm_occupancy``, ``dram_active``, ``nvlink_tx``/``_rx`` where the vendor has them
=================  =========================================================================

A reading a GPU cannot give is absent, never 0; ``read()`` never raises. :func:`open_gpu_sources` is
the one way the watch, the CLI and the server open GPUs: it asks each vendor's driver in turn
(NVIDIA's NVML, AMD's amdsmi) and returns one source per GPU, so that the sampler's watchdog, which
drops a source whose read hangs, drops only the GPU that hung and the others go on being read.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from gpuwidget.facts import GpuFacts
from gpuwidget.sources.base import Source, SourceError

# What a GPU source tells of each device it reads is what a Run keeps of it (Run.machine["gpus"]).
GpuDescription = GpuFacts

# The UI's plain statement; why follows in parentheses ("no GPU found (no NVIDIA or AMD GPU driver)").
NO_GPU = "no GPU found"

# Vendors in the order they are asked, each with the module that opens its GPUs (``open_sources``)
# and the name of its driver library as the messages say it.
VENDORS: tuple[tuple[str, str, str], ...] = (
    ("nvidia", "gpuwidget.sources.nvml", "NVML"),
    ("amd", "gpuwidget.sources.amd", "amdsmi"),
)

# Each vendor's driver starts (library init, listing the GPUs) on a thread of this name, for at most the
# caller's deadline: it answers in tens of ms, but a driver stuck on a GPU that fell off the bus may
# never answer, and then the caller goes on without that vendor's GPUs rather than hang.
STARTER_THREAD_NAME = "gpuwidget-gpu-start"


@runtime_checkable
class GpuSource(Source, Protocol):
    """A source of GPU readings: what the sampler, the server and the CLI need of one, whatever the vendor."""

    name: str
    errors: list[SourceError]
    busy_with: str | None  # the GPU being read now, named for the user ("GPU 1"); None between reads

    @property
    def closed(self) -> bool:
        """True once nothing more will come: closed, never available, or every GPU lost."""
        ...

    def read(self) -> dict[str, float]:
        """One tick of readings (columns above); never raises."""
        ...

    def describe(self) -> list[GpuDescription]:
        """Each device it reads, with its static facts (``lost`` says why one stopped answering)."""
        ...

    def processes(self) -> dict[str, list[tuple[int, int | None]]]:
        """Every process on each device (``"gpu0"``: [(pid, bytes or None)]), whoever owns it; never raises."""
        ...

    def close(self) -> None:
        """Release the driver; idempotent."""
        ...


@dataclass
class Opened:
    """What one vendor's opener found: its sources (one per GPU), or why it has none."""

    vendor: str
    sources: list[GpuSource] = field(default_factory=list)
    reason: str | None = None  # why there are none, in words ("the NVIDIA driver is not loaded")
    driver: bool = False  # the vendor's driver (or its library) is there, whatever it found
    missing: list[int] = field(default_factory=list)  # requested indexes the vendor does not have
    visible_count: int = 0  # devices the vendor's framework can see (before the selection)


@dataclass
class GpuSources:
    """The GPUs a watch or the server reads: one source per GPU, or the message saying why there are none."""

    sources: list[GpuSource] = field(default_factory=list)
    vendor: str | None = None  # "nvidia" or "amd" where GPUs were found
    message: str | None = None  # "no GPU found (...)" when there are none, else None
    missing: list[int] = field(default_factory=list)  # requested GPU indexes that do not exist
    visible_count: int = 0  # GPUs the framework can see (torch's numbering)

    @property
    def found(self) -> bool:
        return bool(self.sources)

    def devices(self) -> list[GpuDescription]:
        """Every device of every source, in the sources' order."""
        return [device for source in self.sources for device in source.describe()]

    def close(self) -> None:
        for source in self.sources:
            source.close()


def open_gpu_sources(
    gpus: Sequence[int] | None = None,
    *,
    pids: Callable[[], Iterable[int]] | None = None,
    every_device: bool = False,
    deadline_s: float | None = None,
    vendors: Sequence[str] | None = None,
) -> GpuSources:
    """Open the GPUs of the first vendor whose driver lists some, one source per GPU.

    ``gpus`` selects GPU indexes as torch numbers them (``None``: every GPU the process can see);
    ``pids`` says whose GPU memory counts as ours (default: this process and its descendants);
    ``every_device`` is the machine's view (the server's sidebar and /metrics: every MIG instance or
    partition), not one process's. Each vendor is given ``deadline_s`` to start (None: no limit).
    Plain arguments only, so the same call can run in another process.

    Requested indexes that do not exist are listed in ``missing`` (the sources are then closed). Never
    raises: without any GPU, ``message`` says why, naming each vendor's reason.
    """
    asked: list[tuple[str, str, Opened]] = []
    for vendor, module, library in VENDORS:
        if vendors is not None and vendor not in vendors:
            continue
        opened = _open_vendor(vendor, module, library, gpus, pids, every_device, deadline_s)
        if opened.sources or opened.missing:
            if opened.missing:
                for source in opened.sources:
                    _close_quietly(source)
                return GpuSources([], vendor, None, list(opened.missing), opened.visible_count)
            return GpuSources(list(opened.sources), vendor, None, [], opened.visible_count)
        asked.append((vendor, library, opened))
    return GpuSources([], None, no_gpu_message([(vendor, opened) for vendor, _, opened in asked]))


def no_gpu_message(outcomes: Sequence[tuple[str, Opened]]) -> str:
    """"no GPU found (...)": each vendor's reason, or one phrase when no vendor's driver is there at all."""
    if not outcomes:
        return NO_GPU
    if not any(opened.driver for _, opened in outcomes):
        names = [_VENDOR_NAMES.get(vendor, vendor) for vendor, _ in outcomes]
        joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        return f"{NO_GPU} (no {joined} GPU driver)"
    return f"{NO_GPU} ({'; '.join(opened.reason or 'none listed' for _, opened in outcomes)})"


_VENDOR_NAMES = {"nvidia": "NVIDIA", "amd": "AMD"}


def _open_vendor(vendor: str, module: str, library: str, gpus: Sequence[int] | None,
                 pids: Callable[[], Iterable[int]] | None, every_device: bool, deadline_s: float | None) -> Opened:
    def build() -> Opened:
        try:
            opener = importlib.import_module(module).open_sources
        except Exception as error:  # noqa: BLE001 - broken bindings mean "no GPU of this vendor", not a crash
            return Opened(vendor, reason=f"{library} could not be loaded: {error}")
        opened: Opened = opener(gpus, pids, every_device)
        return opened

    if deadline_s is None:
        return build()
    opened = within(deadline_s, build, _close_all)
    if opened is None:
        return Opened(vendor, reason=f"{library} did not answer within {deadline_s:g} s", driver=True)
    return opened


_Built = TypeVar("_Built")


def within(deadline_s: float, build: Callable[[], _Built], discard: Callable[[_Built], object]) -> _Built | None:
    """``build()`` on a thread of its own; None if it has not returned within ``deadline_s``.

    What arrives after the deadline is handed to ``discard`` there and then: nobody will use it.
    An exception ``build`` raises is raised again here.
    """
    lock = threading.Lock()
    built: list[_Built] = []
    failed: list[BaseException] = []
    abandoned = False

    def run() -> None:
        try:
            result = build()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(exc)
            return
        with lock:
            if not abandoned:
                built.append(result)
                return
        with contextlib.suppress(Exception):
            discard(result)

    thread = threading.Thread(target=run, name=STARTER_THREAD_NAME, daemon=True)
    thread.start()
    thread.join(deadline_s)
    with lock:
        if failed:
            raise failed[0]
        if not built:
            abandoned = True
            return None
    return built[0]


def _close_all(opened: Opened) -> None:
    for source in opened.sources:
        _close_quietly(source)


def _close_quietly(source: Source) -> None:
    with contextlib.suppress(Exception):
        source.close()
