"""The post-run panel in a real JupyterLab and browser: after the cell's output, copyable at a
common width with feedback, themed light and dark, saved small, reopened without widget
errors, and readable when a colleague opens it untrusted (sanitized)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from conftest import SCREENSHOTS, open_notebook, readme_image, run_all_cells, wait_for

pytestmark = pytest.mark.browser

NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"
WATCHED_CELLS = 3
MAX_GROWTH_PER_WATCHED_CELL = 100_000

# Text of every output of one cell, in order, with what kind each is.
OUTPUTS_JS = """(index) => {
  const cell = document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell')[index];
  return [...cell.querySelectorAll('.jp-OutputArea-output')].map(node => ({
    panel: !!node.querySelector('.gpuwidget-run'), text: node.innerText }));
}"""

# Boxes of the first change's copy button and code, and whether the code fits its block.
COPY_LAYOUT_JS = """() => {
  const change = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .gpuwidget-change');
  const box = node => { const r = node.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width}; };
  const pre = change.querySelector('pre');
  return {button: box(change.querySelector('.gpuwidget-copy')), code: box(pre),
          codeText: box(change.querySelector('code')),
          overflows: pre.scrollWidth > pre.clientWidth + 1};
}"""


def overlap(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def command(page, name: str, args: dict | None = None) -> None:
    page.evaluate("([name, args]) => window.jupyterapp.commands.execute(name, args)", [name, args or {}])


def set_theme(page, theme: str) -> None:
    command(page, "apputils:change-theme", {"theme": theme})
    light = "true" if theme == "JupyterLab Light" else "false"
    wait_for(lambda: page.evaluate(f"document.body.dataset.jpThemeLight === '{light}'"), 20,
             f"theme {theme} did not apply", page)
    page.wait_for_timeout(500)  # the theme's stylesheet settles


def cells(page):
    """The cells of the notebook on show (a page may keep other notebooks' tabs, hidden)."""
    return page.locator(f"{NOTEBOOK} .jp-Cell")


def close_notebook(page) -> None:
    """Shut the open notebook's kernel down and close every tab (a reopened page restores them)."""
    page.evaluate("""async () => {
      const panel = window.jupyterapp.shell.currentWidget;
      if (panel && panel.sessionContext) { await panel.sessionContext.shutdown(); }
      await window.jupyterapp.commands.execute('application:close-all');
    }""")


def no_widget_errors(page) -> bool:
    return "Error displaying widget" not in page.locator(NOTEBOOK).inner_text()


@pytest.fixture
def wide_page(browser, lab):
    """A page 1150 px wide (a common laptop window) that may read and write the clipboard."""
    context = browser.new_context(viewport={"width": 1150, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=lab.url.rstrip("/"))
    page = context.new_page()
    page.console_messages = []  # type: ignore[attr-defined]
    page.on("console", lambda msg: page.console_messages.append(f"{msg.type}: {msg.text}"))
    page.bokehjs_requests = []  # type: ignore[attr-defined]
    page.on("requestfinished", lambda request: "gpuwidget/static/bokeh-" in request.url
            and page.bokehjs_requests.append(request.url))
    yield page
    try:
        set_theme(page, "JupyterLab Light")  # the lab's settings outlive this page
    finally:
        context.close()


def test_bokehjs_route_answers_head_for_its_version_only(lab):
    import bokeh

    def status(version: str) -> int:
        request = urllib.request.Request(f"{lab.url}gpuwidget/static/bokeh-{version}.min.js", method="HEAD",
                                         headers={"Authorization": f"token {lab.token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as error:
            return error.code

    assert status(bokeh.__version__) == 200
    assert status("0.0.1") == 404


def test_panel_after_output_copyable_themed_small_and_reopens_clean(lab, wide_page):
    page = wide_page
    path = lab.root / "panel.ipynb"
    size_before = path.stat().st_size
    open_notebook(page, lab, "panel.ipynb", reset=True)
    run_all_cells(page)
    page.wait_for_selector(".gpuwidget-run[data-outcome='error']", timeout=120_000)

    # The exception's type is named; the panel of each watched cell comes after its printed output.
    assert "ended with ValueError: loss went NaN" in page.locator(".gpuwidget-run[data-outcome='error']").inner_text()
    outputs = page.evaluate(OUTPUTS_JS, 2)
    printed = [n for n, o in enumerate(outputs) if "epoch done" in o["text"]]
    panels = [n for n, o in enumerate(outputs) if o["panel"]]
    assert printed and panels and printed[-1] < panels[0], outputs
    # The live plot came from the server extension's BokehJS, not inline.
    assert page.bokehjs_requests, "BokehJS was not loaded from gpuwidget's server extension"

    # Accessible: a labelled region, severity in words, a labelled keyboard-operable button.
    panel = cells(page).nth(2).locator(".gpuwidget-run")
    assert panel.get_attribute("role") == "region"
    assert "gpuwidget report" in (panel.get_attribute("aria-label") or "")
    # The first finding with a change: the copy checks below use the first change in the notebook.
    finding = panel.locator(".gpuwidget-finding", has=page.locator(".gpuwidget-change")).first
    assert finding.locator(".gpuwidget-severity").inner_text().strip().endswith(("warning", "critical", "info"))

    # At 1150 px the copy button sits above the code, covering none of it.
    layout = page.evaluate(COPY_LAYOUT_JS)
    assert not overlap(layout["button"], layout["code"]), layout
    assert not overlap(layout["button"], layout["codeText"]), layout
    assert not layout["overflows"], "the code is cut off at 1150 px"
    code = finding.locator("code").last.inner_text()
    assert code.strip()
    # The loader waits on storage: a finding changes num_workers (and Measure was offered for it).
    assert any("num_workers" in text for text in panel.locator(".gpuwidget-change code").all_inner_texts())
    button = finding.locator(".gpuwidget-copy")
    status = finding.locator(".gpuwidget-copied")
    assert status.get_attribute("aria-live") == "polite"
    button.click()
    wait_for(lambda: status.inner_text() == "Copied", 5, "no 'Copied' feedback after a click", page)
    assert page.evaluate("navigator.clipboard.readText()") == code
    # By keyboard: focus shows, Enter copies.
    wait_for(lambda: status.inner_text() == "", 6, "the 'Copied' note did not clear", page)
    button.focus()
    page.keyboard.press("Enter")
    wait_for(lambda: status.inner_text() == "Copied", 5, "Enter on the focused button did not copy", page)
    focus = page.evaluate("""() => { const b = document.activeElement;
        return {visible: b.matches(':focus-visible'), outline: getComputedStyle(b).outlineStyle}; }""")
    assert focus == {"visible": True, "outline": "solid"}, focus

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("() => window.getSelection().removeAllRanges()")
    page.set_viewport_size({"width": 1150, "height": 2400})  # the whole panel in one picture, under the toolbar
    panel.scroll_into_view_if_needed()
    # One story: the headline is the first finding's cause and gain, as its card says them.
    cause = panel.locator(".gpuwidget-cause").inner_text().strip()
    first = panel.locator(".gpuwidget-finding").first
    title = first.get_attribute("aria-label") or ""
    gain = first.locator(".gpuwidget-gain").inner_text().strip() if first.locator(".gpuwidget-gain").count() else ""
    assert cause.startswith(f"{title} {gain}".strip()), (cause, title, gain)
    panel.screenshot(path=str(readme_image("panel-light.png")))
    # Dark theme: the code block is one colour (the code's own background is see-through).
    set_theme(page, "JupyterLab Dark")
    colours = page.evaluate("""() => { const pre = document.querySelector(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .gpuwidget-change pre');
        return {code: getComputedStyle(pre.querySelector('code')).backgroundColor,
                pre: getComputedStyle(pre).backgroundColor}; }""")
    assert colours["code"] == "rgba(0, 0, 0, 0)", colours
    assert colours["pre"] not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), colours
    panel.screenshot(path=str(readme_image("panel-dark.png")))
    set_theme(page, "JupyterLab Light")
    page.set_viewport_size({"width": 1150, "height": 900})

    # Saved: small (no BokehJS, no widget views); the Measure button is an output of its own type.
    command(page, "docmanager:save")
    wait_for(lambda: "gpuwidget-run" in path.read_text() and not page.evaluate(
        "window.jupyterapp.shell.currentWidget.context.model.dirty"), 30, "the notebook was not saved", page)
    saved = json.loads(path.read_text())
    growth = path.stat().st_size - size_before
    assert growth / WATCHED_CELLS < MAX_GROWTH_PER_WATCHED_CELL, f"{growth} bytes for {WATCHED_CELLS} watched cells"
    mimes = [mime for c in saved["cells"] for o in c.get("outputs", []) for mime in o.get("data", {})]
    assert "application/vnd.jupyter.widget-view+json" not in mimes
    assert "application/javascript" not in mimes
    assert "application/vnd.gpuwidget.measure+json" in mimes

    # Reopened after its kernel is gone: no widget errors anywhere.
    close_notebook(page)
    open_notebook(page, lab, "panel.ipynb", reset=True)
    page.wait_for_selector(".gpuwidget-run[data-outcome='error']", timeout=30_000)
    page.wait_for_timeout(1500)  # the widget manager restores (and would report missing models)
    assert no_widget_errors(page), page.locator(NOTEBOOK).inner_text()[:2000]
    # Where the Measure button was, a note says how to measure without that kernel.
    page.locator(f"{NOTEBOOK} .gpuwidget-measure[data-state='gone']").first.wait_for(timeout=30_000)
    close_notebook(page)

    # As a colleague receives it: any change to the file makes it untrusted (sanitized HTML).
    saved["metadata"]["received_from"] = "a colleague"
    (lab.root / "received.ipynb").write_text(json.dumps(saved))
    open_notebook(page, lab, "received.ipynb", reset=True)
    assert page.evaluate("window.jupyterapp.shell.currentWidget.context.path") == "received.ipynb"
    panel = cells(page).nth(2).locator(".gpuwidget-run")
    panel.wait_for(timeout=30_000)
    assert not page.evaluate("window.jupyterapp.shell.currentWidget.model.cells.get(2).trusted")
    text = panel.inner_text()
    # Labels stay apart (they ran together, "0%50%100%0 s3.6 sCPU", when the chart was inline SVG).
    assert "0%50%100%" not in text
    assert re.search(r"duration\s+\d", text) and re.search(r"samples/s\s+\d", text), text
    assert re.search(r"CPU \(all cores\)\s+\S", text)
    image = panel.locator(".gpuwidget-chart img")
    wait_for(lambda: image.evaluate("img => img.complete && img.naturalWidth > 0"), 10,
             "the chart image did not render in the untrusted notebook", page)
    # No copy button that cannot work; the code itself stays readable and selectable.
    assert not panel.locator(".gpuwidget-copy").first.is_visible()
    assert "num_workers" in panel.locator(".gpuwidget-change code").first.inner_text()
    assert "warning" in text or "critical" in text
    assert no_widget_errors(page)
    panel.screenshot(path=str(SCREENSHOTS / "panel-untrusted.png"))
    close_notebook(page)
