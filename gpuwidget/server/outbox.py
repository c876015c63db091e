"""One websocket client's backlog: bounded, samples dropped while it lags, closed when it stays behind.

tornado queues whatever is written to a client that stops reading (a frozen tab, a laptop
lid closed mid-stream) in the server's memory: ten such clients grew a server by 266 MiB in
160 s. An :class:`Outbox` counts the writes the socket has not yet taken. While
:data:`MAX_UNSENT` are waiting, a new sample is dropped (the next one replaces it: a live
plot wants the latest point, not every point); a client that has taken nothing for
:data:`STALLED_CLOSE_S` is closed with a reason, which the sidebar answers by reconnecting.

Every write's future is awaited here, so a client that vanishes mid-write ends quietly, never
as asyncio's "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tornado.websocket import WebSocketClosedError

# Writes in flight (queued past the kernel's socket buffer) before samples are dropped. The
# first writes are the hello, the history (~1.6 MB) and the process table; 4 leaves a sample
# room behind them, and bounds a stalled client to about one history of server memory.
MAX_UNSENT = 4
# Seconds a client may go without taking any write before it is closed. Well inside the minute
# the server allows a stalled client; well past a history's transfer on a slow link
# (1.6 MB at 1 Mbit/s is 13 s).
STALLED_CLOSE_S = 30.0
# WebSocket close code for "try again later" (RFC 6455 section 7.4, IANA registry): the client may reconnect.
CLOSE_TRY_AGAIN_LATER = 1013
STALLED_REASON = "too far behind: nothing was read for {:.0f} s"

Write = Callable[[bytes | str], "asyncio.Future[None]"]
Close = Callable[[int, str], None]


class Outbox:
    """Writes to one client with at most ``max_unsent`` waiting; see the module docstring."""

    def __init__(self, write: Write, close: Close, *, max_unsent: int | None = None,
                 stalled_close_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self._close = close
        # Read at construction, not definition, so a test can shorten them for one server.
        self.max_unsent = MAX_UNSENT if max_unsent is None else max_unsent
        self.stalled_close_s = STALLED_CLOSE_S if stalled_close_s is None else stalled_close_s
        self._clock = clock
        self.unsent = 0
        self.dropped = 0
        self.closed = False
        self._last_taken = clock()  # when the client last took a write (or the outbox opened)

    def send(self, message: bytes | str, *, droppable: bool = True) -> None:
        """Write ``message``, or drop it if the client is behind and it is ``droppable``."""
        if self.closed:
            return
        if self.unsent >= self.max_unsent:
            behind = self._clock() - self._last_taken
            if behind >= self.stalled_close_s:
                self.close(CLOSE_TRY_AGAIN_LATER, STALLED_REASON.format(behind))
                return
            if droppable:
                self.dropped += 1
                return
        try:
            future = self._write(message)
        except WebSocketClosedError:
            self.closed = True
            return
        self.unsent += 1
        future.add_done_callback(self._taken)

    def close(self, code: int, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self._close(code, reason)

    def _taken(self, future: asyncio.Future[None]) -> None:
        self.unsent -= 1
        if future.cancelled() or future.exception() is not None:
            self.closed = True  # the connection is gone; on_close does the rest
            return
        self._last_taken = self._clock()
