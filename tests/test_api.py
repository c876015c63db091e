"""The package's public surface: measuring functions re-exported as themselves (loaded on first use)
and a version that comes from the build, not a copy in the source."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import gpuwidget
from gpuwidget._labext import DISTRIBUTION_NAME
from gpuwidget.measure import batch_probe, tuner


def test_measuring_functions_are_re_exported_as_themselves():
    # The very functions, so their signatures, defaults and return types are the real ones.
    assert gpuwidget.tune_loader is tuner.tune_loader
    assert gpuwidget.probe_batch_size is batch_probe.probe_batch_size
    assert {"tune_loader", "probe_batch_size"} <= set(dir(gpuwidget))
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        gpuwidget.no_such_thing  # noqa: B018


def test_importing_gpuwidget_loads_no_measuring_code_until_asked():
    code = ("import sys, gpuwidget\n"
            "assert 'gpuwidget.measure.tuner' not in sys.modules, 'tuner imported eagerly'\n"
            "gpuwidget.tune_loader\n"
            "assert 'gpuwidget.measure.tuner' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_is_the_installed_packages():
    try:
        installed = metadata.version(DISTRIBUTION_NAME)
    except metadata.PackageNotFoundError:  # pragma: no cover - only outside an install
        pytest.skip(f"{DISTRIBUTION_NAME} is not installed in this environment")
    assert gpuwidget.__version__ == installed
