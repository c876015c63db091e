"""The installed package carries its lab extension and enables its server extension, under its names.

These check the environment the tests run in (``make test`` installs gpuwidget into .venv with
``pip install -e .``, then links the lab extension with ``jupyter-builder develop``): no
``jupyter ... enable`` step may be needed. The names themselves are checked in the sources: the
distribution ``jupyterlab-gpuwidget`` (PyPI's ``gpuwidget`` is another project), the lab extension's
npm name, its folder and settings id after it; tests/test_wheel.py installs the built wheel.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from gpuwidget._labext import DISTRIBUTION_NAME, LABEXTENSION_NAME, _jupyter_labextension_paths

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LABEXT_DIR = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / LABEXTENSION_NAME

try:
    metadata.distribution(DISTRIBUTION_NAME)
    INSTALLED = True
except metadata.PackageNotFoundError:  # pragma: no cover - only outside an install
    INSTALLED = False
installed = pytest.mark.skipif(not INSTALLED, reason=f"{DISTRIBUTION_NAME} is not installed in this environment")


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


def test_python_npm_and_jupyterlab_agree_on_the_names() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package = json.loads((ROOT / "package.json").read_text())
    install = json.loads((ROOT / "install.json").read_text())
    assert project["project"]["name"] == DISTRIBUTION_NAME == "jupyterlab-gpuwidget"
    assert package["name"] == LABEXTENSION_NAME
    assert package["jupyterlab"]["discovery"]["server"]["base"]["name"] == DISTRIBUTION_NAME
    assert install["packageName"] == DISTRIBUTION_NAME and DISTRIBUTION_NAME in install["uninstallInstructions"]
    shared = project["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]
    assert shared["gpuwidget/labextension"] == f"share/jupyter/labextensions/{LABEXTENSION_NAME}"
    assert shared["install.json"] == f"share/jupyter/labextensions/{LABEXTENSION_NAME}/install.json"
    assert _jupyter_labextension_paths() == [{"src": "labextension", "dest": LABEXTENSION_NAME}]
    # JupyterLab finds a plugin's settings schema by "<npm name>:<schema file name>".
    source = (ROOT / "labextension" / "src" / "index.ts").read_text()
    assert f"export const PLUGIN_ID = '{LABEXTENSION_NAME}:plugin';" in source
    assert (ROOT / "labextension" / "schema" / "plugin.json").is_file()
    # The commands, the import package and the server extension keep the product's name.
    assert project["project"]["scripts"] == {"gpuwatch": "gpuwidget.cli:main"}
    config = json.loads((ROOT / "jupyter-config" / "server-config" / "gpuwidget.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}}


@installed
def test_labextension_is_installed_in_prefix() -> None:
    package_json = LABEXT_DIR / "package.json"
    assert package_json.is_file(), f"no built lab extension at {LABEXT_DIR}"
    meta = json.loads(package_json.read_text())
    assert meta["name"] == LABEXTENSION_NAME
    assert meta["jupyterlab"]["discovery"]["server"]["base"]["name"] == DISTRIBUTION_NAME
    # The builder records the federated entry point it wrote; it must be there.
    entry = LABEXT_DIR / meta["jupyterlab"]["_build"]["load"]
    assert entry.is_file(), entry
    assert (LABEXT_DIR / "schemas" / LABEXTENSION_NAME / "plugin.json").is_file()
    bundles = "".join(p.read_text(errors="replace") for p in (LABEXT_DIR / "static").glob("*.js"))
    assert f"{LABEXTENSION_NAME}:plugin" in bundles


@installed
def test_labextension_listed_enabled_and_ok_once() -> None:
    out = _jupyter("labextension", "list")
    # e.g. "jupyterlab-gpuwidget v0.1.0 enabled OK (python, jupyterlab-gpuwidget)"
    assert re.search(rf"^\s*{LABEXTENSION_NAME} v\S+ enabled OK\b", out, re.MULTILINE), out
    # An install from before the rename left "gpuwidget" beside it: both would load (make install removes it).
    assert not re.search(r"^\s*gpuwidget v", out, re.MULTILINE), out


@installed
def test_server_extension_enabled_without_manual_step() -> None:
    # The wheel installs jupyter-config/server-config/gpuwidget.json into
    # <prefix>/etc/jupyter/jupyter_server_config.d.
    config = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "gpuwidget.json"
    assert json.loads(config.read_text()) == {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}}

    out = _jupyter("server", "extension", "list")
    # "gpuwidget enabled", then "- Validating gpuwidget..." and "gpuwidget [version] OK"
    assert re.search(r"^\s*gpuwidget enabled\s*$", out, re.MULTILINE), out
    assert re.search(r"^\s*gpuwidget (\S+ )?\s*OK\s*$", out, re.MULTILINE), out
