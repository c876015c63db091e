"""The post-run panel as a real ipykernel sends it: after the cell's own output, naming the
exception's type, a syntax error shown as IPython shows one, and a Measure button that leaves
nothing behind that breaks once its widgets are gone."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.kernel

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

STARVED_LOADER = """
import time
import torch
from torch.utils.data import DataLoader, Dataset
torch.set_num_threads(1)

class Slow(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.zeros(8), 0

train_ds = Slow()
train_loader = DataLoader(train_ds, batch_size=16)
"""

LONG_LOADER = """
class Long(Slow):
    def __len__(self):
        return 4000

train_loader = DataLoader(Long(), batch_size=16)
import gpuwidget.measure.tuner as tuner
tuner.DEFAULT_BUDGET_S = 3.0
"""


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        reply = kc.execute_interactive("%load_ext gpuwidget", timeout=60)
        assert reply["content"]["status"] == "ok"
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run_cell(kc, code: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    """Execute; return the execute_reply and this cell's iopub messages, in order, until idle."""
    msg_id = kc.execute(code)
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply, messages


def panel_index(messages: list[dict]) -> int:
    (index,) = [n for n, m in enumerate(messages) if m["msg_type"] == "display_data"
                and "gpuwidget-run" in m["content"]["data"].get("text/html", "")]
    return index


def test_panel_comes_after_what_the_cell_printed(kernel):
    # With the live view (shown first, at the top) and without it: the panel is the last output.
    for line in ("%%gpuwatch --interval 0.05", "%%gpuwatch --no-live"):
        _, messages = run_cell(kernel, f"{line}\nimport sys, time\nprint('epoch 1 done')\n"
                                       "print('a warning', file=sys.stderr)\ntime.sleep(0.3)")
        streams = [n for n, m in enumerate(messages) if m["msg_type"] == "stream"]
        text = "".join(messages[n]["content"]["text"] for n in streams)
        assert "epoch 1 done" in text and "a warning" in text
        assert max(streams) < panel_index(messages), line


def test_panel_names_the_exception_type(kernel):
    reply, messages = run_cell(kernel, "%%gpuwatch --no-live\nraise ValueError('loss went NaN')")
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "ValueError"
    data = messages[panel_index(messages)]["content"]["data"]
    assert "ended with ValueError: loss went NaN" in data["text/plain"]
    assert "ended with ValueError: loss went NaN" in data["text/html"]


def test_syntax_error_in_a_watched_cell_is_shown_like_any_syntax_error(kernel):
    reply, messages = run_cell(kernel, "%%gpuwatch --no-live\nx = 1\ny = (x +\n")
    (error,) = [m for m in messages if m["msg_type"] == "error"]
    assert error["content"]["ename"] == "SyntaxError"
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["content"]["traceback"]))
    # IPython's own snippet: the cell and its line (line 1 is the magic), no frames of anyone's.
    assert "Cell In[" in shown and "line 3" in shown and "y = (x +" in shown
    for frame in ("gpuwidget", "magic.py", "interactiveshell.py", "Traceback"):
        assert frame not in shown
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "SyntaxError"
    # Nothing was watched: no panel, and the next watch starts normally.
    assert not any("gpuwidget-run" in m["content"].get("data", {}).get("text/html", "") for m in messages)
    reply, _ = run_cell(kernel, "%%gpuwatch --no-live\npass")
    assert reply["content"]["status"] == "ok"


def test_measure_button_has_a_fallback_and_is_replaced_when_the_next_cell_runs(kernel):
    reply, _ = run_cell(kernel, STARVED_LOADER)
    assert reply["content"]["status"] == "ok"
    _, messages = run_cell(kernel, "%%gpuwatch --no-live\nfor x, y in train_loader:\n    time.sleep(0.001)")
    (offer,) = [m for m in messages if m["msg_type"] == "display_data" and WIDGET_VIEW in m["content"]["data"]]
    data = offer["content"]["data"]
    # What a front-end without the widget (sanitized, or no widget manager) shows instead.
    assert "%%gpuwatch --tune" in data["text/plain"] and "%%gpuwatch --tune" in data["text/html"]
    display_id = offer["content"]["transient"]["display_id"]
    opened = {m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"}

    _, after = run_cell(kernel, "1 + 1")
    (replaced,) = [m for m in after if m["msg_type"] == "update_display_data"
                   and m["content"]["transient"]["display_id"] == display_id]
    assert WIDGET_VIEW not in replaced["content"]["data"]
    assert "run that cell again with %%gpuwatch --tune" in replaced["content"]["data"]["text/plain"]
    closed = {m["content"]["comm_id"] for m in after if m["msg_type"] == "comm_close"}
    assert opened and opened <= closed
    # Only once: a later cell sends nothing for it.
    _, later = run_cell(kernel, "2 + 2")
    assert not [m for m in later if m["msg_type"] == "update_display_data"]


def test_measure_click_replaces_the_button_with_the_measured_table(kernel):
    # A dataset long enough for the tuner's trials, a budget short enough for a test.
    reply, _ = run_cell(kernel, STARVED_LOADER + LONG_LOADER)
    assert reply["content"]["status"] == "ok"
    _, messages = run_cell(kernel, "%%gpuwatch --no-live\nfor _, (x, y) in zip(range(6), train_loader):\n"
                                   "    time.sleep(0.001)")
    (offer,) = [m for m in messages if m["msg_type"] == "display_data" and WIDGET_VIEW in m["content"]["data"]]
    (button,) = [m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"
                 and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"]
    # A click, as the front-end sends it once the cell is done.
    click = kernel.session.msg("comm_msg", {"comm_id": button, "data": {"method": "custom",
                                                                          "content": {"event": "click"}}})
    kernel.shell_channel.send(click)
    replaced = None
    while replaced is None:
        msg = kernel.get_iopub_msg(timeout=60)
        if (msg["msg_type"] == "update_display_data"
                and msg["content"]["transient"]["display_id"] == offer["content"]["transient"]["display_id"]):
            replaced = msg
    data = replaced["content"]["data"]
    assert WIDGET_VIEW not in data and "gpuwidget-tune" in data["text/html"]
    assert "num_workers" in data["text/plain"]
    # Nothing is left for the next cell to retire.
    _, after = run_cell(kernel, "3 + 3")
    assert not [m for m in after if m["msg_type"] == "update_display_data"]


def test_an_unfinished_watched_cell_is_incomplete_not_an_error_while_typed(ip):
    # A console asks whether the cell is complete while it is typed: an open bracket is
    # "keep typing", as in any cell, not a syntax error.
    assert ip.input_transformer_manager.check_complete("%%gpuwatch\nx = (\n")[0] == "incomplete"
    result = ip.run_cell("%%gpuwatch --no-live\nx = (\n")
    assert isinstance(result.error_before_exec, SyntaxError) and result.error_in_exec is None
