"""The Measure button under the post-run panel: time the suggested DataLoader settings on the user's loader.

The button is an output of its own MIME type (:data:`MIME`), not a widget: gpuwidget's JupyterLab
extension renders it (labextension/src/measure.ts) as a button that, when clicked, runs
:func:`measure` on the notebook's kernel with the offer's token and shows what it displays. The
measured table then replaces the button in the notebook (the kernel shows it under the offer's
display id, and the front-end writes it into the output), so a saved notebook keeps it.

Nothing in the output needs the kernel to be displayed: reopened after that kernel is gone, the
extension shows a note instead of the button, and front-ends without the extension (VS Code, Colab,
nbconvert, an untrusted notebook) show the text/HTML fallback. (A widget lives only as long as its
kernel: a saved notebook reopened later has no model behind a widget's output, and JupyterLab
shows "Error displaying widget: model not found" there.)
"""

from __future__ import annotations

import html
import secrets
import weakref
from collections import OrderedDict
from typing import Any

MIME = "application/vnd.gpuwidget.measure+json"
# What a front-end sends to serve a click (labextension/src/measure.ts builds the same line).
CALL = "__import__('gpuwidget.ui.actions', fromlist=['measure']).measure({token!r})"
# Offers the kernel still serves, newest last: each holds its run (the button of an older cell
# says so when clicked, as one of a gone kernel does).
MAX_OFFERS = 8

FALLBACK_NOTE = ("To measure the suggested DataLoader settings, run this cell again with %%gpuwatch --tune "
                 "(in JupyterLab with gpuwidget's extension, a Measure button shows here while the kernel "
                 "that ran the cell is running).")
GONE_NOTE = ("Measure needs the kernel that ran this cell: run it again, or run it with %%gpuwatch --tune.")
LOADER_GONE_NOTE = "The loader no longer exists: run the watched cell again to measure its settings."

_offers: OrderedDict[str, MeasureOffer] = OrderedDict()


def _note_bundle(text: str) -> dict[str, str]:
    return {"text/plain": text,
            "text/html": f"<div class='gpuwidget-measure-note' style='font-size:12px;margin:2px 0'>"
                         f"{html.escape(text)}</div>"}


def kernel_session() -> str:
    """This kernel's message-session id (new with every kernel process): a front-end tells from it
    whether the kernel it talks to is the one that showed a button. Empty outside a kernel."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    session = getattr(getattr(kernel, "session", None), "session", "")
    return session if isinstance(session, str) else ""


class MeasureOffer:
    """The Measure button for one run, shown with ``display()``; served by :func:`measure`."""

    def __init__(self, run: Any, loader: Any) -> None:
        self.run = run
        self.token = secrets.token_hex(16)
        self.display_id = f"gpuwidget-measure-{self.token}"
        self._loader = weakref.ref(loader)

    def bundle(self) -> dict[str, Any]:
        label = getattr(self.run, "label", "") or "the watched cell"
        offer = {"version": 1, "token": self.token, "display_id": self.display_id,
                 "kernel": kernel_session(), "label": label}
        return {MIME: offer, **_note_bundle(FALLBACK_NOTE)}

    def _ipython_display_(self) -> None:
        from IPython.display import publish_display_data

        _offers[self.token] = self
        while len(_offers) > MAX_OFFERS:
            _offers.popitem(last=False)
        publish_display_data(self.bundle(), transient={"display_id": self.display_id})

    def measure(self) -> tuple[str, dict[str, Any]]:
        """Tune the loader; ``(status, bundle)``: ``measured`` (the table), ``failed`` (why; a click
        may try again) or ``gone`` (nothing left to measure)."""
        from gpuwidget.measure.tuner import DEFAULT_BUDGET_S, tune_for_run
        from gpuwidget.ui.progress import tuning_progress

        if getattr(self.run, "tuning", None) is not None:  # measured already (a second view's click)
            return "measured", self.run.tuning._repr_mimebundle_()
        loader = self._loader()
        if loader is None:
            return "gone", _note_bundle(LOADER_GONE_NOTE)
        try:
            with tuning_progress(DEFAULT_BUDGET_S, show=True, widgets=False) as progress:
                self.run.tuning = tune_for_run(self.run, loader, DEFAULT_BUDGET_S, progress)
            return "measured", self.run.tuning._repr_mimebundle_()
        except Exception as exc:  # noqa: BLE001 - shown to the user, who may try again
            return "failed", _note_bundle(f"Could not measure: {exc}")


def measure(token: str) -> None:
    """Serve a click on the Measure button ``token`` names (front-ends run :data:`CALL`).

    Displays the progress and then one output whose metadata says how it ended
    (``{"gpuwidget": {"measure": status}}``); the measured table goes out under the offer's
    display id, so the button's own output becomes the table wherever the front-end tracks it.
    """
    from IPython.display import publish_display_data

    offer = _offers.get(token)
    status, bundle = ("gone", _note_bundle(GONE_NOTE)) if offer is None else offer.measure()
    transient = {"display_id": offer.display_id} if offer is not None and status == "measured" else {}
    if status == "gone":
        _offers.pop(token, None)
    publish_display_data(bundle, metadata={"gpuwidget": {"measure": status}}, transient=transient)


def measure_button(run: Any, loader: Any) -> MeasureOffer:
    """A Measure button that runs the tuner for ``loader`` against ``run``'s measurements."""
    return MeasureOffer(run, loader)
