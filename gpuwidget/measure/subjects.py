"""What a measurement runs on: the watched cell's trained model, its optimizer, its loaders, one batch
and the loss functions in the user's namespace, kept from the end of the watch.

Objects of the user's are held weakly (the Run never keeps a model, optimizer or loader alive). The
batch is a copy of the probes' own (on the model's device); only the latest :data:`KEEP_BATCHES`
watches keep theirs, so a long session holds a few batches, not one per cell.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwidget.facts import TrainingFacts

if TYPE_CHECKING:
    from gpuwidget.probes import WatchedObjects

# Watches whose copied batch is kept for a later measurement (older ones let theirs go).
KEEP_BATCHES = 4
# Names a loss function or module is usually given (tried in this order after nn's loss modules
# held by these names).
LOSS_NAMES = ("loss_fn", "criterion", "loss_func", "loss_function", "lossfn", "compute_loss", "loss_fcn")

_kept: deque[Subjects] = deque()


def _weak(value: Any) -> Any:
    if value is None:
        return None
    try:
        return weakref.ref(value)
    except TypeError:
        return None


@dataclass
class Subjects:
    """Weak references to the watched cell's training objects, and the copied batch."""

    model_ref: Any = None
    optimizer_ref: Any = None
    loader_refs: list[Any] = field(default_factory=list)
    batch: Any = None  # probes.batch_capture.CapturedBatch
    losses: list[tuple[str, Any]] = field(default_factory=list)  # (the user's name, loss function or module)
    autocast_dtype: str | None = None  # the dtype most training forwards ran under, if most ran under autocast
    batch_released: bool = False

    @classmethod
    def from_watch(cls, objects: WatchedObjects, namespace: Mapping[str, Any] | None,
                   training: TrainingFacts | None) -> Subjects:
        """From ``Probes.objects()``, the user's namespace and the run's training facts."""
        training = training or {}
        share = training.get("autocast_share") or 0.0
        subjects = cls(
            model_ref=_weak(objects.get("model")),
            optimizer_ref=objects.get("optimizer"),
            loader_refs=[r for r in (_weak(loader) for loader in objects.get("loaders") or []) if r is not None],
            batch=objects.get("batch"),
            losses=loss_candidates(namespace or {}),
            autocast_dtype=training.get("autocast_dtype") if share >= 0.5 else None,
        )
        if subjects.batch is not None:
            _kept.append(subjects)
            while len(_kept) > KEEP_BATCHES:
                _kept.popleft().release_batch()
        return subjects

    def release_batch(self) -> None:
        self.batch = None
        self.batch_released = True

    @property
    def model(self) -> Any:
        return self.model_ref() if self.model_ref is not None else None

    @property
    def optimizer(self) -> Any:
        return self.optimizer_ref() if self.optimizer_ref is not None else None

    @property
    def loaders(self) -> list[Any]:
        return [loader for loader in (ref() for ref in self.loader_refs) if loader is not None]


def loss_candidates(namespace: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The user's loss functions and modules by name: torch loss modules (``nn.modules.loss._Loss``)
    first, then callables under the usual names (:data:`LOSS_NAMES`)."""
    import sys

    found: list[tuple[str, Any]] = []
    loss_module = sys.modules.get("torch.nn.modules.loss")
    base = getattr(loss_module, "_Loss", None)
    for name, value in namespace.items():
        if not name.startswith("_") and base is not None and isinstance(value, base):
            found.append((name, value))
    found.sort(key=lambda item: (item[0] not in LOSS_NAMES, item[0]))
    for name in LOSS_NAMES:
        value = namespace.get(name)
        if callable(value) and not isinstance(value, type) and all(value is not v for _, v in found):
            found.append((name, value))
    return found
