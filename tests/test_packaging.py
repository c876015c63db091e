"""The installed package carries its lab extension and enables its server extension.

These check the environment the tests run in (``make test`` installs gpuwidget into
.venv with ``pip install -e .``): no ``jupyter ... enable`` step may be needed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    metadata.distribution("gpuwidget")
except metadata.PackageNotFoundError:  # pragma: no cover - only outside an install
    pytest.skip("gpuwidget is not installed in this environment", allow_module_level=True)

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LABEXT_DIR = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "gpuwidget"


def _jupyter(*args: str) -> str:
    """Run a `jupyter` subcommand with this interpreter; stdout and stderr, colours removed."""
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return ANSI.sub("", proc.stdout + proc.stderr)


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
    # e.g. "gpuwidget v0.1.0 enabled OK (python, gpuwidget)"
    assert re.search(r"^\s*gpuwidget v\S+ enabled OK\b", out, re.MULTILINE), out


def test_server_extension_enabled_without_manual_step() -> None:
    # The wheel installs jupyter-config/server-config/gpuwidget.json into
    # <prefix>/etc/jupyter/jupyter_server_config.d.
    config = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "gpuwidget.json"
    assert json.loads(config.read_text()) == {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}}

    out = _jupyter("server", "extension", "list")
    # "gpuwidget enabled", then "- Validating gpuwidget..." and "gpuwidget [version] OK"
    assert re.search(r"^\s*gpuwidget enabled\s*$", out, re.MULTILINE), out
    assert re.search(r"^\s*gpuwidget (\S+ )?\s*OK\s*$", out, re.MULTILINE), out
