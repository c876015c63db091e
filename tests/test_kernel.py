"""%%gpuwatch in a real ipykernel: live updates leave the kernel while the cell is still busy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support import cell_messages as run_cell
from support import gpuwidget_kernel, warmed_up

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    with gpuwidget_kernel() as kc:
        warmed_up(kc)
        yield kc


def of_type(messages, msg_type):
    return [(t, m) for t, m in messages if m["msg_type"] == msg_type]


def test_live_updates_arrive_while_the_cell_runs_then_the_report_replaces_them(kernel):
    cell_seconds = 2.0
    messages = run_cell(kernel, f"%%gpuwatch --interval 0.1\nimport time\ntime.sleep({cell_seconds})\n'done'")
    updates = [t for t, m in of_type(messages, "comm_msg")
               if m["content"]["data"].get("method") in ("custom", "update")]
    idle_at = messages[-1][0]
    # Updates start early and keep coming while the cell sleeps, not in one burst at the end. The
    # first within a second of the cell's start (0.3-0.45 s at a load of 5-7 on this 2-core VM):
    # the watch's own start-up, the live view's imports done by the extension's warm-up.
    assert updates and updates[0] < 1.0, updates[:3]
    during = [t for t in updates if t < idle_at - 0.3]
    assert len({round(t, 1) for t in during}) >= 4
    assert max(during) - min(during) >= 1.0
    # The live widget is shown in the BokehJS loader's own output (which ran its script first); at the
    # end that one output becomes the report: no emptied output stays in the saved notebook.
    (loader,) = [m for _, m in of_type(messages, "display_data") if "application/javascript" in m["content"]["data"]]
    display_id = loader["content"]["transient"]["display_id"]
    updates = [m["content"] for _, m in of_type(messages, "update_display_data")]
    assert [u["transient"]["display_id"] for u in updates] == [display_id, display_id]
    assert "application/vnd.jupyter.widget-view+json" in updates[0]["data"]
    report = {"content": updates[1]}
    assert "gpuwidget-run" in report["content"]["data"]["text/html"]
    assert not [m for _, m in of_type(messages, "display_data") if m is not loader]
    assert "no GPU found" in report["content"]["data"]["text/plain"]
    # The report names the cell by the number the notebook shows.
    (executed,) = [m for _, m in of_type(messages, "execute_input")]
    assert f"In [{executed['content']['execution_count']}] finished" in report["content"]["data"]["text/plain"]
    (result,) = [m for _, m in of_type(messages, "execute_result")]
    assert result["content"]["data"]["text/plain"] == "'done'"
    # Every widget the live view opened is closed again.
    opened = {m["content"]["comm_id"] for _, m in of_type(messages, "comm_open")}
    closed = {m["content"]["comm_id"] for _, m in of_type(messages, "comm_close")}
    assert opened and opened <= closed


def test_bokehjs_goes_inline_once_per_kernel_then_only_a_small_reload_guard(kernel):
    # The module's kernel has already watched a cell in the first test: BokehJS went inline there.
    first = run_cell(kernel, "%%gpuwatch\npass")
    second = run_cell(kernel, "%%gpuwatch\npass")
    scripts = [m for _, m in of_type(first + second, "display_data")
               if "application/javascript" in m["content"]["data"]]
    assert len(scripts) == 2
    for message in scripts:
        assert message["content"]["metadata"]["gpuwidget"]["loader"] == "server"
        code = message["content"]["data"]["application/javascript"]
        # A few hundred bytes asking this Jupyter server, never a CDN (plus the live plot's page
        # side, gpuwidget.ui.live.CLIENT_JS, about 1.1 kB).
        assert len(code) < 4000
        assert "http" not in code and "gpuwidget/static/bokeh-" in code


def test_first_watch_in_a_fresh_kernel_sends_bokehjs_inline():
    with gpuwidget_kernel() as kc:
        messages = run_cell(kc, "%%gpuwatch\npass")
    (script,) = [m for _, m in of_type(messages, "display_data") if "application/javascript" in m["content"]["data"]]
    assert script["content"]["metadata"]["gpuwidget"]["loader"] == "inline"
    code = script["content"]["data"]["application/javascript"]
    assert "cdn.bokeh.org" not in code and len(code) > 500_000


def test_exception_in_a_kernel_cell_shows_one_traceback(kernel):
    messages = run_cell(kernel, "%%gpuwatch --no-live\nraise ValueError('bad batch')")
    errors = of_type(messages, "error")
    assert len(errors) == 1
    assert errors[0][1]["content"]["ename"] == "ValueError"
    assert errors[0][1]["content"]["evalue"] == "bad batch"
