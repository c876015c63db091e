"""A stream client's bounded backlog (gpuwidget.server.outbox), driven by hand: futures, a clock, no sockets."""

from __future__ import annotations

import asyncio
import gc

import pytest
from tornado.websocket import WebSocketClosedError

from gpuwidget.server.outbox import CLOSE_TRY_AGAIN_LATER, Outbox

pytestmark = pytest.mark.server


class Client:
    """The socket side: every write waits until the test says the client took it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waiting: list[asyncio.Future[None]] = []
        self.written: list[bytes | str] = []
        self.closed_with: tuple[int, str] | None = None

    def write(self, message: bytes | str) -> asyncio.Future[None]:
        self.written.append(message)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        return future

    def close(self, code: int, reason: str) -> None:
        self.closed_with = (code, reason)

    async def take(self, count: int = 1) -> None:
        for future in self.waiting[:count]:
            future.set_result(None)
        del self.waiting[:count]
        await asyncio.sleep(0)  # done callbacks run on the next loop pass

    def outbox(self) -> Outbox:
        return Outbox(self.write, self.close, max_unsent=3, stalled_close_s=30.0, clock=lambda: self.now)


async def test_samples_are_dropped_while_the_backlog_is_full_and_flow_again_once_taken():
    client = Client()
    box = client.outbox()
    for n in range(5):
        box.send(f"sample {n}")
    assert client.written == ["sample 0", "sample 1", "sample 2"] and box.dropped == 2
    await client.take()
    box.send("sample 5")  # the latest point, not the intermediate ones
    assert client.written[-1] == "sample 5" and box.unsent == 3


async def test_the_hello_and_history_are_never_dropped():
    client = Client()
    box = client.outbox()
    for n in range(3):
        box.send(f"sample {n}")
    box.send("history", droppable=False)
    assert client.written[-1] == "history" and box.dropped == 0


async def test_a_client_that_takes_nothing_for_the_stall_limit_is_closed_with_a_reason():
    client = Client()
    box = client.outbox()
    for n in range(4):
        box.send(f"sample {n}")
    client.now = 29.9
    box.send("late")
    assert client.closed_with is None
    client.now = 30.0
    box.send("later")
    assert client.closed_with == (CLOSE_TRY_AGAIN_LATER, "too far behind: nothing was read for 30 s")
    assert box.closed
    box.send("after the close")
    assert client.written == ["sample 0", "sample 1", "sample 2"]


async def test_a_slow_but_steady_reader_loses_samples_but_is_never_closed():
    client = Client()
    box = client.outbox()
    for second in range(120):  # two samples a second, the client takes one every second
        client.now = float(second)
        box.send("a")
        box.send("b")
        await client.take()
    assert box.dropped > 100 and client.closed_with is None and not box.closed


async def test_a_write_that_fails_when_the_client_vanishes_is_retrieved_not_left_to_asyncio():
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        client = Client()
        box = client.outbox()
        box.send("history")
        client.waiting.pop().set_exception(WebSocketClosedError())
        await asyncio.sleep(0)
        assert box.closed and box.unsent == 0
        del client
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_a_write_to_a_closed_socket_ends_the_outbox_quietly():
    def closed(message: bytes | str) -> asyncio.Future[None]:
        raise WebSocketClosedError()

    box = Outbox(closed, lambda code, reason: None)
    box.send("sample")
    assert box.closed and box.unsent == 0
