"""The user's random number generators, saved before a measurement runs their workload and restored after.

Iterating a DataLoader draws a seed from torch's global generator (its sampler's and its
workers' seeds), and a model's forward pass may draw from it (dropout); datasets often draw
from NumPy's or Python's. A measurement the user did not ask to change their training run
must leave all of them as it found them, however it ends.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore torch's CPU and (if started) CUDA generators, NumPy's global one and Python's ``random``."""
    import torch

    python_state = random.getstate()
    numpy = sys.modules.get("numpy")  # only if the user's code has it: never imported just for this
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cpu_state = torch.get_rng_state()
    cuda_states = (torch.cuda.get_rng_state_all()
                   if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
