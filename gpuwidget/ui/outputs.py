"""The watched cell's own outputs, so that the panel takes the live view's place and no empty output stays.

A display's output cannot be removed on its own: emptied, it is still saved with the notebook (an
empty ``display_data``). So when the cell ends, the live view's output (which the BokehJS loader's
output became, ui.live) becomes the panel itself. The panel comes after what the cell printed; the
live view came before it. While the cell runs this records what the cell itself sends (text written
to stdout/stderr, in order; displays of its own, counted) so that at the end:

- nothing: the panel replaces the live view in place;
- text only (up to :data:`MAX_TEXT` characters): the cell's output is cleared, the text written
  again as it came, then the panel (what a saved notebook keeps: the text, then the panel);
- displays of the cell's own (a tqdm bar, a plot), or more text: the live view's output is emptied
  and the panel shown below, as before (one empty output, rather than lose or re-create the user's).

The hooks are ipykernel's own (``display_pub.register_hook``, thread-local to the cell's thread) and
a wrapper of each stream's ``write``; :meth:`CellOutputs.remove` takes them off, whatever happened.
"""

from __future__ import annotations

import sys
from typing import Any

# Text the cell may have printed for it to be written again after the clear (a training loop's
# per-epoch lines are a few kB; a loop printing every step is left as it is).
MAX_TEXT = 200_000


class CellOutputs:
    """Records what the running cell sends to its output (:meth:`install` at the start, :meth:`remove`)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.displays = 0
        self.chunks: list[tuple[str, str]] = []  # (stream name, text) in the order written
        self.size = 0
        self._publisher: Any = None
        self._streams: list[tuple[Any, Any]] = []

    def install(self) -> bool:
        """Start recording; False (nothing installed) outside an ipykernel shell."""
        publisher: Any = getattr(self.shell, "display_pub", None)
        if not hasattr(publisher, "register_hook"):
            return False
        publisher.register_hook(self._published)
        self._publisher = publisher
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            original = stream.__dict__.get("write")  # an instance attribute of someone else's, if any

            def write(text: str, _stream: Any = stream, _name: str = name) -> Any:
                self._written(_name, text)
                return type(_stream).write(_stream, text)

            try:
                stream.write = write
            except (AttributeError, TypeError):  # a stream that takes no attribute: text goes unrecorded
                self.size = MAX_TEXT + 1
                continue
            self._streams.append((stream, original))
        return True

    def _published(self, msg: Any) -> Any:
        if msg.get("msg_type") in ("display_data", "execute_result", "clear_output"):
            self.displays += 1
        return msg

    def _written(self, name: str, text: Any) -> None:
        if not isinstance(text, str) or not text:
            return
        self.size += len(text)
        if self.size <= MAX_TEXT:
            if self.chunks and self.chunks[-1][0] == name:
                self.chunks[-1] = (name, self.chunks[-1][1] + text)
            else:
                self.chunks.append((name, text))

    def remove(self) -> None:
        """Stop recording (safe to call twice)."""
        if self._publisher is not None:
            self._publisher.unregister_hook(self._published)
            self._publisher = None
        for stream, original in self._streams:
            if original is None:
                stream.__dict__.pop("write", None)
            else:
                stream.write = original
        self._streams = []

    @property
    def replayable(self) -> bool:
        """The cell sent only text, all of it recorded: it can be cleared and written again."""
        return self.displays == 0 and self.size <= MAX_TEXT

    def replay(self) -> None:
        """Clear the cell's output and write its text again, as it came (call after :meth:`remove`)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.shell.display_pub.clear_output(wait=False)
        for name, text in self.chunks:
            stream = getattr(sys, name)
            stream.write(text)
            stream.flush()


def end_live_view(outputs: CellOutputs | None, handle: Any, bundle: dict[str, str]) -> bool:
    """Put the panel (``bundle``) where the live view's output ``handle`` was, leaving no empty output:
    in its place, or after the cell's text written again (:class:`CellOutputs`). False where neither
    can be done: the caller empties the live view's output and shows the panel below."""
    if outputs is None or handle is None or not outputs.replayable:
        return False
    if outputs.chunks:
        outputs.replay()
        from IPython.display import publish_display_data

        publish_display_data(bundle)
    else:
        handle.update(bundle, raw=True)
    return True
