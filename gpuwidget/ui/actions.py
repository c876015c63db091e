"""The Measure button under the post-run panel: every finding's change measured in the cell's own loop.

A click runs gpuwidget.measure.plan (the DataLoader tuner on the cell's loader, each finding's change
tried in its training step with ``Run.measure``, then the best set together) within the time the
offer announces (``budget_s`` in the offer; :func:`~gpuwidget.measure.plan.plan_budget`).

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
from typing import Any, TypedDict

MIME = "application/vnd.gpuwidget.measure+json"
# What a front-end sends to serve a click (labextension/src/measure.ts builds the same line).
CALL = "__import__('gpuwidget.ui.actions', fromlist=['measure']).measure({token!r})"
# Offers the kernel still serves, newest last: each holds its run (the button of an older cell
# says so when clicked, as one of a gone kernel does).
MAX_OFFERS = 8

FALLBACK_NOTE = ("To measure the suggested changes, run this cell again with %%gpuwatch --tune "
                 "(in JupyterLab with gpuwidget's extension, a Measure button shows here while the kernel "
                 "that ran the cell is running).")
GONE_NOTE = ("Measure needs the kernel that ran this cell: run it again, or run it with %%gpuwatch --tune.")
LOADER_GONE_NOTE = "The loader no longer exists: run the watched cell again to measure its settings."
MODEL_GONE_NOTE = "The trained model no longer exists: run the watched cell again to measure its changes."

_offers: OrderedDict[str, MeasureOffer] = OrderedDict()


class OfferData(TypedDict):
    """The button's output under :data:`MIME` (labextension/src/measure.ts ``parseOffer`` reads it)."""

    version: int  # 1
    token: str  # 32 hex digits: the offer :func:`measure` serves
    display_id: str  # the measured table is shown under it
    kernel: str  # this kernel's message session ('' outside a kernel)
    label: str
    budget_s: int  # the seconds measuring will take (plan_budget), which the button announces


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

    def __init__(self, run: Any, loader: Any = None) -> None:
        self.run = run
        self.token = secrets.token_hex(16)
        self.display_id = f"gpuwidget-measure-{self.token}"
        self._loader = weakref.ref(loader) if loader is not None else None

    def bundle(self) -> dict[str, OfferData | str]:
        from gpuwidget.measure.plan import plan_budget

        label = getattr(self.run, "label", "") or "the watched cell"
        offer: OfferData = {"version": 1, "token": self.token, "display_id": self.display_id,
                 "kernel": kernel_session(), "label": label, "budget_s": round(plan_budget(self.run))}
        return {MIME: offer, **_note_bundle(FALLBACK_NOTE)}

    def _ipython_display_(self) -> None:
        from IPython.display import publish_display_data

        _offers[self.token] = self
        while len(_offers) > MAX_OFFERS:
            _offers.popitem(last=False)
        publish_display_data(self.bundle(), transient={"display_id": self.display_id})

    def _gone(self) -> str | None:
        """Why nothing is left to measure, or None: neither the loader nor the model lives, or only the
        model does and every change the findings would try is a loader setting (the cell's loader
        rebound since, as a tutorial does before its next watched cell)."""
        from gpuwidget.measure.changes import model_part

        subjects = getattr(self.run, "subjects", None)
        loader_alive = self._loader is not None and self._loader() is not None
        model_alive = subjects is not None and subjects.model is not None
        changes = [change for finding in getattr(self.run, "findings", []) for change in finding.trial_changes()]
        loader_only = bool(changes) and not any(model_part(change) for change in changes)
        if loader_alive or (model_alive and not loader_only):
            return None
        return LOADER_GONE_NOTE if self._loader is not None else MODEL_GONE_NOTE

    def measure(self) -> tuple[str, dict[str, str]]:
        """Measure every finding's change; ``(status, bundle)``: ``measured`` (the table), ``failed`` (why;
        a click may try again) or ``gone`` (nothing left to measure)."""
        from gpuwidget.measure.plan import measure_findings, plan_budget
        from gpuwidget.ui.progress import tuning_progress

        if getattr(self.run, "measured", None) is not None:  # measured already (a second view's click)
            return "measured", self.run.measured._repr_mimebundle_()
        gone = self._gone()
        if gone is not None:
            return "gone", _note_bundle(gone)
        budget = plan_budget(self.run)
        try:
            with tuning_progress(budget, show=True, widgets=False) as bar:
                self.run.measured = measure_findings(self.run, budget, progress=getattr(bar, "line", None),
                                                     tuner_progress=bar)
            self.run.tuning = self.run.measured.tuning
            return "measured", self.run.measured._repr_mimebundle_()
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


def measure_button(run: Any, loader: Any = None) -> MeasureOffer:
    """A Measure button that measures ``run``'s findings (the tuner on ``loader``, the changes in its step)."""
    return MeasureOffer(run, loader)
