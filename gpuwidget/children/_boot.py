"""Start-up hook of a process a gpuwidget watch started: wait for torch, then load the probes.

Installed as the top-level module ``gpuwidget_children_boot`` next to ``gpuwidget_children.pth``,
whose one line imports it only when the watch's environment variable is set (otherwise a
Python start-up pays one ``os.environ`` lookup: BENCHMARKS.md). It imports nothing of
gpuwidget itself: a Python process that never imports torch (a launcher's helper, a shell
tool) pays nothing more; one that does loads :mod:`gpuwidget.children.agent` right after
``import torch`` has finished, before the process's own code can build a DataLoader.

The hook stays until torch's module really runs: ``importlib.util.find_spec("torch")`` (which
``datasets`` and ``transformers`` call at import to learn whether torch is there) imports
nothing, so it only gets a spec whose loader will start the agent if that spec is ever used.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself is not imported: it would cost every start-up with the variable set
if TYPE_CHECKING:
    from typing import Any

TRIGGER = "torch"


def start_agent() -> None:
    try:
        from gpuwidget.children.agent import start_from_env

        start_from_env()
    except Exception as exc:  # noqa: BLE001 - never break the user's process
        sys.stderr.write(f"gpuwidget: no probes in process (start-up failed: {exc!r})\n")


class _Loaded:
    """The real loader of ``torch``: when it runs the module, the hook goes and the agent starts."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        remove()  # torch is being imported now: nothing more to wait for (and its own imports pass by)
        try:
            self.loader.exec_module(module)
        finally:
            module.__loader__ = self.loader  # torch sees its own loader, as without the hook
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.loader
        start_agent()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AfterTorch:
    """A meta path finder that only watches for ``import torch``: it hands out torch's own spec with
    a loader that starts the agent, and stays until that loader runs (a spec only looked up, as
    ``importlib.util.find_spec`` does, leaves it in place)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TRIGGER:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, AfterTorch):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loaded(spec.loader)
                return spec
        return None


def remove() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, AfterTorch)]


def install() -> None:
    if TRIGGER in sys.modules:
        start_agent()
    elif not any(isinstance(finder, AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterTorch())


install()
