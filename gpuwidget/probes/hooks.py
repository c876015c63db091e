"""The hooks probes put on the user's modules, made so that the user's own use of the module is unchanged."""

from __future__ import annotations

import contextlib
import functools
from typing import Any


class ModelHook:
    """A forward pre-hook a probe puts on the user's model (``call(module, args)``; True removes it).

    Its copies are inert and need no gpuwidget to load: a closure over the probe (which holds locks)
    would make ``copy.deepcopy(model)`` and ``torch.save(model)`` raise while a cell is watched, and a
    bound method would drag the probe into the copy. The stand-in, ``partial(dict.get, {})``, returns
    the arguments it is given, which torch takes as unchanged.
    """

    __slots__ = ("call", "handles", "fired")

    def __init__(self, call: Any) -> None:
        self.call = call
        self.handles: list[Any] = []
        self.fired = False

    def __call__(self, module: Any, args: Any) -> None:
        if self.fired:
            return
        try:
            if self.call(module, args):
                self.remove()
        except Exception:  # noqa: BLE001, S110 - a probe never breaks the user's forward
            pass

    def remove(self) -> None:
        """Take the hook off every module it is on (either thread may call this, more than once)."""
        self.fired = True
        for handle in list(self.handles):
            with contextlib.suppress(KeyError):  # the other thread removed it between its check and delete
                handle.remove()

    def __reduce__(self) -> tuple[Any, ...]:
        return functools.partial, (dict.get, {})

    def __deepcopy__(self, memo: Any) -> Any:
        return functools.partial(dict.get, {})
