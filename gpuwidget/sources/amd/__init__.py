"""AMD GPU readings through AMD SMI (``amdsmi``), in three modules with one idea each:

* :mod:`.driver`: the one door to the driver (the only module importing amdsmi), failures as values;
* :mod:`.devices`: the devices amdsmi lists (whole GPUs or compute partitions) and HIP's numbering of
  them (ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES; torch's ROCm build);
* :mod:`.source`: :class:`AmdSource`, the per-tick readings (its docstring lists them), and
  :func:`open_sources`, one source per GPU for :func:`gpuwidget.sources.gpu.open_gpu_sources`.

Imports run one way: source -> devices -> driver.
"""

from __future__ import annotations

from gpuwidget.sources.amd.source import METRICS, AmdSource, open_sources

__all__ = ["METRICS", "AmdSource", "open_sources"]
