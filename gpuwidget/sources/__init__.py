"""Metric sources: NVML devices, the host, and recorded traces."""

from gpuwidget.sources.base import Source, SourceError

__all__ = ["Source", "SourceError"]
