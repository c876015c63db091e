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
