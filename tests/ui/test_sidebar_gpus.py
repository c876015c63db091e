"""In a real JupyterLab and browser, over 8 fake GPUs: the dense overview, the status bar before the
sidebar is opened, keyboard operation, the dark theme, the settings' chart list, and a GPU that
stops answering while the other seven go on.

The JupyterLab runs this file as its launcher (``python test_sidebar_gpus.py serve ...``): the fake
NVML (tests/fakenvml.py) has to be installed inside the server's own process. In there, a thread
keeps the fake driver's process list current: the first kernel started (a notebook's) holds
memory on GPU 0, the server itself on GPU 1; and once the test creates the file ``hang-gpu`` in
the server's root, GPU 5's memory query stops returning, as a GPU falling off the bus does. The
server runs as in a container without the host's PID namespace (``foreign_pid_namespace``): the
GPUs in use that the driver lists no process on say so. Power moves every second, and GPU 0's
memory every two, so a test can see the rows and the status bar update.

Cells are found by their column's class (``.jp-gpuwidget-overview-holder``), never by position.
README screenshots (docs/images/sidebar-gpus*.png, sidebar-stalled*.png) are refreshed by this
test when ``GPUWIDGET_README_IMAGES=1`` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import CHROMIUM, SCREENSHOTS, layout_restored, readme_image, wait_for
from labserver import Lab, project_options, quiet_settings, running_lab

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent

GPUS = 8
# Each GPU's utilisation (percent): two idle ones, so the overview reads at a glance.
UTIL = [92, 78, 0, 64, 100, 35, 0, 51]
GIB = 1024**3
MEMORY_GIB = [66, 12, 0.5, 35, 71, 40, 0.5, 52]
HUNG_GPU = 5

PANEL = ".jp-gpuwidget-sidebar"
TAB = ".jp-SideBar .lm-TabBar-tab[data-id='gpuwidget-sidebar']"
STATUS_ITEM = ".jp-gpuwidget-statusitem"
OVERVIEW_ROWS = ".jp-gpuwidget-overview tbody tr"
TOGGLES = ".jp-gpuwidget-card-toggle"
# The overview's cells, by column (labextension/src/overview.ts OVERVIEW_COLUMNS).
GPU_CELL = ".jp-gpuwidget-overview-gpu"
BUSY_CELL = ".jp-gpuwidget-overview-util"
MEMORY_CELL = ".jp-gpuwidget-overview-memory"
POWER_CELL = ".jp-gpuwidget-overview-power"
HOLDER_CELL = ".jp-gpuwidget-overview-holder"
IN_A_CONTAINER = "in use, holder not visible from this container"


def row(page, gpu: int):
    return page.locator(f"{OVERVIEW_ROWS}[data-device='gpu{gpu}']")


def cell(page, gpu: int, column: str) -> str:
    return row(page, gpu).locator(column).inner_text()


# ------------------------------------------------------------------ the server process (this file as a script)


def _serve(argv: list[str]) -> None:
    """JupyterLab over 8 fake GPUs; the process list and the hang follow the server's root folder."""
    import psutil
    import pynvml

    sys.path.insert(0, str(HERE.parent))
    from gpuwidget.sources.nvml import source

    from fakenvml import FakeNvml, make_gpu

    def power_mw(util: int):  # moves by a watt a second (the fake's ticks are 0.1 s)
        return lambda tick: 90_000 + 6_000 * util + 1_000 * ((tick // 10) % 5)

    def memory_used(index: int):  # GPU 0's moves by 1 GB every 2 s
        steps = (lambda tick: (tick // 20) % 3) if index == 0 else (lambda tick: 0)
        return lambda tick: int((MEMORY_GIB[index] + steps(tick)) * GIB)

    # H100s read SM activity (GPM): the busy figure; here it equals the kernel-running share.
    fake = FakeNvml([make_gpu(index, util=util, sm_active=float(util), memory_used=memory_used(index),
                              memory_total=80 * GIB,
                              power_mw=power_mw(util), name="NVIDIA H100 80GB HBM3")
                     for index, util in enumerate(UTIL)], real_time=True)
    # As in a container without the host's PID namespace: this server's pid is another in the host's.
    source.namespace_pids = lambda: [os.getpid() + 100_000, os.getpid()]
    root = Path.cwd()
    hung = threading.Event()

    def is_kernel(process: psutil.Process) -> bool:
        try:
            return "ipykernel" in " ".join(process.cmdline())
        except psutil.Error:  # gone, or a zombie (a short-lived child of the server)
            return False

    def processes() -> None:
        me = psutil.Process()
        while True:
            kernels = [child.pid for child in me.children(recursive=True) if is_kernel(child)]
            fake.processes(0, compute=[(kernels[0], 61 * GIB)] if kernels else [])
            fake.processes(1, compute=[(me.pid, 3 * GIB)])
            if (root / "hang-gpu").exists():
                hung.set()
            time.sleep(0.5)

    with fake.patched():
        query = pynvml.nvmlDeviceGetMemoryInfo
        lost = fake.gpu(HUNG_GPU)

        def memory_info(gpu, *args):
            if gpu is lost and hung.is_set():
                threading.Event().wait(600)  # never returns while the test lasts
            return query(gpu, *args)

        pynvml.nvmlDeviceGetMemoryInfo = memory_info
        threading.Thread(target=processes, daemon=True, name="fake-processes").start()
        from jupyterlab.labapp import LabApp

        LabApp.launch_instance(argv=argv)


# ------------------------------------------------------------------ fixtures


@contextlib.contextmanager
def eight_gpu_lab(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Lab]:
    """JupyterLab over 8 fake GPUs, with a notebook's kernel running (it holds GPU 0)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need chromium at {CHROMIUM} (apt-get install -y chromium)")
    root = tmp_path_factory.mktemp(name)
    (root / "train.ipynb").write_text(json.dumps({
        "cells": [], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4, "nbformat_minor": 5}))
    quiet_settings(root / ".settings")
    options = [*project_options(root), "--ServerApp.log_level=WARN"]
    serve = (sys.executable, str(Path(__file__).resolve()), "serve")  # imports conftest, which imports tests/'s
    path = os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH"))))
    with running_lab(root, "gpuwidget-gpus-token", options, program=serve,
                     env={**os.environ, "JUPYTER_RUNTIME_DIR": str(root / ".runtime"), "PYTHONPATH": path}) as lab:
        # A notebook's kernel, as if the user had opened train.ipynb: its process holds GPU 0.
        request = urllib.request.Request(
            f"{lab.url}api/sessions?token={lab.token}", method="POST",
            data=json.dumps({"path": "train.ipynb", "name": "train.ipynb", "type": "notebook",
                             "kernel": {"name": "python3"}}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 201
        yield lab


@pytest.fixture(scope="module")
def gpu_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with eight_gpu_lab(tmp_path_factory, "gpulab") as lab:
        yield lab


@pytest.fixture(scope="module")
def gpu_lab_to_hang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A server of its own for the test that hangs a GPU: it never reads that GPU's source again, and
    every test after it in any order would see the GPU stale."""
    with eight_gpu_lab(tmp_path_factory, "hanglab") as lab:
        yield lab


def open_lab(page, lab: Lab) -> dict[str, list[str]]:
    """Load JupyterLab with its layout reset (the sidebar closed, whatever an earlier test left open);
    return the gpuwidget requests and sockets it makes."""
    traffic: dict[str, list[str]] = {"requests": [], "sockets": []}
    page.on("request", lambda r: "/gpuwidget/api/" in r.url and traffic["requests"].append(r.url))
    page.on("websocket", lambda ws: "/gpuwidget/api/" in ws.url and traffic["sockets"].append(ws.url))
    page.goto(lab.page_url("lab") + "&reset")
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_selector(STATUS_ITEM, timeout=60_000)
    page.wait_for_selector(TAB, timeout=30_000)
    layout_restored(page)
    return traffic


def widen_sidebar(page, width: int = 420) -> None:
    """Drag the left area's splitter so the screenshots show the overview at a usual width."""
    box = page.locator(PANEL).bounding_box()
    handle_x = box["x"] + box["width"] + 2
    y = box["y"] + 200
    page.mouse.move(handle_x, y)
    page.mouse.down()
    page.mouse.move(box["x"] + width, y, steps=5)
    page.mouse.up()
    page.wait_for_timeout(300)


def active(page) -> dict:
    return page.evaluate("""() => {
      const node = document.activeElement;
      const style = getComputedStyle(node);
      return {text: node.textContent, cls: node.className, expanded: node.getAttribute('aria-expanded'),
              outline: style.outlineStyle, outlineWidth: style.outlineWidth};
    }""")


# ------------------------------------------------------------------ tests


def test_status_bar_is_live_before_the_sidebar_is_opened_without_a_socket(gpu_lab, page):
    traffic = open_lab(page, gpu_lab)
    status = page.locator(STATUS_ITEM)
    start = time.monotonic()
    wait_for(lambda: re.fullmatch(r"GPU0 SM 92% · \d+/80 GB \+7", status.inner_text()), 20,
             f"the status bar did not show the GPUs with the sidebar closed: {status.inner_text()!r}", page)
    assert "jp-mod-stale" not in status.get_attribute("class")
    assert "Updated every 5 s while the GPU panel is closed" in status.get_attribute("title")
    assert status.get_attribute("aria-label").startswith("GPU status: GPU0 SM 92%")
    page.wait_for_timeout(2000)
    elapsed = time.monotonic() - start
    # Only the small snapshot, about every 5 s; no stream, no history.
    assert traffic["sockets"] == []
    assert traffic["requests"] and all(url.split("?")[0].endswith("/gpuwidget/api/snapshot") and "window=0" in url
                                       for url in traffic["requests"]), traffic["requests"]
    assert len(traffic["requests"]) <= elapsed / 5 + 2, traffic["requests"]


def test_eight_gpus_at_a_glance_folded_cards_and_the_keyboard(gpu_lab, page):
    traffic = open_lab(page, gpu_lab)
    # Keyboard: the status-bar item is a button; Enter on it opens the sidebar.
    page.locator(STATUS_ITEM).focus()
    page.keyboard.press("Enter")
    page.wait_for_selector(PANEL, state="visible", timeout=10_000)
    assert page.locator(PANEL).get_attribute("role") == "region"
    wait_for(lambda: traffic["sockets"], 10, "no stream after opening the sidebar", page)

    rows = page.locator(OVERVIEW_ROWS)
    wait_for(lambda: rows.count() == GPUS and cell(page, GPUS - 1, BUSY_CELL) == "51%", 20,
             "the overview did not show 8 GPUs with their values", page)
    # All eight at a glance, once the sidebar's layout has settled (rows filled can come a frame before
    # the panel's final size: fresh-check run 20 read row 0 as not visible at that instant).
    wait_for(lambda: all(rows.nth(index).is_visible() for index in range(GPUS)), 10,
             "not every GPU's row is visible at a glance", page)
    assert [cell(page, i, GPU_CELL) for i in range(GPUS)] == [f"GPU{i}" for i in range(GPUS)]
    assert [cell(page, i, BUSY_CELL) for i in range(GPUS)] == [f"{u}%" for u in UTIL]
    assert cell(page, 3, MEMORY_CELL) == "35/80 GB"
    powers = [cell(page, i, POWER_CELL) for i in range(GPUS)]
    assert all(re.fullmatch(r"\d+ W", power) for power in powers), powers
    # Who holds each GPU: the notebook whose kernel holds GPU 0, the server's own process on GPU 1.
    wait_for(lambda: cell(page, 0, HOLDER_CELL) == "train.ipynb", 30,
             f"GPU 0's holder is not the notebook: {row(page, 0).inner_text()!r}", page)
    assert cell(page, 1, HOLDER_CELL) not in ("free", "–")
    # No process listed: free where the memory is the driver's idle reserve (0.5 GB), else in use by
    # someone this container cannot see (GPU 4: 100% busy, 71 GB used), never "free".
    assert cell(page, 2, HOLDER_CELL) == "free"
    assert cell(page, 4, HOLDER_CELL) == IN_A_CONTAINER
    assert "71 GB of its memory is in use" in row(page, 4).locator(HOLDER_CELL).get_attribute("title")
    # The cards below start folded, each header saying its values.
    toggles = page.locator(TOGGLES)
    assert toggles.count() == GPUS
    assert {toggles.nth(i).get_attribute("aria-expanded") for i in range(GPUS)} == {"false"}
    assert re.search(r"64% · 35/80 GB", toggles.nth(3).inner_text())

    # Keyboard: Tab from GPU0's button reaches GPU2's; Enter unfolds its card and moves the focus there.
    page.locator(f"{OVERVIEW_ROWS} th button").first.focus()
    for _ in range(6):
        if active(page)["text"] == "GPU2":
            break
        page.keyboard.press("Tab")
    assert active(page)["text"] == "GPU2", active(page)
    focus = active(page)
    assert focus["outline"] != "none" and focus["outlineWidth"] != "0px", focus
    page.keyboard.press("Enter")
    focus = active(page)
    assert "jp-gpuwidget-card-toggle" in focus["cls"] and focus["expanded"] == "true", focus
    assert focus["outline"] != "none", focus
    card = page.locator(".jp-gpuwidget-card[data-device='gpu2']")
    wait_for(lambda: card.locator("canvas").first.is_visible(), 5, "GPU 2's charts did not unfold", page)
    page.keyboard.press("Space")
    assert active(page)["expanded"] == "false"
    assert not card.locator(".jp-gpuwidget-card-body").is_visible()

    # At JupyterLab's default sidebar width the holder reads in full (the power column makes room
    # there); a longer one ends in an ellipsis, every process in the cell's tooltip.
    holder = row(page, 0).locator(HOLDER_CELL)
    shown = holder.locator("button").evaluate(
        "node => ({fits: node.scrollWidth <= node.clientWidth, cut: getComputedStyle(node).textOverflow})")
    assert shown == {"fits": True, "cut": "ellipsis"}, shown
    assert holder.get_attribute("title").startswith("train.ipynb (")
    # README screenshots at a wider sidebar show the power too (below); first this width, for a look:
    # the overview with one card open, light and dark.
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(PANEL).screenshot(path=str(SCREENSHOTS / "sidebar-gpus-narrow.png"))
    # At this width a card's header shows the model's whole name (its readout goes below it if need be).
    title = page.locator(".jp-gpuwidget-card[data-device='gpu0'] .jp-gpuwidget-card-title")
    assert title.inner_text() == "GPU0 · NVIDIA H100 80GB HBM3"
    fits = title.evaluate("node => node.scrollWidth <= node.clientWidth && node.getBoundingClientRect().right"
                          " <= node.closest('.jp-gpuwidget-card').getBoundingClientRect().right")
    assert fits, "the card header cuts the model name"
    widen_sidebar(page)
    assert row(page, 0).locator(POWER_CELL).is_visible()  # the power column is back
    page.locator(".jp-gpuwidget-card[data-device='gpu0'] .jp-gpuwidget-card-toggle").click()
    page.wait_for_timeout(1500)
    page.locator(PANEL).screenshot(path=str(readme_image("sidebar-gpus.png")))
    light = page.evaluate("getComputedStyle(document.querySelector('.jp-gpuwidget-overview-table')).color")
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    wait_for(lambda: page.evaluate("document.body.dataset.jpThemeLight") == "false", 30,
             "the dark theme did not load", page)
    page.wait_for_timeout(1200)
    dark = page.evaluate("getComputedStyle(document.querySelector('.jp-gpuwidget-overview-table')).color")
    assert dark != light
    page.locator(PANEL).screenshot(path=str(readme_image("sidebar-gpus-dark.png")))
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
    problems = [m for m in page.console_messages if m.startswith(("error", "warning")) and "gpuwidget" in m]
    assert not problems, problems
    # No Prometheus configured here: no cluster section, and it was never asked for.
    assert page.locator(".jp-gpuwidget-cluster").is_hidden()
    assert not any("/gpuwidget/api/cluster" in url for url in traffic["requests"]), traffic["requests"]


def test_the_settings_list_every_gpu_chart_by_name(gpu_lab, page):
    open_lab(page, gpu_lab)
    # After the layout is restored: a restore that ends later puts the saved workspace's main area back
    # over an editor opened before it (the likely cause of fresh-check run 29's editor-less page).
    page.evaluate("""async () => {
        await window.jupyterapp.restored;
        await window.jupyterapp.commands.execute('settingeditor:open', {query: 'GPU sidebar'});
    }""")
    title = page.locator("[id='jp-SettingsEditor-jupyterlab-gpuwidget:plugin_metrics-title']")
    wait_for(lambda: title.count() and title.is_visible(), 30, "the settings editor shows no title for the charts",
             page)
    assert title.inner_text().strip() == "GPU charts"
    field = title.locator("xpath=..")
    assert "Remove a row to hide its chart" in field.inner_text()
    # One titled row per chart, all five on screen (the bare multi-select showed four and scrolled PCIe away).
    selects = page.locator("select[id^='jp-SettingsEditor-jupyterlab-gpuwidget:plugin_metrics_']")
    assert selects.count() == 5
    chosen = [select.evaluate("node => node.options[node.selectedIndex].text") for select in selects.all()]
    assert chosen == ["Utilization", "Memory", "Power", "Temperature", "PCIe"]
    for select in selects.all():
        select.scroll_into_view_if_needed()
        assert select.is_visible() and select.evaluate("node => !node.multiple")
    form = field
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    form.screenshot(path=str(SCREENSHOTS / "sidebar-settings.png"))


def _live(page) -> dict[str, str]:
    """What the test watches move: each GPU's power and memory, and the status bar."""
    shown = {f"gpu{i}": cell(page, i, POWER_CELL) + " " + cell(page, i, MEMORY_CELL) for i in range(GPUS)}
    shown["status"] = page.locator(STATUS_ITEM).inner_text()
    return shown


def test_a_gpu_that_stops_answering_goes_stale_and_the_other_seven_and_the_status_bar_go_on(gpu_lab_to_hang, page):
    gpu_lab = gpu_lab_to_hang
    open_lab(page, gpu_lab)
    if not page.locator(PANEL).is_visible():  # the workspace may have kept it open
        page.locator(TAB).click()
    page.wait_for_selector(OVERVIEW_ROWS, timeout=20_000)
    widen_sidebar(page)
    notice = page.locator(".jp-gpuwidget-stalled")
    assert notice.inner_text() == ""
    wait_for(lambda: cell(page, HUNG_GPU, BUSY_CELL) == f"{UTIL[HUNG_GPU]}%", 20, "GPU 5 shows no values", page)
    (gpu_lab.root / "hang-gpu").write_text("")
    shown = notice.locator(".jp-gpuwidget-stalled-text")
    wait_for(lambda: shown.count() and re.fullmatch(rf"⚠ GPU {HUNG_GPU} stopped answering \d+ s ago\.",
                                                    shown.inner_text()), 30,
             "no notice that a GPU stopped answering", page)
    assert notice.get_attribute("role") == "alert"
    assert "until the Jupyter server restarts" in notice.inner_text()
    first = int(re.search(r"(\d+) s ago", shown.inner_text()).group(1))
    wait_for(lambda: int(re.search(r"(\d+) s ago", shown.inner_text()).group(1)) >= first + 2, 10,
             "the stalled notice does not count on", page)

    # GPU 5's row: its last values, greyed, and how long ago it stopped where its holder was.
    hung = row(page, HUNG_GPU)
    wait_for(lambda: "jp-mod-stale" in (hung.get_attribute("class") or ""), 10, "GPU 5's row is not greyed", page)
    assert cell(page, HUNG_GPU, BUSY_CELL) == f"{UTIL[HUNG_GPU]}%"
    assert cell(page, HUNG_GPU, MEMORY_CELL) == f"{MEMORY_GIB[HUNG_GPU]:.0f}/80 GB"
    assert re.fullmatch(r"\d+ W", cell(page, HUNG_GPU, POWER_CELL))
    assert re.fullmatch(r"stopped \d+ s ago", cell(page, HUNG_GPU, HOLDER_CELL))
    assert re.fullmatch(rf"GPU{HUNG_GPU} stopped answering \d+ s ago; "
                        r"its last values \(read \d+ s ago\) are shown, greyed\.",
                        hung.locator(HOLDER_CELL).get_attribute("title"))
    grey = hung.locator(MEMORY_CELL).evaluate("node => getComputedStyle(node).color")
    assert grey != row(page, 3).locator(MEMORY_CELL).evaluate("node => getComputedStyle(node).color")
    assert [i for i in range(GPUS) if "jp-mod-stale" in (row(page, i).get_attribute("class") or "")] == [HUNG_GPU]
    card = page.locator(f".jp-gpuwidget-card[data-device='gpu{HUNG_GPU}']")
    assert "jp-mod-stale" in card.get_attribute("class")
    assert re.fullmatch(rf"SM {UTIL[HUNG_GPU]}% · {MEMORY_GIB[HUNG_GPU]:.0f}/80 GB · stopped \d+ s ago",
                        card.locator(".jp-gpuwidget-card-readout").inner_text())

    # For the next 6 s the other seven rows and the status bar keep moving; GPU 5's values do not.
    status = page.locator(STATUS_ITEM)
    seen = [_live(page)]
    for _ in range(12):
        page.wait_for_timeout(500)
        seen.append(_live(page))
    moved = {key for key in seen[0] if len({shown[key] for shown in seen}) > 1}
    assert moved == {*(f"gpu{i}" for i in range(GPUS) if i != HUNG_GPU), "status"}, seen
    assert all(re.fullmatch(r"GPU0 SM 92% · 6[678]/80 GB \+7 ⚠", shown["status"]) for shown in seen), seen
    assert "jp-mod-stale" not in status.get_attribute("class")
    assert re.search(rf"GPU{HUNG_GPU} stopped answering \d+ s ago", status.get_attribute("aria-label"))
    ages = [int(re.search(r"(\d+) s ago", cell(page, HUNG_GPU, HOLDER_CELL)).group(1))]
    page.wait_for_timeout(2100)
    ages.append(int(re.search(r"(\d+) s ago", cell(page, HUNG_GPU, HOLDER_CELL)).group(1)))
    assert ages[1] >= ages[0] + 2, ages

    # README screenshots: the stalled GPU, light and dark, with GPU 5's card open.
    card.locator(".jp-gpuwidget-card-toggle").click()
    page.wait_for_timeout(1500)
    page.locator(PANEL).screenshot(path=str(readme_image("sidebar-stalled.png")))
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    wait_for(lambda: page.evaluate("document.body.dataset.jpThemeLight") == "false", 30,
             "the dark theme did not load", page)
    page.wait_for_timeout(1200)
    page.locator(PANEL).screenshot(path=str(readme_image("sidebar-stalled-dark.png")))
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    _serve(sys.argv[2:])
