"""Browser-test fixtures: a real JupyterLab started by the test, and Debian's chromium via Playwright.

No browser download works on these machines; the tests use ``/usr/bin/chromium`` (``make
test`` installs it) and are skipped with a clear reason where it is missing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from labserver import Lab, project_options, quiet_settings, running_lab

CHROMIUM = os.environ.get("GPUWIDGET_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FIXTURES = Path(__file__).parent / "fixtures"
MEASURE_BUDGET_S = 5
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


def readme_image(name: str) -> Path:
    """Where a screenshot the README shows goes: build/screenshots/ on a test run, docs/images/
    when ``GPUWIDGET_README_IMAGES=1`` asks to refresh the README's (a test run leaves tracked
    files alone)."""
    folder = DOCS_IMAGES if os.environ.get("GPUWIDGET_README_IMAGES") == "1" else SCREENSHOTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.fixture(autouse=True)
def jp_asyncio_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Replaces pytest-jupyter's autouse loop fixture here: its loop is the thread's current
    one, which Playwright's sync API is running when the fixture tries to close it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab on a free port, serving a temporary folder with the fixture notebooks."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need chromium at {CHROMIUM} (apt-get install -y chromium)")
    root = tmp_path_factory.mktemp("lab")
    for fixture in FIXTURES.glob("*.ipynb"):
        shutil.copy(fixture, root / fixture.name)
    quiet_settings(root / ".settings")
    # Measure takes 5 s (the server's setting, which its kernels inherit) rather than the ~35 s a change
    # its plans announce: the browser tests check what the clicks show, and the tuner's verdicts are
    # judged in tests/test_tuning.py and tests/test_measure_plan.py. The tuner takes about a second of it
    # (tutorial 02: 3 settings timed in 1.1 s); the model's changes share the rest, each running its
    # six blocks even past the budget. At 15 s the two browser modules took 108 s, at 5 s 92 s.
    options = [*project_options(root), f"--GpuWidget.measure_budget={MEASURE_BUDGET_S}"]
    with running_lab(root, "gpuwidget-test-token", options) as lab:
        yield lab


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Chromium for one test module. Module-scoped: Playwright's sync API keeps an event loop
    running while it lives, which later (non-browser) tests' loops must not run into."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need chromium at {CHROMIUM} (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield instance
        instance.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    page = context.new_page()
    page.console_messages = []  # type: ignore[attr-defined]
    page.on("console", lambda msg: page.console_messages.append(f"{msg.type}: {msg.text}"))
    # An exception no handler caught (a rejected promise, say) is no console message.
    page.on("pageerror", lambda error: page.console_messages.append(f"pageerror: {error}"))
    yield page
    context.close()


KERNEL_READY_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""


def open_notebook(page, lab: Lab, name: str, reset: bool = False) -> None:
    """Open a notebook and wait until its kernel is idle and the app is scriptable.

    JupyterLab sometimes asks which kernel to use even though the notebook names one
    (a race with loading the kernel specs); the named kernel is accepted. ``reset``: the
    notebook alone, without the tabs earlier tests left in the lab's workspace.
    """
    page.goto(lab.page_url(f"lab/tree/{name}") + ("&reset" if reset else ""))
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    deadline = time.monotonic() + 60
    while not page.evaluate(KERNEL_READY_JS):
        accept = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
        if time.monotonic() > deadline:
            raise AssertionError("the notebook's kernel did not become idle in 60 s")
        time.sleep(0.2)


def layout_restored(page) -> None:
    """Wait until JupyterLab has put back the saved layout. A restore that ends after a test opened or
    clicked something can close or cover it again (the sidebar clicked open before it, fresh-check runs
    36 and 37; the settings editor, run 29)."""
    page.evaluate("async () => { await window.jupyterapp.restored; }")


def run_all_cells(page) -> None:
    """Start running every cell without waiting for them to finish."""
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def wait_for(predicate, timeout: float, message: str, page):
    """Poll ``predicate`` until it is truthy; on time-out leave a screenshot and the console.

    Waiting through the page (not time.sleep) lets Playwright deliver its events meanwhile
    (requests, socket closes).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        page.wait_for_timeout(100)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "failure.png"))
    raise AssertionError(message + "\npage:\n" + page_state(page) + "\nconsole:\n"
                         + "\n".join(page.console_messages[-20:]))


# What a failed wait leaves beside the screenshot: whether BokehJS and its documents are on the page, the
# kernel's state, each output's kind and first words, and the error of any widget whose view failed.
PAGE_STATE_JS = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  const outputs = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')].map(
    (node) => (node.dataset.mimeType || '?') + ': ' + node.innerText.slice(0, 80).replace(/\\s+/g, ' '));
  // A widget whose view could not be made shows an icon; a click on it shows the error and its stack.
  const failed = [...document.querySelectorAll('.jupyter-widgets-error-widget')].map((node) => {
    if (node.parentElement && node.parentElement.onclick) { node.parentElement.onclick(); }
    return node.innerText.slice(0, 2000);
  });
  return JSON.stringify({
    failed_widgets: failed,
    bokeh: window.Bokeh ? window.Bokeh.version + ', ' + window.Bokeh.documents.length + ' documents' : null,
    kernel: kernel ? kernel.status : null,
    outputs: outputs.slice(-8),
  }, null, 1);
}"""


def page_state(page) -> str:
    try:
        return page.evaluate(PAGE_STATE_JS)
    except Exception as exc:  # noqa: BLE001 - the page itself may be what broke
        return f"(unreadable: {exc!r})"
