"""The post-run panel as a real ipykernel sends it: after the cell's own output, naming the
exception's type, a syntax error shown as IPython shows one, and a Measure button that needs no
widget (nothing in it breaks once its kernel is gone), served by the call its front-end sends."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from support import cell_messages, gpuwidget_kernel

# Its own kernel, and nothing judged by time (what the panel and the Measure button send): the
# parallel pass takes it (tests/conftest.py, ``untimed``).
pytestmark = [pytest.mark.kernel, pytest.mark.untimed]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MEASURE = "application/vnd.gpuwidget.measure+json"

STARVED_LOADER = """
import time
import torch
from torch.utils.data import DataLoader, Dataset
torch.set_num_threads(1)

class Slow(Dataset):
    def __len__(self):
        return 384  # 24 batches of 64 ms: past the evidence a cause needs (16 steady steps, 1 s)
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
import os
os.environ["GPUWIDGET_MEASURE_BUDGET"] = "4"  # as a server's GpuWidget.measure_budget sets it for its kernels
"""


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    with gpuwidget_kernel() as kc:
        yield kc


def run_cell(kc, code: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    """Execute; return the execute_reply and this cell's iopub messages, in order, until idle."""
    messages = [msg for _, msg in cell_messages(kc, code, timeout)]
    msg_id = messages[-1]["parent_header"]["msg_id"]
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


def measure_offer(messages: list[dict]) -> dict:
    (offer,) = [m for m in messages if m["msg_type"] == "display_data" and MEASURE in m["content"]["data"]]
    return offer


def click_measure(kc, token: str, timeout: float = 60) -> list[dict]:
    """What gpuwidget's front-end sends for a click: the call, silently, outside the history."""
    from gpuwidget.ui.actions import CALL

    return [msg for _, msg in cell_messages(kc, CALL.format(token=token), timeout, silent=True, store_history=False)]


def ending(messages: list[dict]) -> dict:
    (end,) = [m for m in messages if m["msg_type"] == "display_data"
              and "gpuwidget" in m["content"].get("metadata", {})]
    return end


def test_measure_button_is_its_own_output_with_a_fallback_and_no_widget(kernel):
    reply, _ = run_cell(kernel, STARVED_LOADER)
    assert reply["content"]["status"] == "ok"
    _, messages = run_cell(kernel, "%%gpuwatch --no-live\nfor x, y in train_loader:\n    time.sleep(0.001)")
    data = measure_offer(messages)["content"]["data"]
    # Nothing that needs the kernel to be displayed: no widget (no comm opened for it).
    assert WIDGET_VIEW not in data and not [m for m in messages if m["msg_type"] == "comm_open"]
    # What front-ends without gpuwidget's extension (or untrusted) show instead.
    assert "%%gpuwatch --tune" in data["text/plain"] and "%%gpuwatch --tune" in data["text/html"]
    offer = data[MEASURE]
    assert re.fullmatch(r"[0-9a-f]{32}", offer["token"])
    # The kernel's identity as a front-end sees it in the kernel's replies.
    kernel.kernel_info()
    info = kernel.get_shell_msg(timeout=10)
    assert offer["kernel"] == info["header"]["session"]
    # The next cell leaves the button alone (it stays measurable while this kernel runs).
    _, after = run_cell(kernel, "1 + 1")
    assert not [m for m in after if m["msg_type"] == "update_display_data"]


def test_measure_of_a_token_the_kernel_does_not_know_says_so(kernel):
    from gpuwidget.ui.actions import CALL

    # The line gpuwidget's front-end sends (labextension/src/measure.ts measureCode).
    assert CALL.format(token="ab12") == "__import__('gpuwidget.ui.actions', fromlist=['measure']).measure('ab12')"
    messages = click_measure(kernel, "0" * 32)
    end = ending(messages)
    assert end["content"]["metadata"]["gpuwidget"] == {"measure": "gone"}
    assert "needs the kernel that ran this cell" in end["content"]["data"]["text/plain"]
    assert not end["content"].get("transient")
    # Silent: nothing in the history, no execute_input or result for other front-ends to show.
    assert not [m for m in messages if m["msg_type"] in ("execute_input", "execute_result", "error")]


def test_measure_click_shows_progress_then_the_measured_table_under_the_offer(kernel):
    # A dataset long enough for the tuner's trials, a budget short enough for a test.
    reply, _ = run_cell(kernel, STARVED_LOADER + LONG_LOADER)
    assert reply["content"]["status"] == "ok"
    _, messages = run_cell(kernel, "%%gpuwatch --no-live\nfor _, (x, y) in zip(range(24), train_loader):\n"
                                   "    time.sleep(0.001)")
    offer = measure_offer(messages)
    token = offer["content"]["data"][MEASURE]["token"]
    clicked = click_measure(kernel, token)
    # A progress bar without widgets, updated in place, then cleared.
    progress = [m for m in clicked if m["msg_type"] == "display_data"
                and "gpuwidget-tuning" in m["content"]["data"].get("text/html", "")]
    assert progress and not [m for m in clicked if m["msg_type"] == "comm_open"]
    end = ending(clicked)
    assert end["content"]["metadata"]["gpuwidget"] == {"measure": "measured"}
    # Under the offer's display id: the button's own output becomes the table.
    assert end["content"]["transient"]["display_id"] == offer["content"]["transient"]["display_id"]
    data = end["content"]["data"]
    assert "gpuwidget-tune" in data["text/html"] and "num_workers" in data["text/plain"]
    # A second click (another view of the output) gets the same table without measuring again.
    again = ending(click_measure(kernel, token, timeout=10))
    assert again["content"]["data"] == data
    # The loader gone: the button says what to do instead of failing.
    run_cell(kernel, "other_loader = DataLoader(Long(), batch_size=16)")
    _, messages = run_cell(kernel, "%%gpuwatch --no-live\nfor _, (x, y) in zip(range(24), other_loader):\n"
                                   "    time.sleep(0.001)")
    late = measure_offer(messages)["content"]["data"][MEASURE]["token"]
    run_cell(kernel, "del other_loader, x, y; import gc; gc.collect()")
    gone = ending(click_measure(kernel, late))
    assert gone["content"]["metadata"]["gpuwidget"] == {"measure": "gone"}
    assert "loader no longer exists" in gone["content"]["data"]["text/plain"]


def test_an_unfinished_watched_cell_is_incomplete_not_an_error_while_typed(ip):
    # A console asks whether the cell is complete while it is typed: an open bracket is
    # "keep typing", as in any cell, not a syntax error.
    assert ip.input_transformer_manager.check_complete("%%gpuwatch\nx = (\n")[0] == "incomplete"
    result = ip.run_cell("%%gpuwatch --no-live\nx = (\n")
    assert isinstance(result.error_before_exec, SyntaxError) and result.error_in_exec is None
