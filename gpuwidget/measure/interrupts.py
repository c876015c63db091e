"""A Ctrl-C kept until a measurement can raise it: none is lost while DataLoader workers fork.

CPython runs the callbacks of ``os.register_at_fork`` with their exceptions ignored. A Ctrl-C that
lands in one (logging's lock release in the parent as a DataLoader worker forks) raises its
KeyboardInterrupt there, where it is reported as "Exception ignored" and dropped: the tuner went
on to the end of its budget as if nobody had asked it to stop (fresh-check run 44).

:func:`keeping_interrupts` puts a handler in front of Python's default one for the length of a
measurement. It notes each Ctrl-C before raising it as the default one does, and
:func:`raise_if_interrupted`, called after each fork-prone step (``iter()`` of a loader, each
``next()``), raises one that was noted and never reached the code. Only on the main thread
(where signal handlers are set) and only over Python's own handler: a handler of the user's, or
SIGINT ignored, is left as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_noted: list[int] = []  # Ctrl-Cs seen by the handler and not yet raised where the code could see them


def _note_and_raise(signum: int, frame: FrameType | None) -> None:
    _noted.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def keeping_interrupts() -> Iterator[None]:
    """Within the block, a Ctrl-C dropped by the interpreter is raised by :func:`raise_if_interrupted`
    (or at the block's end, at the latest). Nesting is harmless: the outermost block holds the handler."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, _note_and_raise)
    del _noted[:]
    unwinding = True
    try:
        yield
        unwinding = False
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        dropped = bool(_noted)
        del _noted[:]
    if dropped and not unwinding:
        raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C the interpreter dropped (noted by the handler)."""
    if _noted:
        del _noted[:]
        raise KeyboardInterrupt
