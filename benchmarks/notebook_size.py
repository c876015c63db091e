"""Saved notebook size: how much a watched cell adds to the .ipynb once executed and saved.

Each tutorial named (default: 01 and 02) is executed top to bottom in a fresh python3 kernel
with nbclient (as ``tests/test_notebooks.py`` does, in a temporary working directory) and
written with nbformat, as a saved notebook is. For each: the file's size before and after,
the watched cells (``%%gpuwatch`` or ``gpuwidget.watch(``), the growth per watched cell, the
largest single output, and the part nbclient alone adds (the state of the cell's closed
widgets in the notebook's metadata; JupyterLab does not save widget state by default).

A kernel started by nbclient has no Jupyter server behind it, so BokehJS is sent inline
(1.3 MB) there: this measures that the loader's output is emptied when the cell ends, which
is what keeps it out of the file. Target: under 100 kB per watched cell.

    .venv/bin/python benchmarks/notebook_size.py [--notebooks 01,02] [--json PATH]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_header, table, verdict, write_json

TARGET_PER_WATCHED_CELL = 100_000


def measure(path: Path) -> dict[str, Any]:
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as workdir:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": workdir}}).execute()
    after = len(nbformat.writes(nb).encode())
    watched = sum(1 for c in nb.cells if c.cell_type == "code"
                  and ("%%gpuwatch" in c.source or "gpuwidget.watch(" in c.source))
    outputs = [len(json.dumps(o)) for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    widget_state = len(json.dumps(nb.metadata.get("widgets", {})))
    before = path.stat().st_size
    return {"notebook": path.name, "before": before, "after": after, "watched": watched,
            "per_watched": (after - before) / max(watched, 1), "largest_output": max(outputs, default=0),
            "widget_state": widget_state,
            "scripts": sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs
                           if "application/javascript" in o.get("data", {}))}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--notebooks", {"default": "01,02"})])
    header = print_header("Saved notebook size")
    wanted = [prefix.strip() for prefix in args.notebooks.split(",") if prefix.strip()]
    paths = [path for prefix in wanted for path in sorted((ROOT / "notebooks").glob(f"{prefix}-*.ipynb"))]
    results = [measure(path) for path in paths]
    table(["notebook", "before kB", "after kB", "watched cells", "kB per watched cell", "largest output kB",
           "widget state kB (nbclient)", "scripts kept"],
          [[r["notebook"], r["before"] / 1000, r["after"] / 1000, r["watched"], r["per_watched"] / 1000,
            r["largest_output"] / 1000, r["widget_state"] / 1000, r["scripts"]] for r in results])
    worst = max(r["per_watched"] for r in results)
    checks = [verdict("growth per watched cell (worst notebook)", worst, TARGET_PER_WATCHED_CELL,
                      higher_is_better=False, shown=f"{worst / 1000:.1f} kB", target_shown="100 kB")]
    write_json(args.json, {**header, "results": results, "verdicts": checks})


if __name__ == "__main__":
    main()
