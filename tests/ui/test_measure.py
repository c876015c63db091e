"""The Measure button in a real JupyterLab and browser: saved right after its cell and reopened once
that kernel is gone, it is a note, not a widget error; clicked (by keyboard, after a page reload
that kept the kernel) it shows the tuner's progress, then its measured table, which is saved."""

from __future__ import annotations

import json

import pytest

from conftest import MEASURE_BUDGET_S, open_notebook, readme_image, run_all_cells, wait_for

pytestmark = pytest.mark.browser

NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"
MEASURE_MIME = "application/vnd.gpuwidget.measure+json"
GONE_NOTE = "Measure needs the kernel that ran this cell"


def save(page, path) -> dict:
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    wait_for(lambda: not page.evaluate("window.jupyterapp.shell.currentWidget.context.model.dirty"), 30,
             "the notebook was not saved", page)
    return json.loads(path.read_text())


def watched_outputs(saved: dict) -> list[dict]:
    return saved["cells"][2]["outputs"]


def shut_down_and_close(page) -> None:
    page.evaluate("""async () => {
      const panel = window.jupyterapp.shell.currentWidget;
      if (panel && panel.sessionContext) { await panel.sessionContext.shutdown(); }
      await window.jupyterapp.commands.execute('application:close-all');
    }""")


def notebook_text(page) -> str:
    return page.locator(NOTEBOOK).inner_text()


def test_measure_saved_reopened_and_clicked(lab, page):
    path = lab.root / "measure.ipynb"
    open_notebook(page, lab, "measure.ipynb", reset=True)
    run_all_cells(page)
    button = page.locator(f"{NOTEBOOK} .gpuwidget-measure button")
    button.wait_for(timeout=120_000)
    assert button.inner_text() == "Measure the suggested changes"
    hint = page.locator(f"#{button.get_attribute('aria-describedby')}").inner_text()

    # Saved right after the watched cell (as an autosave would): the offer, its fallback, no widget.
    saved = save(page, path)
    mimes = {mime for output in watched_outputs(saved) for mime in output.get("data", {})}
    assert MEASURE_MIME in mimes and "text/html" in mimes
    # The hint announces the time the kernel planned for measuring this run's changes.
    [offer] = [output["data"][MEASURE_MIME] for output in watched_outputs(saved)
               if MEASURE_MIME in output.get("data", {})]
    assert 0 < offer["budget_s"] < 90  # said in seconds (from 90 s on, in minutes)
    assert offer["budget_s"] <= MEASURE_BUDGET_S  # the server's GpuWidget.measure_budget reached its kernel
    assert hint.startswith("Measures the suggested changes") and f"(about {offer['budget_s']} s)" in hint
    assert "application/vnd.jupyter.widget-view+json" not in json.dumps(saved)

    # Reopened once that kernel is gone: a note where the button was, and no widget error.
    shut_down_and_close(page)
    open_notebook(page, lab, "measure.ipynb", reset=True)
    note = page.locator(f"{NOTEBOOK} .gpuwidget-measure[data-state='gone']")
    note.wait_for(timeout=30_000)
    assert GONE_NOTE in note.inner_text() and "%%gpuwatch --tune" in note.inner_text()
    assert not note.locator("button").count()
    page.wait_for_timeout(1000)  # a widget manager would report missing models by now
    assert "Error displaying widget" not in notebook_text(page)

    # Run again; the page reloads with the kernel kept: the button still works from the saved output.
    run_all_cells(page)
    wait_for(lambda: page.locator(f"{NOTEBOOK} .gpuwidget-measure[data-state='ready']").count(), 120,
             "no Measure button after running the notebook again", page)
    save(page, path)
    page.reload()
    open_notebook(page, lab, "measure.ipynb")
    view = page.locator(f"{NOTEBOOK} .gpuwidget-measure[data-state='ready']")
    view.wait_for(timeout=30_000)
    page.wait_for_timeout(500)  # the kernel's identity is checked (the button would turn into the note)
    assert view.get_attribute("data-state") == "ready"

    # By keyboard: focus, Enter; busy with the progress in place, then the table in the output.
    view.locator("button").focus()
    page.keyboard.press("Enter")
    wait_for(lambda: page.locator(f"{NOTEBOOK} .gpuwidget-measure[data-state='busy']").count()
             or page.locator(f"{NOTEBOOK} .gpuwidget-tune").count(), 10, "Enter did not start measuring", page)
    table = page.locator(f"{NOTEBOOK} .gpuwidget-tune")
    table.wait_for(timeout=90_000)
    assert "num_workers" in table.inner_text()
    # It continues the finding: the suggestion is a row, the chosen setting is a row, named as there.
    rows = table.locator("tbody tr").all_inner_texts()
    chosen = [row for row in rows if row.rstrip().endswith("chosen")]
    assert len(chosen) == 1 and any("suggested" in row for row in rows), rows
    verdict = table.locator(".gpuwidget-verdict").inner_text()
    label = chosen[0].split("\t")[0].strip()
    assert verdict.startswith(label) or verdict.startswith("The loader as it is"), (verdict, label)
    assert "the suggested " in verdict and "None" not in table.inner_text()
    # Its code has the panel's Copy button, shown in this trusted output.
    assert table.locator(".gpuwidget-copy").is_visible()
    table.screenshot(path=str(readme_image("measure.png")))
    assert not page.locator(f"{NOTEBOOK} .gpuwidget-measure").count()
    assert not page.locator(f"{NOTEBOOK} .gpuwidget-tuning").count()

    # Saved with the notebook: the table replaced the offer in the cell's output.
    saved = save(page, path)
    outputs = json.dumps(watched_outputs(saved))
    assert "gpuwidget-tune" in outputs and MEASURE_MIME not in outputs
    assert "Error displaying widget" not in notebook_text(page)
    errors = [line for line in page.console_messages if line.startswith("error")]
    assert not errors, errors
    shut_down_and_close(page)
