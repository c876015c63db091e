"""The installed package carries its lab extension and enables its server extension.

These check the environment the tests run in (``make test`` installs gpuwidget into
.venv with ``pip install -e .``): no ``jupyter ... enable`` step may be needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    metadata.distribution("gpuwidget")
except metadata.PackageNotFoundError:  # pragma: no cover - only outside an install
    pytest.skip("gpuwidget is not installed in this environment", allow_module_level=True)

LABEXT_DIR = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "gpuwidget"


def _jupyter(*args: str) -> str:
    """Run a `jupyter` subcommand with this interpreter; return stdout and stderr together."""
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return proc.stdout + proc.stderr


def test_labextension_is_installed_in_prefix() -> None:
    package_json = LABEXT_DIR / "package.json"
    assert package_json.is_file(), f"no built lab extension at {LABEXT_DIR}"
    meta = json.loads(package_json.read_text())
    assert meta["name"] == "gpuwidget"
    assert meta["jupyterlab"]["discovery"]["server"]["base"]["name"] == "gpuwidget"
    # The builder records the federated entry point it wrote; it must be there.
    entry = LABEXT_DIR / meta["jupyterlab"]["_build"]["load"]
    assert entry.is_file(), entry
    bundles = "".join(p.read_text(errors="replace") for p in (LABEXT_DIR / "static").glob("*.js"))
    assert "gpuwidget:plugin" in bundles


def test_labextension_listed_enabled_and_ok() -> None:
    out = _jupyter("labextension", "list")
    lines = [line for line in out.splitlines() if line.split()[:1] == ["gpuwidget"]]
    assert lines, out
    assert "enabled" in lines[0] and "OK" in lines[0], out


def test_server_extension_enabled_without_manual_step() -> None:
    # The wheel installs jupyter-config/server-config/gpuwidget.json into
    # <prefix>/etc/jupyter/jupyter_server_config.d.
    config = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "gpuwidget.json"
    assert json.loads(config.read_text()) == {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}}

    out = _jupyter("server", "extension", "list")
    words = [line.split() for line in out.splitlines()]
    assert ["gpuwidget", "enabled"] in words, out
    assert ["gpuwidget", "OK"] in words, out
