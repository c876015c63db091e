"""NVIDIA GPU metrics through NVML, in four modules with one idea each:

* :mod:`.driver`: the one door to the driver (the only module importing pynvml), failures as values;
* :mod:`.devices`: enumeration with MIG, and CUDA's numbering (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER);
* :mod:`.processes`: whose GPU memory is ours (descendants, PID namespaces, misread process structs);
* :mod:`.source`: :class:`NvmlSource`, the per-tick readings (its docstring lists the metrics), and
  :func:`open_sources`, one source per GPU for :func:`gpuwidget.sources.gpu.open_gpu_sources`.

Imports run one way: source -> devices, processes -> driver.
"""

from __future__ import annotations

from gpuwidget.sources.nvml.devices import DeviceInfo, list_devices
from gpuwidget.sources.nvml.processes import foreign_pid_namespace, namespace_pids, pid_visible
from gpuwidget.sources.nvml.source import METRICS, NvmlSource, clock_event_flags, open_sources

__all__ = ["METRICS", "DeviceInfo", "NvmlSource", "clock_event_flags", "foreign_pid_namespace", "list_devices",
           "namespace_pids", "open_sources", "pid_visible"]
