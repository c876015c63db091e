"""The child channel's wire format: what a child process sends the watch, and how it is framed.

One Unix stream socket per watch, in a directory only its user can enter; each child
process opens one connection and sends *messages*: a 4-byte big-endian length, then that
many bytes of UTF-8 JSON (an object with a ``"kind"``). Times are absolute readings of
:func:`gpuwidget.clock.now` (a monotonic clock every process on the host shares); the
watch turns them into its trace's times.

Messages:

* ``spans``: ``{"kind": "spans", "id": Identity, "spans": {"step": [[start, end], ...],
  "loader.wait": [...]}, "progress": Progress, "cpu": Cpu}``, every :data:`FLUSH_INTERVAL_S`
  while the process trains, and once more at exit; a step still open when the probes were
  removed comes under :func:`open_kind` of its kind (``"step.open"``);
* ``facts``: ``{"kind": "facts", "id": Identity, "progress": Progress, "workload":
  WorkloadFacts, "host": {...}, "cpu": Cpu, "final": bool}``: the process's workload facts,
  when its process group is destroyed (the DDP model is still alive then) and at exit (final).

``Identity`` is ``{"pid", "ppid", "rank", "local_rank", "world_size", "gpu"}`` (None where
unknown); ``Progress`` the figures of the process's busiest DataLoader so far: ``steps``,
``samples``, ``wait_s``, ``loop_s``; ``Cpu`` the CPU seconds the process used since it
started: ``process_s`` (all its threads) and ``workers_s`` (its child processes: loader workers).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any, TypedDict

# Set by the watch while it runs (the socket's path); a Python process started with it loads
# the probes (gpuwidget_children.pth). Nothing happens in a process without it.
ENV_VAR = "GPUWIDGET_CHILDREN"
# How often a child sends its spans: often enough for the live view, rare enough to cost nothing.
FLUSH_INTERVAL_S = 0.3
# Set beside ENV_VAR: the watch's sampling interval (seconds), at which a child samples its main
# thread's stack (probes.stack); a child without it samples at DEFAULT_STACK_INTERVAL_S.
INTERVAL_VAR = "GPUWIDGET_CHILDREN_INTERVAL"
DEFAULT_STACK_INTERVAL_S = 0.25
# Never faster than the watch allows (options.py: 0.01 s), never slower than a flush.
MIN_STACK_INTERVAL_S = 0.01


def stack_interval(value: str | None) -> float:
    """The child's stack-sampling interval from :data:`INTERVAL_VAR`'s value."""
    try:
        interval = float(value) if value else DEFAULT_STACK_INTERVAL_S
    except ValueError:
        interval = DEFAULT_STACK_INTERVAL_S
    if interval != interval:  # NaN
        interval = DEFAULT_STACK_INTERVAL_S
    return min(FLUSH_INTERVAL_S, max(MIN_STACK_INTERVAL_S, interval))
# A larger message is a broken or hostile peer: its connection is closed.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024

OPEN_SUFFIX = ".open"


class Identity(TypedDict, total=False):
    """Who a child process is (``"id"`` of every message); None where unknown."""

    pid: int
    ppid: int
    rank: int | None  # torch.distributed's rank, else the launcher's RANK
    local_rank: int | None
    world_size: int | None
    gpu: int | None  # the driver's number of its CUDA device (after CUDA_VISIBLE_DEVICES)
    gpu_uuid: str  # that device's UUID as torch gives it
    distributed: bool  # it joined a process group
    argv: list[str] | None  # its first arguments, each cut to 200 characters


class Progress(TypedDict, total=False):
    """The running totals of a child's busiest DataLoader (``"progress"``); empty before its first batch."""

    steps: int
    samples: int
    wait_s: float  # seconds blocked in next()
    loop_s: float  # seconds in the loop


def open_kind(kind: str) -> str:
    """The key under which a span kind's still-open spans travel."""
    return kind + OPEN_SUFFIX


_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


def encode(message: Mapping[str, object]) -> bytes:
    """One framed message; NaN and other non-JSON floats become null."""
    body = json.dumps(_plain(message), separators=(",", ":"), allow_nan=False, default=repr).encode()
    return _HEADER.pack(len(body)) + body


def decode_frames(buffer: bytearray) -> list[dict[str, Any]]:
    """Take every complete message off the front of ``buffer`` (the rest stays for later).

    Raises ValueError for a frame over :data:`MAX_MESSAGE_BYTES` or one that is not a JSON object.
    """
    messages: list[dict[str, Any]] = []
    offset = 0
    while len(buffer) - offset >= HEADER_BYTES:
        (size,) = _HEADER.unpack_from(buffer, offset)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
        if len(buffer) - offset - HEADER_BYTES < size:
            break
        start = offset + HEADER_BYTES
        message = json.loads(bytes(buffer[start:start + size]))
        if not isinstance(message, dict):
            raise ValueError("a message is not a JSON object")
        messages.append(message)
        offset = start + size
    del buffer[:offset]
    return messages


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
