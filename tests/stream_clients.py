"""Misbehaving stream clients and an hour of server history, for the server tests and benchmarks/stream_churn.py.

A browser that vanished or froze is a TCP peer that never reads and never answers a ping;
tornado's own client always does both, so :class:`RawClient` speaks the websocket handshake
by hand and reads only when asked.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from collections.abc import Mapping

import numpy as np

from gpuwidget.clock import now as clock_now
from gpuwidget.server.monitor import Monitor
from gpuwidget.trace import Trace

OPCODE_TEXT = 0x1
OPCODE_CLOSE = 0x8
OPCODE_PING = 0x9


class RawClient:
    """A websocket client that reads only when told to, and never answers a ping."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, path: str, headers: Mapping[str, str] | None = None,
                      receive_buffer: int | None = None) -> RawClient:
        """Open ``path`` on 127.0.0.1:``port``; ``receive_buffer`` (bytes) makes a stalled client fill up fast."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13",
                 *(f"{name}: {value}" for name, value in (headers or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        response = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if not response.startswith(b"HTTP/1.1 101"):
            writer.close()
            raise ConnectionError(response.split(b"\r\n", 1)[0].decode())
        return cls(reader, writer)

    async def frame(self) -> tuple[int, bytes]:
        """The next (opcode, payload) the server sent (its frames are never masked)."""
        head = await self.reader.readexactly(2)
        length = head[1] & 0x7F
        if length == 126:
            length = struct.unpack("!H", await self.reader.readexactly(2))[0]
        elif length == 127:
            length = struct.unpack("!Q", await self.reader.readexactly(8))[0]
        return head[0] & 0x0F, await self.reader.readexactly(length)

    def abort(self) -> None:
        """Vanish without a closing handshake (a reset, as when a laptop's network drops)."""
        self.writer.transport.abort()


def close_reason(payload: bytes) -> tuple[int, str]:
    """A close frame's (code, reason)."""
    return struct.unpack("!H", payload[:2])[0], payload[2:].decode()


def fill_history(monitor: Monitor, seconds: float = 3600.0, every_s: float = 1.0) -> int:
    """Give ``monitor`` ``seconds`` of history at one row per ``every_s``, shaped like its own sources' rows.

    One real reading gives the columns (8 fake GPUs give 92); the rows vary around it so the
    history does not compress to nothing. Returns the number of columns.
    """
    sources = monitor._ensure_sources().all()
    row: dict[str, float] = {}
    for source in sources:
        source.read()
    time.sleep(0.05)  # rates need two readings apart
    for source in sources:
        row.update(source.read())
    trace = Trace(start_clock=clock_now() - seconds, start_wall=time.time() - seconds)
    names = list(row)
    base = np.array([row[name] for name in names])
    noise = np.random.default_rng(0).random((int(seconds / every_s), len(names)))
    for i, jitter in enumerate(noise):
        trace.append(i * every_s, dict(zip(names, (base * (0.5 + jitter)).tolist())))
    monitor.trace = trace
    return len(names)
