"""The panel's HTML survives what notebooks do to it: parsed strictly, sanitized, themed dark,
read by a screen reader. (The browser test in tests/ui/test_panel.py shows it for real.)"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import unquote

from test_run import gpu_run

from gpuwidget import Finding
from gpuwidget.report import SEVERITY_LABEL, chart_svg, finding_html, run_html

# Every attribute the panel writes. A stray name here means an attribute value broke its quotes
# (a font list "'Segoe UI'" inside style='...' once turned the panel's style into junk attributes).
ATTRIBUTES = {"class", "style", "role", "aria-label", "aria-live", "aria-hidden", "aria-level", "data-gpuwidget",
              "data-outcome", "data-rule", "data-severity", "data-copy", "type", "onclick", "src", "alt", "width",
              "height", "title"}


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def tags(markup: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = Tags()
    parser.feed(markup)
    return parser.tags


def test_every_attribute_parses_as_written():
    for markup in (run_html(gpu_run()), run_html(gpu_run(ValueError("it's <bad> & 'quoted'")))):
        found = tags(markup)
        assert found
        for tag, attrs in found:
            assert set(attrs) <= ATTRIBUTES, (tag, attrs)


def test_chart_is_an_image_a_sanitizer_keeps_with_labels_apart():
    markup = run_html(gpu_run())
    assert "<svg" not in markup  # inline SVG is stripped untrusted, its text nodes left to run together
    (image,) = [attrs for tag, attrs in tags(markup) if tag == "img"]
    assert image["src"].startswith("data:image/svg+xml,")
    svg = unquote(image["src"].split(",", 1)[1])
    assert svg == chart_svg(gpu_run())
    # Each axis label its own element, the time labels at the plot's ends and middle.
    labels = re.findall(r"<text [^>]*>([^<]*)</text>", svg)
    assert labels[:3] == ["0%", "50%", "100%"] and labels[3:] == ["0.0 s", "2.5 s", "4.9 s"]
    # What the image shows, in words, and a legend as text beside it.
    assert "GPU0 kernel running (nvidia-smi) mean 81%" in image["alt"] and "CPU (all cores) mean 30%" in image["alt"]
    assert re.search(r"GPU0 memory</span>.*CPU \(all cores\)</span>.*waiting for data</span>", markup)


def test_copy_button_sits_above_the_code_and_shows_only_where_it_can_work():
    markup = run_html(gpu_run())
    found = tags(markup)
    names = [tag for tag, _ in found]
    button = names.index("button")
    assert names.index("pre", button) > button  # above the code, not inside or over it
    attrs = found[button][1]
    assert attrs["style"] == "display:none" and attrs["data-copy"] == "code"
    assert attrs["aria-label"] and "navigator.clipboard.writeText" in (attrs["onclick"] or "")
    # Revealed by the panel's own stylesheet only while it keeps data-copy (sanitizers drop both).
    style = markup[markup.index("<style>"):markup.index("</style>")]
    assert ".gpuwidget-copy[data-copy]{display:inline-block!important" in style
    (live,) = [a for tag, a in found if a.get("class") == "gpuwidget-copied"]
    assert live["role"] == "status" and live["aria-live"] == "polite"


def test_stylesheet_touches_only_the_panel_and_code_follows_the_theme():
    markup = run_html(gpu_run())
    style = markup[markup.index("<style>") + 7:markup.index("</style>")]
    for rule in re.findall(r"([^{}]+)\{", style):
        assert rule.strip().startswith("[data-gpuwidget] "), rule
    found = tags(markup)
    (code_style,) = [found[n + 1][1]["style"] for n, (tag, _) in enumerate(found) if tag == "pre"]
    # The code's own background would show as stripes over the block's in a dark theme.
    assert "background:transparent" in code_style and "color:inherit" in code_style
    # No fixed dark text colour on the panel: it inherits the front-end's.
    (section,) = [a for tag, a in tags(markup) if tag == "section"]
    assert not re.search(r"(^|;)color:", section["style"] or "")
    assert section["role"] == "region" and section["aria-label"].startswith("gpuwidget report: In [7] finished")


def test_severity_is_told_in_words_not_only_colour():
    for severity, word in SEVERITY_LABEL.items():
        finding = Finding(rule="small-batch", severity=severity, title="Batches are small", evidence={},
                          suggestion="", change={}, code="", expected_speedup=None)
        markup = finding_html(finding)
        badge = re.search(r"class='gpuwidget-severity'[^>]*><span aria-hidden='true'>(.)</span> ([a-z]+)</span>",
                          markup)
        assert badge is not None and badge.group(2) == word  # an icon, then the word
        assert f"data-severity='{severity}'" in markup
        # Shown on its own, a finding is a card with the panel's stylesheet, not a run's panel.
        assert "class='gpuwidget-card'" in markup and "gpuwidget-run" not in markup


def test_status_names_the_exception_type():
    markup = run_html(gpu_run(ValueError("loss went NaN")))
    assert "ended with ValueError: loss went NaN" in markup
    assert "ended with ValueError: loss went NaN" in gpu_run(ValueError("loss went NaN"))._repr_mimebundle_()[
        "text/plain"]


def test_every_themed_style_has_a_literal_a_sanitizer_keeps():
    # Sanitizers drop declarations with var(): each one follows a literal copy of itself, so an
    # untrusted notebook keeps the panel's border, muted text and code background.
    for tag, attrs in tags(run_html(gpu_run())):
        declarations = [d.split(":", 1) for d in (attrs.get("style") or "").split(";") if ":" in d]
        for n, (prop, value) in enumerate(declarations):
            if "var(" in value and prop != "font-family":  # the font falls back to the page's anyway
                assert n and declarations[n - 1][0] == prop and "var(" not in declarations[n - 1][1], (tag, attrs)
