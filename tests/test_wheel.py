"""The built wheel, installed as a user installs it: a fresh venv without the dev tools.

``python -m build --wheel`` builds it from this tree (reusing the built lab extension:
``HATCH_JUPYTER_BUILDER_SKIP_NPM=1``, see pyproject.toml), a new venv (``python -m venv``, no
system site-packages) gets the wheel and JupyterLab from pip, and everything below runs from that
venv alone, in a new home folder, with no ``PYTHONPATH`` and not from this tree (which would put
the source package first): ``jupyter labextension list`` and ``jupyter server extension list``,
a notebook executed by that venv's kernel (``%load_ext gpuwidget``, a watched cell, its panel),
``gpuwatch`` and ``python -m gpuwidget``, and ``jupyter lab`` with the sidebar in Chromium.

The dependencies are downloaded from PyPI once into a wheelhouse in pytest's cache
(``.pytest_cache/d/wheel-test``) and installed from there on later runs (pip's own cache is off on
these machines); a wheel that needs something the wheelhouse lacks fills it again from PyPI.
Remove the folder to take the newest releases.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from gpuwidget._labext import DISTRIBUTION_NAME, LABEXTENSION_NAME

from labserver import Lab, quiet_settings, running_lab
from ui import conftest as browser_fixtures

# Chromium through Playwright as in tests/ui, with its event-loop fixture (Playwright's sync API needs it).
browser = browser_fixtures.browser
page = browser_fixtures.page
jp_asyncio_loop = browser_fixtures.jp_asyncio_loop

# Builds, installs and starts a JupyterLab: alone, in make test's serial pass (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
BUILT_LABEXT = ROOT / "gpuwidget" / "labextension" / "static" / "style.js"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What a user installs beside the wheel: JupyterLab, which brings the kernel and nbconvert.
ALONGSIDE = ["jupyterlab"]
# Dev tools that must not be in the user's venv (the wheel must not need them).
DEV_TOOLS = ("pytest", "playwright", "torch", "ruff", "mypy", "hatchling", "build")


@dataclass
class UserVenv:
    python: Path
    bin: Path
    site: Path
    home: Path
    env: dict[str, str]
    work: Path
    wheel: Path

    def run(self, name: str, *args: str | Path, timeout: float = 180, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """The venv's command ``name``, as its user runs it (their home, their PATH, not in this tree)."""
        command = [str(self.bin / name), *map(str, args)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=self.work,
                              env=self.env, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc


def _user_env(bin_dir: Path, home: Path) -> dict[str, str]:
    """This process's environment less what points at the dev setup: no PYTHON*/JUPYTER*/GPUWIDGET*
    variables, no virtualenv, the dev venv's bin off PATH, a home of its own."""
    dropped = ("PYTHON", "JUPYTER", "IPYTHON", "GPUWIDGET", "VIRTUAL_ENV", "PYTEST", "COV_")
    env = {key: value for key, value in os.environ.items() if not key.startswith(dropped)}
    dev_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != dev_bin]
    env.update(PATH=os.pathsep.join([str(bin_dir), *path]), HOME=str(home))
    return env


def _build_wheel(outdir: Path) -> Path:
    if not BUILT_LABEXT.is_file():
        pytest.fail(f"no built lab extension at {BUILT_LABEXT.parent.parent}: run `make install` (or `jlpm build`)")
    env = {**os.environ, "HATCH_JUPYTER_BUILDER_SKIP_NPM": "1"}
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(ROOT)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=outdir.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = outdir.glob("*.whl")
    return wheel


def _pip_install(python: Path, env: dict[str, str], wheel: Path, wheelhouse: Path, cwd: Path) -> None:
    """The wheel and what goes alongside, from the wheelhouse; from PyPI into it first if it lacks any."""
    requirements = [str(wheel), *ALONGSIDE]
    pip = [str(python), "-m", "pip"]
    offline = [*pip, "install", "--no-compile", "--no-index", "--find-links", str(wheelhouse), *requirements]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=cwd)

    if run(offline).returncode == 0:
        return
    fetched = run([*pip, "download", "--dest", str(wheelhouse), *requirements])
    assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    for copy in wheelhouse.glob(f"{DISTRIBUTION_NAME.replace('-', '_')}-*"):
        copy.unlink()  # the wheel itself comes from the build, never from here
    installed = run(offline)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> UserVenv:
    started = time.monotonic()
    base = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(base / "dist")
    built = time.monotonic()
    venv, home, work = base / "venv", base / "home", base / "work"
    home.mkdir()
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, cwd=base)
    bin_dir = venv / "bin"
    env = _user_env(bin_dir, home)
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: download each time
    wheelhouse = (Path(cache.mkdir("wheel-test")) if cache is not None else base) / "wheelhouse"
    wheelhouse.mkdir(exist_ok=True)
    _pip_install(bin_dir / "python", env, wheel, wheelhouse, work)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", purelib], capture_output=True, text=True,
                               check=True, env=env, cwd=work).stdout.strip())
    print(f"wheel test: built in {built - started:.0f} s, venv and install {time.monotonic() - built:.0f} s")
    return UserVenv(python=bin_dir / "python", bin=bin_dir, site=site, home=home, env=env, work=work, wheel=wheel)


def test_the_wheel_is_named_for_pypi_and_carries_both_extensions_and_the_child_hook(user_venv):
    wheel = user_venv.wheel
    assert wheel.name.startswith("jupyterlab_gpuwidget-") and wheel.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = next(n for n in names if n.endswith(".data/data/etc/jupyter/jupyter_server_config.d/gpuwidget.json"))
    prefix = data.split("/etc/", 1)[0]
    labext = f"{prefix}/share/jupyter/labextensions/{LABEXTENSION_NAME}"
    assert {f"{labext}/package.json", f"{labext}/install.json", f"{labext}/static/style.js",
            f"{labext}/schemas/{LABEXTENSION_NAME}/plugin.json"} <= names
    assert {"gpuwidget/__init__.py", "gpuwidget/__main__.py", "gpuwidget_children.pth",
            "gpuwidget_children_boot.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "labextension/", "node_modules/", "notebooks/"))]
    install = json.loads(zipfile.ZipFile(wheel).read(f"{labext}/install.json"))
    assert install["packageName"] == DISTRIBUTION_NAME


def test_the_venv_is_a_users_own_without_the_dev_tools(user_venv):
    listed = json.loads(user_venv.run("python", "-m", "pip", "list", "--format=json").stdout)
    installed = {p["name"].lower(): p["version"] for p in listed}
    assert DISTRIBUTION_NAME in installed and "gpuwidget" not in installed
    assert not [tool for tool in DEV_TOOLS if tool in installed], sorted(installed)
    where = user_venv.run("python", "-c", "import gpuwidget; print(gpuwidget.__file__, gpuwidget.__version__)")
    path, version = where.stdout.split()
    assert Path(path) == user_venv.site / "gpuwidget" / "__init__.py"
    assert version == installed[DISTRIBUTION_NAME]


def test_jupyter_lists_the_lab_and_server_extensions_enabled_from_the_venv(user_venv):
    listed = user_venv.run("jupyter", "labextension", "list")
    labext = ANSI.sub("", listed.stdout + listed.stderr)
    share = user_venv.python.parent.parent / "share" / "jupyter" / "labextensions"
    # e.g. "jupyterlab-gpuwidget v0.1.0 enabled OK (python, jupyterlab-gpuwidget)", under the venv's folder
    line = rf"^\s*{LABEXTENSION_NAME} v\S+ enabled OK \(python, {DISTRIBUTION_NAME}\)\s*$"
    assert re.search(line, labext, re.MULTILINE), labext
    assert labext.index(str(share)) < re.search(line, labext, re.MULTILINE).start(), labext
    assert not re.search(r"^\s*gpuwidget v", labext, re.MULTILINE), labext
    server = user_venv.run("jupyter", "server", "extension", "list")
    server_text = ANSI.sub("", server.stdout + server.stderr)
    assert re.search(r"^\s*gpuwidget enabled\s*$", server_text, re.MULTILINE), server_text
    assert re.search(r"^\s*gpuwidget \S+ OK\s*$", server_text, re.MULTILINE), server_text


WATCHED_CELL = textwrap.dedent("""\
    %%gpuwatch --interval 0.1
    import time
    for step in range(10):
        time.sleep(0.05)
    """)


def test_a_kernel_of_the_venv_loads_the_magic_and_a_watched_cell_gets_its_panel(user_venv):
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell("%load_ext gpuwidget"),
                      nbformat.v4.new_code_cell(WATCHED_CELL),
                      nbformat.v4.new_code_cell("import sys, gpuwidget\n"
                                                "print(sys.executable, gpuwidget.last_run().finished)")]
    nbformat.write(notebook, user_venv.work / "watch.ipynb")
    user_venv.run("jupyter", "nbconvert", "--to", "notebook", "--execute", "watch.ipynb", "--output", "done.ipynb")
    cells = nbformat.read(user_venv.work / "done.ipynb", as_version=4).cells
    panels = [o for o in cells[1].outputs if "gpuwidget-run" in o.get("data", {}).get("text/html", "")]
    assert len(panels) == 1, cells[1].outputs
    assert "gpuwidget run: In [2] finished" in panels[0]["data"]["text/plain"]
    (printed,) = [o["text"] for o in cells[2].outputs if o.output_type == "stream"]
    kernel_python, finished = printed.split()
    assert Path(kernel_python).parent == user_venv.bin and finished == "True"


@pytest.mark.parametrize("launcher", [["gpuwatch"], ["python", "-m", "gpuwidget"]], ids=["gpuwatch", "python-m"])
def test_the_command_and_python_m_gpuwidget_watch_a_script_with_the_child_hook(user_venv, launcher, tmp_path):
    saved = tmp_path / "run.json"
    probe = "import sys; print('hooked' if 'gpuwidget_children_boot' in sys.modules else 'not hooked')"
    result = user_venv.run(*launcher, "--quiet", "--save", saved, "--", "python", "-c", probe)
    assert result.stdout.strip() == "hooked"  # the .pth at the top of the venv's site-packages
    assert json.loads(saved.read_text())["format"] == "gpuwidget.run/1"


@contextlib.contextmanager
def _user_lab(user_venv: UserVenv) -> Iterator[Lab]:
    """``jupyter lab`` of the venv, started as its user would: no extension enabled by hand."""
    root = user_venv.work / "lab"
    root.mkdir()
    quiet_settings(user_venv.home / ".jupyter" / "lab" / "user-settings")  # in the user's own settings
    with running_lab(root, "gpuwidget-wheel-token", program=(str(user_venv.bin / "jupyter"), "lab"),
                     env=user_venv.env, log=root.parent / "lab.log") as lab:
        yield lab


@pytest.mark.browser
def test_the_venvs_jupyterlab_shows_the_gpu_sidebar_in_chromium(user_venv, page):
    with _user_lab(user_venv) as lab:
        with urllib.request.urlopen(lab.page_url("lab"), timeout=30) as reply:
            html = reply.read().decode()
        config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                      html, re.DOTALL).group(1))
        assert LABEXTENSION_NAME in {e["name"] for e in config["federated_extensions"]}
        assert "gpuwidget" not in {e["name"] for e in config["federated_extensions"]}
        page.goto(lab.page_url("lab"))
        tab = page.locator(".jp-SideBar .lm-TabBar-tab[data-id='gpuwidget-sidebar']")
        tab.wait_for(timeout=90_000)
        tab.click()
        # The host card is drawn from the server extension's stream: both halves work from the wheel.
        page.wait_for_selector(".jp-gpuwidget-sidebar .jp-gpuwidget-card[data-device='host']", timeout=60_000)
        with urllib.request.urlopen(f"{lab.url}lab/api/settings/{LABEXTENSION_NAME}:plugin?token={lab.token}",
                                    timeout=30) as reply:
            schema = json.load(reply)["schema"]
        assert schema["properties"]["interval"]["default"] == 1
        problems = [m for m in page.console_messages if m.startswith(("error", "warning")) and "gpuwidget" in m]
        assert not problems, problems
        log = lab.log.read_text()
        assert "gpuwidget | extension was successfully loaded" in log, log[-3000:]
