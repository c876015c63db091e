"""In a real JupyterLab and browser: the GPU sidebar, its status-bar item, and its cost.

(The 8-GPU overview, keyboard use and stalled GPUs over a fake NVML: test_sidebar_gpus.py;
the cluster section over a real Prometheus: test_sidebar_cluster.py.)

This machine has no GPU, so the live part checks the host charts and the "No GPU found"
notice (no NVIDIA or AMD driver) against the real server extension; a synthetic feed of 8 GPUs with an hour
of history then measures how long a redraw takes and checks that a process's notebook
link opens the notebook.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from conftest import SCREENSHOTS, layout_restored, wait_for

pytestmark = pytest.mark.browser

PANEL = ".jp-gpuwidget-sidebar"
TAB = ".jp-SideBar .lm-TabBar-tab[data-id='gpuwidget-sidebar']"
STATUS_ITEM = ".jp-gpuwidget-statusitem"
HOST_CPU_VALUE = ".jp-gpuwidget-card[data-device='host'] [data-chart='host/cpu'] .jp-gpuwidget-chart-value"

# The sidebar widget (its model is public: the test reads it and feeds it).
PANEL_JS = "[...window.jupyterapp.shell.widgets('left')].find(w => w.id === 'gpuwidget-sidebar')"

SERIES_JS = f"""() => {{
  const series = {PANEL_JS}.model.series;
  return {{length: series.length, last: series.lastTime(), cpu: series.latest('cpu.util')}};
}}"""

# 8 GPUs x 5 charts with an hour of history at 1 s, processes on gpu0, then timed redraws.
SYNTHETIC_JS = """async ([notebook, redraws]) => {
  const panel = __PANEL__;
  const model = panel.model;
  // Mute the live feed (this machine's host samples): the synthetic GPUs are the only data.
  const handle = model.handle.bind(model);
  model.handle = () => {};
  const GiB = 1024 ** 3;
  const gpus = 8, points = 3600;
  const now = Date.now() / 1000;
  const devices = {
    gpu_found: true, message: null, interval: 1, history_s: 3600,
    host: {cpu_count: 64, mem_total: 1024 * GiB},
    devices: Array.from({length: gpus}, (_, i) => ({
      id: `gpu${i}`, index: i, uuid: `GPU-${i}`, name: 'NVIDIA H200 (synthetic)',
      memory_total: 141 * GiB, power_limit: 700, is_mig: false, parent_uuid: null,
      pci_bus_id: null}))
  };
  const t = Array.from({length: points}, (_, k) => now - points + k);
  const wave = (k, i, period, lo, hi) => lo + (hi - lo) * (0.5 + 0.5 * Math.sin((k + 97 * i) / period));
  const columns = {'cpu.util': t.map((_, k) => wave(k, 0, 50, 10, 90)),
                   'mem.used': t.map((_, k) => wave(k, 1, 900, 100, 400) * GiB)};
  for (let i = 0; i < gpus; i++) {
    columns[`gpu${i}.util`] = t.map((_, k) => wave(k, i, 20, 0, 100));
    columns[`gpu${i}.mem_used`] = t.map((_, k) => wave(k, i, 600, 20, 130) * GiB);
    columns[`gpu${i}.power`] = t.map((_, k) => wave(k, i, 30, 90, 690));
    columns[`gpu${i}.temperature`] = t.map((_, k) => wave(k, i, 400, 35, 80));
    columns[`gpu${i}.pcie_tx`] = t.map((_, k) => wave(k, i, 15, 0, 8) * GiB);
    columns[`gpu${i}.pcie_rx`] = t.map((_, k) => wave(k, i, 25, 0, 20) * GiB);
  }
  handle({type: 'hello', devices});
  handle({type: 'history', t, columns});
  handle({type: 'processes', t: now, gpus: {gpu0: [
    {pid: 4242, memory: 60 * GiB, user: 'you', name: 'python', kernel_id: 'k', notebook},
    {pid: 99, memory: 20 * GiB, user: 'another user', name: null, kernel_id: null, notebook: null}]}});
  const build0 = performance.now();
  panel.render();
  await Promise.resolve();
  const build = performance.now() - build0;
  // From 4 GPUs on the cards start folded; unfold them all to time the worst case.
  for (const toggle of panel.node.querySelectorAll('.jp-gpuwidget-card-toggle[aria-expanded="false"]')) {
    toggle.click();
  }
  const frame = () => new Promise(resolve => requestAnimationFrame(resolve));
  await frame();
  const script = [], frames = [];
  for (let n = 0; n < redraws; n++) {
    const values = {};
    for (const name of Object.keys(columns)) { values[name] = columns[name][n]; }
    handle({type: 'sample', t: now + n + 1, values});
    const start = performance.now();
    panel.render();
    await Promise.resolve();  // uPlot draws in a microtask after setData
    script.push(performance.now() - start);
    await frame();
    frames.push(performance.now() - start);
  }
  const charts = panel.node.querySelectorAll('.jp-gpuwidget-chart canvas').length;
  return {charts, points: model.series.length, build, script, frames};
}""".replace("__PANEL__", PANEL_JS)


def open_lab(page, lab, sockets: list | None = None) -> list[str]:
    """Load JupyterLab; return the list that collects every gpuwidget API request and socket URL
    (the sockets themselves go to `sockets`)."""
    traffic: list[str] = []

    def on_socket(ws) -> None:
        if "/gpuwidget/api/" in ws.url:
            traffic.append(ws.url)
            if sockets is not None:
                sockets.append(ws)

    page.on("request", lambda request: "/gpuwidget/api/" in request.url and traffic.append(request.url))
    page.on("websocket", on_socket)
    page.goto(lab.page_url("lab") + "&reset")  # the sidebar closed, whatever an earlier test left open
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_selector(STATUS_ITEM, timeout=60_000)
    page.wait_for_selector(TAB, timeout=30_000)
    layout_restored(page)
    return traffic


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def is_snapshot_poll(url: str) -> bool:
    return url.split("?")[0].endswith("/gpuwidget/api/snapshot") and "window=0" in url


def test_sidebar_shows_the_host_and_says_no_gpu_and_only_polls_a_snapshot_when_closed(lab, page):
    sockets: list = []
    traffic = open_lab(page, lab, sockets)
    # Closed: the status bar is current from the start, from a small snapshot every 5 s (no socket).
    status = page.locator(STATUS_ITEM)
    wait_for(lambda: re.fullmatch(r"No GPU · CPU \d+%", status.inner_text()), 15,
             f"status bar reads {status.inner_text()!r} with the panel closed", page)
    assert "jp-mod-stale" not in status.get_attribute("class")
    assert sockets == []
    assert traffic and all(is_snapshot_poll(url) for url in traffic), traffic

    page.locator(TAB).click()
    notice = page.wait_for_selector(".jp-gpuwidget-notice", state="visible", timeout=30_000)
    wait_for(lambda: notice.inner_text().startswith("No GPU found"), 30, "no 'No GPU found' notice", page)
    # The server's reason is shown too (here: neither vendor's driver).
    reason = notice.query_selector(".jp-gpuwidget-reason")
    assert reason is not None and "no NVIDIA or AMD GPU driver" in reason.inner_text()
    # Host charts only; no GPU card, no empty GPU chart.
    assert page.locator(".jp-gpuwidget-card").count() == 1
    assert page.locator(".jp-gpuwidget-card[data-device='host'] canvas").count() == 2

    # Host CPU values arrive and keep arriving.
    wait_for(lambda: re.fullmatch(r"\d+%", page.locator(HOST_CPU_VALUE).inner_text()), 30,
             "no host CPU reading in the sidebar", page)
    first = page.evaluate(SERIES_JS)
    page.wait_for_timeout(3500)
    later = page.evaluate(SERIES_JS)
    assert later["last"] >= first["last"] + 2, f"no new samples in 3.5 s: {first} -> {later}"
    assert later["length"] > first["length"]
    assert any("/gpuwidget/api/devices" in url for url in traffic)
    assert any("/gpuwidget/api/stream?interval=" in url for url in traffic)

    # The status bar follows the live values.
    wait_for(lambda: re.fullmatch(r"No GPU · CPU \d+%", status.inner_text()), 10,
             f"status bar reads {status.inner_text()!r}", page)
    assert "jp-mod-stale" not in status.get_attribute("class")
    assert "no GPU found" in status.get_attribute("title")

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "sidebar.png"))

    # Closed again: the socket goes (after a 2 s grace), and only the snapshot poll follows.
    assert len(sockets) == 1
    page.locator(TAB).click()
    page.wait_for_selector(PANEL, state="hidden", timeout=10_000)
    wait_for(lambda: sockets[0].is_closed(), 10, "the stream socket stayed open with the panel closed", page)
    seen = len(traffic)
    page.wait_for_timeout(5500)
    assert 1 <= len(traffic) - seen <= 2 and all(is_snapshot_poll(url) for url in traffic[seen:]), traffic[seen:]
    assert len(sockets) == 1
    assert "jp-mod-stale" not in status.get_attribute("class")
    status.hover()
    assert "Updated every 5 s while the GPU panel is closed" in status.get_attribute("title")
    assert page.evaluate(f"{PANEL_JS}.model.connection.kind") == "polling"

    problems = [m for m in page.console_messages if m.startswith(("error", "warning")) and "gpuwidget" in m]
    assert not problems, problems


def test_settings_schema_is_served(lab):
    """The schema (labextension/schema/plugin.json) reached JupyterLab's settings service."""
    with urllib.request.urlopen(f"{lab.url}lab/api/settings/jupyterlab-gpuwidget:plugin?token={lab.token}") as reply:
        settings = json.load(reply)
    properties = settings["schema"]["properties"]
    assert properties["interval"]["default"] == 1
    assert properties["metrics"]["default"] == ["utilization", "memory", "power", "temperature", "pcie"]
    assert properties["statusInterval"]["default"] == 5


def test_eight_gpus_with_an_hour_of_history_redraw_within_a_frame_budget(lab, page):
    open_lab(page, lab)
    page.locator(TAB).click()
    page.wait_for_selector(".jp-gpuwidget-card[data-device='host']", timeout=30_000)
    # The host card may come from the status bar's snapshot poll: wait for the stream itself, or its
    # /devices reply would land after the synthetic GPUs and replace them.
    wait_for(lambda: page.evaluate(f"{PANEL_JS}.model.connection.kind") == "live", 30,
             "the sidebar's stream did not connect", page)

    result = page.evaluate(SYNTHETIC_JS, ["watch_live.ipynb", 30])
    assert result["charts"] == 8 * 5 + 2
    assert result["points"] >= 3600
    script_ms, frame_ms = median(result["script"]), median(result["frames"])
    report = {
        "charts": result["charts"],
        "points_per_series": result["points"],
        "first_build_ms": round(result["build"], 1),
        "redraw_script_ms_median": round(script_ms, 1),
        "redraw_script_ms_max": round(max(result["script"]), 1),
        "redraw_to_next_frame_ms_median": round(frame_ms, 1),
    }
    print("sidebar redraw, 8 GPUs x 5 charts x 3600 points:", json.dumps(report))
    (SCREENSHOTS.parent).mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS.parent / "sidebar-perf.json").write_text(json.dumps(report, indent=2) + "\n")
    # One redraw per second must leave the page responsive: well under a second, on any machine.
    assert script_ms < 250, report

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "sidebar-gpus.png"))

    # Another user's process shows only its memory; ours links to its notebook, which opens.
    rows = page.locator(".jp-gpuwidget-card[data-device='gpu0'] .jp-gpuwidget-process-table tbody tr")
    assert rows.count() == 2
    assert rows.nth(1).inner_text().split("\t")[:2] == ["–", "another user"]
    page.locator(".jp-gpuwidget-card[data-device='gpu0'] .jp-gpuwidget-notebook-link").click()
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden)", timeout=60_000)
    wait_for(lambda: page.evaluate("window.jupyterapp.shell.currentWidget?.context?.path") == "watch_live.ipynb",
             30, "the notebook link did not open watch_live.ipynb", page)

    # The dark theme: the sidebar's colours come from the theme.
    light_background = page.evaluate(
        "getComputedStyle(document.querySelector('.jp-gpuwidget-card')).backgroundColor")
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    wait_for(lambda: page.evaluate("document.body.dataset.jpThemeLight") == "false", 30,
             "the dark theme did not load", page)
    page.wait_for_timeout(1000)
    dark_background = page.evaluate(
        "getComputedStyle(document.querySelector('.jp-gpuwidget-card')).backgroundColor")
    assert dark_background != light_background
    page.screenshot(path=str(SCREENSHOTS / "sidebar-dark.png"))
    page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
