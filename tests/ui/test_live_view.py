"""In a real JupyterLab and browser: the live plot under a watched cell grows while the cell runs."""

from __future__ import annotations

import time

import pytest

from conftest import SCREENSHOTS, open_notebook, run_all_cells, wait_for

pytestmark = pytest.mark.browser

# Number of points in the live plot's data source (BokehJS documents live in window.Bokeh).
POINTS_JS = """() => {
  if (!window.Bokeh) { return -1; }
  let points = -1;
  for (const doc of window.Bokeh.documents) {
    for (const model of doc.all_models) {
      if (model.type === 'ColumnDataSource' && model.data.cpu_util !== undefined) {
        points = Math.max(points, model.data.t.length);
      }
    }
  }
  return points;
}"""


# Number of data-wait bands drawn in the live plot.
BANDS_JS = """() => {
  let bands = 0;
  for (const doc of (window.Bokeh ? window.Bokeh.documents : [])) {
    for (const model of doc.all_models) {
      if (model.type === 'ColumnDataSource' && model.data.left !== undefined) {
        bands = Math.max(bands, model.data.left.length);
      }
    }
  }
  return bands;
}"""


def cell_is_running(page) -> bool:
    prompts = page.locator(".jp-Notebook .jp-InputArea-prompt").all_inner_texts()
    return any("*" in prompt for prompt in prompts)


def test_plot_data_grows_while_the_cell_runs_then_the_report_stays(lab, page):
    open_notebook(page, lab, "watch_live.ipynb")
    run_all_cells(page)

    first = wait_for(lambda: page.evaluate(POINTS_JS) >= 3, 60,
                     "no live data reached the plot (is BokehJS on the page?)", page)
    assert first
    early = page.evaluate(POINTS_JS)
    assert cell_is_running(page)
    time.sleep(1.5)
    later = page.evaluate(POINTS_JS)
    still_running = cell_is_running(page)
    assert still_running, "the cell ended before growth could be observed"
    assert later >= early + 5, f"plot did not grow while the cell ran: {early} -> {later} points"
    header = page.locator(".widget-html-content").first.inner_text()
    assert "watching" in header and "no NVIDIA GPU found" in header
    # The loop waits on its loader: the waits are drawn as bands while it runs.
    wait_for(lambda: page.evaluate(BANDS_JS) >= 1, 10, "no data-wait band was drawn", page)

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    time.sleep(1.0)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
    cell.screenshot(path=str(SCREENSHOTS / "live-view.png"))

    # When the cell ends, the static panel replaces the live widget and survives saving.
    report = page.wait_for_selector(".gpuwidget-run[data-outcome='ok']", timeout=60_000)
    assert "no NVIDIA GPU found" in report.inner_text()
    assert page.locator(".gpuwidget-run .gpuwidget-chart img").count() >= 1
    finding = page.locator(".gpuwidget-finding[data-rule='dataloader-starved']")
    assert "train_loader = DataLoader(train_ds, batch_size=32, shuffle=True, num_workers=" in finding.inner_text()
    cell.screenshot(path=str(SCREENSHOTS / "report.png"))
    errors = [m for m in page.console_messages if m.startswith("error") and "Bokeh" in m]
    assert not errors, errors
