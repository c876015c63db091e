"""The package's layering: the model (trace, sources, probes, advice, measure, run, report) never
reaches up into the widgets in ``gpuwidget.ui``; only the session that shows a run does.

Read from the source with ``ast``, function-local imports included, so a circle held together
by an import inside a function is caught as well as one at module top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpuwidget

PACKAGE = Path(gpuwidget.__file__).parent
# Above the model: the session shows the live view and the post-run buttons; the package's
# __init__ offers load_bokehjs() and warms the live view's imports.
MAY_IMPORT_UI = {"__init__.py", "session.py"}


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name (``from gpuwidget import ui`` -> gpuwidget.ui)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _model_modules() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[0] != "ui" and path.relative_to(PACKAGE).as_posix() not in MAY_IMPORT_UI]


def test_nothing_below_the_session_imports_the_widgets():
    offenders = {
        path.relative_to(PACKAGE).as_posix(): sorted(name for name in _imported_modules(path)
                                                     if name == "gpuwidget.ui" or name.startswith("gpuwidget.ui."))
        for path in _model_modules()
    }
    assert {path: names for path, names in offenders.items() if names} == {}


# The model: what a Run is made of and how it is judged, measured and rendered as text/HTML.
MODEL = ("trace.py", "facts.py", "sources", "probes", "advice", "measure", "run.py", "runfile.py",
         "report.py", "chart.py", "export.py")
WIDGET_LIBRARIES = ("ipywidgets", "bokeh", "jupyter_bokeh")


def test_the_model_builds_no_widgets():
    """Progress bars and plots belong to ui/: the model hands out callbacks and data instead."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in MODEL:
            continue
        names = sorted(name for name in _imported_modules(path) if name.split(".")[0] in WIDGET_LIBRARIES)
        if names:
            offenders[path.relative_to(PACKAGE).as_posix()] = names
    assert offenders == {}


def test_the_layer_check_sees_a_function_local_import(tmp_path):
    module = tmp_path / "sneaky.py"
    module.write_text("def render(run):\n    from gpuwidget.ui.live import LiveView\n    return LiveView\n")
    assert "gpuwidget.ui.live" in _imported_modules(module)
    assert len(_model_modules()) > 20  # the walk found the package's modules, not an empty folder


# ------------------------------------------------------------------------------- the GPU seam and the floors

# Where each vendor's bindings may be imported: its driver module, the one door to the driver.
DRIVER_DOORS = {"pynvml": "sources/nvml/driver.py", "amdsmi": "sources/amd/driver.py"}
VENDOR_PACKAGES = ("gpuwidget.sources.nvml", "gpuwidget.sources.amd")


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _package_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _forbidden(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    """The modules ``path`` imports that are, or are inside, one of ``forbidden``."""
    return sorted(name for name in _imported_modules(path)
                  if any(name == f or name.startswith(f + ".") for f in forbidden))


def _offenders(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {_relative(path): _forbidden(path, forbidden) for path in paths}
    return {path: names for path, names in found.items() if names}


def test_only_each_vendors_driver_module_imports_its_bindings():
    for library, door in DRIVER_DOORS.items():
        importers = [path for path in _package_modules() if _offenders([path], (library,))]
        assert [_relative(path) for path in importers] == [door]


def test_nothing_above_the_sources_names_a_vendors_source():
    """Above ``sources/`` a GPU is a GpuSource from open_gpu_sources(): no module imports NVML's or amdsmi's."""
    above = [path for path in _package_modules() if _relative(path).split("/")[0] != "sources"]
    assert _offenders(above, VENDOR_PACKAGES) == {}


def test_the_child_channel_and_the_figures_do_not_reach_up_into_the_advisor():
    """children/ summarises a child's loop with figures/ (the floor below both), never with advice/."""
    for floor, forbidden in (("children", ("gpuwidget.advice",)),
                             ("figures", ("gpuwidget.advice", "gpuwidget.children", *VENDOR_PACKAGES))):
        paths = [path for path in _package_modules() if _relative(path).split("/")[0] == floor]
        assert paths, floor
        assert _offenders(paths, forbidden) == {}, floor


def test_importing_a_finding_loads_no_gpu_source():
    """Finding -> report -> the figures: none of it starts a vendor's source or its bindings."""
    import subprocess
    import sys

    code = ("import sys, gpuwidget.advice.finding\n"
            "print(sorted(m for m in sys.modules if m.startswith(('gpuwidget.sources.nvml', 'gpuwidget.sources.amd'))"
            " or m in ('pynvml', 'amdsmi')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent, check=True)
    assert result.stdout.strip() == "[]"


def test_the_seam_checks_catch_a_planted_import(tmp_path):
    (tmp_path / "sneaky.py").write_text("def devices():\n    from gpuwidget.sources.nvml import NvmlSource\n"
                                        "    import amdsmi\n    from gpuwidget.advice.summary import summarize\n")
    [path] = tmp_path.glob("*.py")
    assert _forbidden(path, VENDOR_PACKAGES) == ["gpuwidget.sources.nvml", "gpuwidget.sources.nvml.NvmlSource"]
    assert _forbidden(path, ("amdsmi",)) == ["amdsmi"]
    assert _forbidden(path, ("gpuwidget.advice",)) == ["gpuwidget.advice.summary", "gpuwidget.advice.summary.summarize"]
    assert _forbidden(path, ("gpuwidget.advisor",)) == []  # a name that merely starts alike is not inside
