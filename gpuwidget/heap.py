"""The C heap: hand its free memory back to the OS, so resident memory says what is really in use."""

from __future__ import annotations

import contextlib
import ctypes


def trim() -> None:
    """Return the C heap's free memory to the OS (glibc's ``malloc_trim``; other C libraries have none).

    Freed blocks stay resident until then, and a later allocation reuses them without the
    resident size growing: a long-lived process (a Jupyter server after many sockets, a kernel
    after many cells) then looks smaller than what a new allocation will really take.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS)
        ctypes.CDLL(None).malloc_trim(0)
