"""The loss of the user's training step, found as an engineer reading the cell would find it.

In this order (the first that applies wins; :attr:`StepLoss.kind` says which):

1. ``step=fn``, given to ``Run.measure``: ``fn(model, batch)`` returns the loss (``batch`` as the loop
   had it: a training_step's batch, ``(inputs, target)``, the inputs, or the keyword inputs);
2. a LightningModule (a ``training_step`` method that the probes saw called): ``training_step(batch, 0)``;
3. the model's own loss: a Hugging Face output's ``.loss`` (labels among the inputs), a dict's
   ``"loss"``, or a 0-d tensor in a returned tuple (nanoGPT's ``logits, loss = model(x, y)``);
4. a loss module or function of the user's (an ``nn.modules.loss._Loss`` instance, or a callable named
   ``loss_fn``, ``criterion``, ...: gpuwidget.measure.subjects) applied to ``(output, target)``, the target
   being the tensor the calling code held beside the inputs (``y``) that the loss accepts;
5. with a target but no loss function: cross-entropy for integer class targets, mean squared error for
   float targets shaped like the output (named as guessed in the notes);
6. otherwise a stand-in (the output's mean): the step is timed, and the numerics are not compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpuwidget.probes.batch_capture import CapturedBatch

# Names a loop gives the target, tried first among the caller's tensors.
TARGET_NAMES = ("y", "target", "targets", "label", "labels", "yb", "y_batch", "batch[1]")


class ModelInputs(NamedTuple):
    """A plain model's step: its call's arguments and the loss's target (None when the model computes it)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any = None


@dataclass
class StepLoss:
    """How one training step computes its loss: ``fn(model, payload) -> loss``."""

    kind: str  # one line: "training_step", "the model's own loss (output.loss)", ...
    fn: Callable[[Any, Any], Any]
    payload: Any  # one optimizer step's batch, as fn takes it
    compares: bool = True  # the loss is the user's: numerics are compared
    note: str | None = None
    lightning: bool = False

    def from_loader(self, batch: Any) -> Any:
        """A loader's batch in the form ``fn`` takes (the loader yields what the loop consumed)."""
        if self.lightning or self.kind == "step=":
            return batch
        if isinstance(batch, Mapping):
            return ModelInputs((), dict(batch), None)
        if isinstance(batch, (list, tuple)) and batch:
            return ModelInputs((batch[0],), {}, batch[1] if len(batch) > 1 else None)
        return ModelInputs((batch,), {}, None)


def as_loss(output: Any) -> Any:
    """The loss in a model's or a training_step's output, or None."""
    loss = getattr(output, "loss", None)
    if loss is not None and hasattr(loss, "backward"):
        return loss
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if hasattr(loss, "backward") else None
    if hasattr(output, "backward") and getattr(output, "ndim", 1) == 0:
        return output
    if isinstance(output, (list, tuple)):
        for item in output:
            if hasattr(item, "backward") and getattr(item, "ndim", 1) == 0 and item.is_floating_point():
                return item
    return None


def output_tensor(output: Any) -> Any:
    """The prediction in a model's output: the tensor itself, ``.logits``, a tuple's first tensor."""
    if hasattr(output, "shape"):
        return output
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, Mapping):
        return output.get("logits", next((v for v in output.values() if hasattr(v, "shape")), None))
    if isinstance(output, (list, tuple)):
        return next((v for v in output if hasattr(v, "shape")), None)
    return None


def _call(model: Any, inputs: ModelInputs) -> Any:
    return model(*inputs.args, **inputs.kwargs)


def guessed_loss(output: Any, target: Any) -> tuple[str, Callable[[Any, Any], Any]] | None:
    """Cross-entropy for integer class targets, mean squared error for float targets shaped like the output."""
    import torch.nn.functional as F  # noqa: N812

    if output is None or target is None:
        return None
    if not target.is_floating_point() and output.ndim == target.ndim + 1:
        def cross_entropy(out: Any, y: Any) -> Any:
            # (N, C) against (N,), or per position (N, L, C) against (N, L).
            return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

        return "cross_entropy", cross_entropy
    if target.is_floating_point() and tuple(output.shape) == tuple(target.shape):
        return "mse_loss", lambda out, y: F.mse_loss(out.float(), y.float())
    return None


def user_batch(captured: CapturedBatch) -> Any:
    """The batch as the user's loop had it, for ``step=fn(model, batch)``."""
    if captured.has_step_batch:
        return captured.step_batch
    args = captured.args
    inputs = args[0] if len(args) == 1 else args
    if captured.targets:
        return (inputs, captured.targets[_ordered_target_names(captured)[0]])
    if captured.kwargs and not args:
        return captured.kwargs
    return inputs


def _ordered_target_names(captured: CapturedBatch) -> list[str]:
    """The caller's tensors by name, the usual target names first."""
    def rank(name: str) -> tuple[bool, int]:
        return name not in TARGET_NAMES, TARGET_NAMES.index(name) if name in TARGET_NAMES else 0

    return sorted(captured.targets, key=rank)


def resolve_loss(model: Any, captured: CapturedBatch, losses: list[tuple[str, Any]],
                 step: Callable[[Any, Any], Any] | None = None, original: Any = None) -> StepLoss:
    """Find the step's loss (the module docstring's order). ``model`` is a copy of ``original`` (the
    user's): a forward in eval mode without gradients may run on it to see what the model returns."""
    import torch

    if step is not None:
        return StepLoss("step=", step, user_batch(captured))
    entry = captured.entry() if captured.entry is not None else None
    if entry is original:
        entry = model
    if captured.has_step_batch and callable(getattr(model, "training_step", None)):
        if getattr(model, "automatic_optimization", True) is False:
            raise ValueError("this LightningModule optimizes manually (automatic_optimization=False): its "
                             "training_step steps its optimizers itself; pass step=fn(model, batch) -> loss")

        def training_step(m: Any, batch: Any) -> Any:
            loss = as_loss(m.training_step(batch, 0))
            if loss is None:
                raise ValueError("training_step returned no loss (None or no 'loss' key)")
            return loss

        return StepLoss("training_step", training_step, captured.step_batch, lightning=True)
    if entry is not None and entry is not model:
        # The forward seen was a submodule's, called from a method of the model's: its inputs are not the model's.
        raise ValueError(f"the trained model ({type(model).__name__}) was called through its submodule "
                         f"{type(entry).__name__} from {captured.caller or 'a method'}(): pass "
                         "step=fn(model, batch) -> loss")
    inputs = ModelInputs(captured.args, captured.kwargs, None)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = _call(model, inputs)
            if as_loss(output) is not None:
                return StepLoss("the model's own loss", lambda m, b: as_loss(_call(m, b)), inputs)
            prediction = output_tensor(output)
            names = _ordered_target_names(captured)
            for loss_name, loss in losses:
                for name in names:
                    target = captured.targets[name]
                    if _accepts(loss, prediction, target):
                        return StepLoss(f"{loss_name}(output, {name})", _applied(loss),
                                        inputs._replace(target=target))
            for name in names:
                target = captured.targets[name]
                guess = guessed_loss(prediction, target)
                if guess is not None and _accepts(guess[1], prediction, target):
                    label, function = guess
                    return StepLoss(f"{label}(output, {name}), guessed", _applied(function),
                                    inputs._replace(target=target),
                                    note=f"loss: {label} guessed from the target {name!r} (no loss function "
                                         "in the namespace; pass step=fn(model, batch) for your own)")
    finally:
        model.train(training)
    if prediction is None:
        raise ValueError("the model returns no tensor to take a loss of; pass step=fn(model, batch) -> loss")
    return StepLoss("stand-in (the output's mean)", lambda m, b: output_tensor(_call(m, b)).float().mean(),
                    inputs, compares=False,
                    note="no loss found (no labels in the inputs, no loss function in the namespace): timed with "
                         "a stand-in loss, the output's mean; numerics not compared (pass step=fn(model, batch))")


def _applied(loss: Callable[[Any, Any], Any]) -> Callable[[Any, ModelInputs], Any]:
    """``loss(prediction, target)`` as a step's loss: ``fn(model, inputs)``."""
    def step_loss(model: Any, inputs: ModelInputs) -> Any:
        return loss(output_tensor(_call(model, inputs)), inputs.target)

    return step_loss


def _accepts(loss: Any, prediction: Any, target: Any) -> bool:
    try:
        value = loss(prediction, target)
    except Exception:  # noqa: BLE001 - not this target (or not this loss): try the next
        return False
    return hasattr(value, "backward") and getattr(value, "ndim", 1) == 0
