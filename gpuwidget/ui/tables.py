"""Small tables rendered twice, as aligned plain text and as HTML, for results that show themselves."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns as wide as their widest cell."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [headers, *rows]]


def html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], bold: Sequence[bool] = ()) -> str:
    """An HTML table; rows whose ``bold`` flag is set are emphasised."""
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr" + (" style='font-weight:600'" if i < len(bold) and bold[i] else "") + ">"
        + "".join(f"<td style='padding:2px 10px'>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for i, row in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
