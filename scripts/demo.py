"""``make demo``: run the first two tutorials headless and show what gpuwidget said, no browser needed.

Executes notebooks/01-quickstart.ipynb and notebooks/02-data-starvation.ipynb in a real
python3 kernel (nbclient), each in a temporary working directory so the files they write stay
out of the repository, writes HTML copies of the executed notebooks to build/demo/, and prints
the panel gpuwidget left under the starved training loop (02's first watched cell) as text.

    python scripts/demo.py [--out build/demo]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DEMO = ["01-quickstart.ipynb", "02-data-starvation.ipynb"]
# The watched starved loop carries this tag in 02-data-starvation.ipynb.
STARVED_NOTEBOOK, STARVED_TAG = "02-data-starvation.ipynb", "starved-loop"
CELL_TIMEOUT = 300


def execute(path: Path) -> tuple[nbformat.NotebookNode, float]:
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuwidget-demo-") as workdir:
        NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                       resources={"metadata": {"path": workdir}}).execute()
    return nb, time.perf_counter() - started


def panel_text(nb: nbformat.NotebookNode, tag: str) -> str | None:
    """The plain-text panel of the watched cell tagged ``tag``."""
    for cell in nb.cells:
        if tag not in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            if "gpuwidget-run" in data.get("text/html", ""):
                return data.get("text/plain")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "demo", help="where the HTML copies go")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    starved = None
    for name in DEMO:
        print(f"running notebooks/{name} ...", flush=True)
        nb, seconds = execute(NOTEBOOKS / name)
        body, _ = exporter.from_notebook_node(nb)
        target = args.out / name.replace(".ipynb", ".html")
        target.write_text(body, encoding="utf-8")
        print(f"  done in {seconds:.0f} s -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        if name == STARVED_NOTEBOOK:
            starved = panel_text(nb, STARVED_TAG)
    if not starved:
        print(f"demo: no gpuwidget panel found under the cell tagged {STARVED_TAG!r} in {STARVED_NOTEBOOK}",
              file=sys.stderr)
        return 1
    print("\nWhat gpuwidget said under the starved training loop (02-data-starvation.ipynb):\n")
    print(starved)
    print(f"\nOpen the HTML copies in {args.out} to see every cell, its panel and its chart.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
