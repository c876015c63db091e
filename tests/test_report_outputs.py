"""What a watched cell leaves in the notebook, as a front-end builds its outputs from a real kernel's
messages: its panel and its own outputs, in order, and no empty output (nbformat keeps an emptied
display as an empty ``display_data``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support import cell_messages, gpuwidget_kernel

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    with gpuwidget_kernel() as kc:
        yield kc


def outputs(kc, code: str) -> list[dict]:
    """The cell's outputs as JupyterLab and nbclient keep them: displays appended, updates in place by
    display id, text merged per stream, cleared on clear_output."""
    kept: list[dict] = []
    for _, msg in cell_messages(kc, code, timeout=90):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "clear_output":
            kept.clear()
        elif kind == "stream":
            if kept and kept[-1].get("name") == content["name"]:
                kept[-1]["text"] += content["text"]
            else:
                kept.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
        elif kind in ("display_data", "execute_result"):
            kept.append({"output_type": kind, "data": content["data"],
                         "display_id": (content.get("transient") or {}).get("display_id")})
        elif kind == "update_display_data":
            for output in kept:
                if output.get("display_id") == content["transient"]["display_id"]:
                    output["data"] = content["data"]
    return kept


def described(kept: list[dict]) -> list[str]:
    """Each output as one word: "panel", "empty", "text:<stream>", "result", or its first MIME type."""
    words = []
    for output in kept:
        data = output.get("data") or {}
        if output["output_type"] == "stream":
            words.append(f"text:{output['name']}")
        elif "gpuwidget-run" in data.get("text/html", ""):
            words.append("panel")
        elif output["output_type"] == "execute_result":
            words.append("result")
        elif not any(value for value in data.values()):
            words.append("empty")
        elif "<b>mine</b>" in data.get("text/html", ""):
            words.append("mine")
        else:
            words.append(next(iter(data)))
    return words


def test_a_watched_cell_that_prints_nothing_leaves_only_its_panel(kernel):
    assert described(outputs(kernel, "%%gpuwatch --interval 0.05\nimport time\ntime.sleep(0.3)")) == ["panel"]


def test_a_watched_cell_keeps_its_printed_text_in_order_and_the_panel_after_it(kernel):
    kept = outputs(kernel, "%%gpuwatch --interval 0.05\nimport sys, time\nprint('epoch 1 done')\n"
                           "print('a warning', file=sys.stderr)\ntime.sleep(0.2)\nprint('epoch 2 done')\n42")
    assert described(kept) == ["text:stdout", "text:stderr", "text:stdout", "panel", "result"]
    assert [o["text"] for o in kept[:3]] == ["epoch 1 done\n", "a warning\n", "epoch 2 done\n"]


def test_a_watched_cell_with_a_display_of_its_own_keeps_it_and_the_panel(kernel):
    kept = outputs(kernel, "%%gpuwatch --interval 0.05\nfrom IPython.display import display, HTML\n"
                           "display(HTML('<b>mine</b>'))\nimport time\ntime.sleep(0.2)")
    words = described(kept)
    # The user's own display is never re-created: the live view's output is emptied instead (one
    # empty output, before theirs), and the panel comes last.
    assert words[-1] == "panel" and words.count("mine") == 1 and words.count("empty") <= 1, words
