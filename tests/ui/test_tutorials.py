"""The first two tutorials run as a user runs them, in a real JupyterLab and browser: no stderr in
any cell, no console errors or warnings on the page, no "No such comm" or "Task was destroyed" in
the server's log, and every watched cell ends with its panel.

01 and 02 are the ones a new user runs first and cover the live plot, the panel, the Measure
offer and the runs' API (40 s together in the browser here; 10 s and 22 s headless with
nbclient). The other tutorials show the same parts around longer workloads, so running them in
the browser too would add minutes without new front-end paths; tests/test_notebooks.py executes
every tutorial headless.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from conftest import open_notebook, run_all_cells, wait_for

pytestmark = pytest.mark.browser

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TUTORIALS = ("01-quickstart.ipynb", "02-data-starvation.ipynb")
SERVER_LOG_ERRORS = ("No such comm", "Task was destroyed")
RUN_TIMEOUT_S = 180

# Where the run stands: cells still to run (or running), the first error, the kernel's status.
PROGRESS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = [...panel.model.cells].filter(cell => cell.type === 'code');
  const waiting = cells.filter(cell => cell.executionCount === null).length;
  const running = [...panel.content.node.querySelectorAll('.jp-InputPrompt')]
    .filter(node => node.textContent.includes('*')).length;
  const errors = cells.flatMap(cell => cell.outputs.toJSON())
    .filter(output => output.output_type === 'error')
    .map(output => `${output.ename}: ${output.evalue}`);
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {waiting, running, errors, status: kernel ? kernel.status : 'none'};
}"""

CELLS_JS = """() => [...window.jupyterapp.shell.currentWidget.model.cells]
  .filter(cell => cell.type === 'code')
  .map(cell => ({source: cell.sharedModel.getSource(), outputs: cell.outputs.toJSON()}))"""


def run_to_the_end(page, name: str) -> list[dict]:
    run_all_cells(page)

    def done():
        state = page.evaluate(PROGRESS_JS)
        assert not state["errors"], f"{name}: {state['errors']}"
        return state["waiting"] == 0 and state["running"] == 0 and state["status"] == "idle"

    wait_for(done, RUN_TIMEOUT_S, f"{name} did not run to the end in {RUN_TIMEOUT_S} s", page)
    return page.evaluate(CELLS_JS)


def is_panel(output: dict) -> bool:
    return "gpuwidget-run" in output.get("data", {}).get("text/html", "")


def test_tutorials_run_clean_in_the_browser(lab, page):
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    log_start = lab.log.stat().st_size
    started = time.monotonic()
    for name in TUTORIALS:
        shutil.copy(NOTEBOOKS / name, lab.root / name)
        open_notebook(page, lab, name, reset=True)
        cells = run_to_the_end(page, name)

        stderr = [(cell["source"].splitlines()[0], output.get("text", "")[:300]) for cell in cells
                  for output in cell["outputs"] if output.get("name") == "stderr"]
        assert not stderr, f"{name}: stderr in cells {stderr}"
        watched = [cell for cell in cells if cell["source"].startswith("%%gpuwatch")]
        assert watched, name
        for cell in watched:
            outputs = cell["outputs"]
            panels = [n for n, output in enumerate(outputs) if is_panel(output)]
            assert panels, f"{name}: no panel after {cell['source'].splitlines()[:2]}"
            # After the panel only the Measure offer (or its table) may follow: it is the ending.
            after = [output for output in outputs[panels[-1] + 1:]
                     if "application/vnd.gpuwidget.measure+json" not in output.get("data", {})]
            assert not after, f"{name}: output after the panel: {after}"
        # The live plot's page side and the Measure button rendered without errors.
        assert "Error displaying widget" not in page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").inner_text()
        page.evaluate("""async () => {
          const panel = window.jupyterapp.shell.currentWidget;
          await panel.sessionContext.shutdown();
          await window.jupyterapp.commands.execute('application:close-all');
        }""")
    elapsed = time.monotonic() - started

    problems = [line for line in page.console_messages if line.startswith(("error", "warning"))]
    assert not problems, problems
    assert not page_errors, page_errors
    with open(lab.log, errors="replace") as log:
        log.seek(log_start)
        server_log = log.read()
    for needle in SERVER_LOG_ERRORS:
        assert needle not in server_log, [line for line in server_log.splitlines() if needle in line][:5]
    print(f"tutorials {', '.join(TUTORIALS)} ran in the browser in {elapsed:.0f} s")
