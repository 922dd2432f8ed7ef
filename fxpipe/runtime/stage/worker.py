"""One stage's forward and backward on explicit, detached boundaries: what F, B, I and W do.

The action interpreter (:mod:`fxpipe.runtime.interpreter`) cuts autograd at each stage
boundary. A forward takes detached inputs, marks the floating ones that carry a gradient
as leaves that require grad, and keeps what backward needs; a backward receives the
gradients of the stage's outputs, runs autograd through the stage, and returns the
gradients of its inputs, to be sent back to the stages that made them::

      inputs (leaves) ──▶ stage j ──▶ outputs ────send───▶ consumers
      input grads ◀──── autograd ◀── output grads ◀─recv── consumers

Every pass runs through the stage call (:class:`fxpipe.runtime.stage.stagecall.StageCall`): with
checkpointing, the forward runs under ``no_grad`` and keeps only the inputs and the replay
point; the backward first recomputes the forward with the same random numbers (on the last
stage, its loss too: :mod:`fxpipe.runtime.stage.lossreplay`). A stage whose
schedule has ``W`` steps (``defer=True``) queues its linears' weight gradients per
micro-batch (:mod:`fxpipe.runtime.stage.wgrad`): ``I`` computes the input gradients only, ``W``
the queued weight gradients, and ``B`` both at once. Where the program runs a micro-batch's ``W``
right after its ``I`` (the first stage of ZB-H1, which sends no input gradients), deferring
would only cost: the ``W`` would read its inputs back from memory after the whole backward, so
that micro-batch is not deferred (:attr:`StageWorker.fused`) and its ``I`` is the whole backward. A compiled stage (:mod:`fxpipe.runtime.stage.compiled`)
splits its backward graph instead: its ``I`` runs the input-gradient half and queues the other.

A model input that requires grad (an adversarial example, embeddings a trainable module made
before the pipe) reaches the first stage attached to the user's graph. Backpropagating into
that graph once per micro-batch would traverse its shared part again (an error, or gradients
summed twice), so the stage runs on a detached leaf, keeps each micro-batch's gradient, and
:meth:`StageWorker.released` hands them to the step's one backward into the user's graph at
its end (:class:`~fxpipe.runtime.interpreter.ActionInterpreter`, with a target's: they may share
that graph), as eager's one backward does::

    x ─ split ─┬─ x_0 ··· leaf_0 ─▶ stage 0 ...      backward per micro-batch: leaf_i.grad
               └─ x_1 ··· leaf_1 ─▶ stage 0 ...      release: backward((x_0, x_1), (g_0, g_1))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes.spec import differentiable, unflatten
from fxpipe.runtime.stage import wgrad
from fxpipe.runtime.stage.keepstate import note_written_weights
from fxpipe.runtime.stage.lossreplay import first_loss, replaying
from fxpipe.runtime.stage.owned import owned
from fxpipe.runtime.stage.rng import autocast_off
from fxpipe.runtime.stage.stagecall import StageCall
from fxpipe.runtime.stage.stream import on_device

__all__ = ["StageWorker"]


class StageWorker:
    """Run forwards and backwards of one stage, keeping per-micro-batch state in between."""

    def __init__(self, call: StageCall, input_grads: Sequence[bool], defer: bool = False) -> None:
        self.call = call
        self.index = call.index
        self.device = call.device
        self.input_grads = list(input_grads)  # per input value: does it carry a gradient?
        self.last = call.last
        self._saved: dict[int, tuple] = {}
        self.defer = defer  # queue the linears' weight gradients for weights(i)
        self._weights: dict[int, list] = {}
        # data parallel (:mod:`fxpipe.runtime.dataparallel`): the micro-batch of the stage's last
        # backward of the step, whose weight gradients are never deferred, and what to call
        # before each backward (with whether it is that last one)
        self.final: int | None = None
        self.before_backward: Callable[[bool], None] | None = None
        # the micro-batches whose I the program runs right before their W (nothing between):
        # not deferred (but in a compiled stage), their I is the whole backward, their W finds nothing to do
        self.fused: frozenset[int] = frozenset()
        # model inputs requiring grad: per micro-batch (user's tensor, the leaf the stage ran on),
        # then the gradients found, sent into the user's graph by release()
        self._outside: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._released: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, i: int, inputs: Sequence[Any], *, checkpoint: bool,
                loss: Callable[[Any], torch.Tensor] | None = None, grad: bool = True, saving: str = "forward") -> Any:
        """Run micro-batch ``i``; return the outputs (the weighted loss on the last stage with ``loss``).

        Not checkpointed, the stage runs in pass ``saving``: ``"forward"``, or its policy's
        ``"selective"`` or ``"offload"`` (the activations kept elsewhere until the backward).
        """
        call = self.call
        leaves = [_leaf(v, g and grad) for v, g in zip(inputs, self.input_grads)]
        if grad and torch.is_grad_enabled():
            leaves = self._attached(i, inputs, leaves)
        with call.span("forward", i):
            if not grad:
                with torch.no_grad():
                    out = call.run(i, leaves)
                return loss(out) if loss is not None else out
            if self.defer:
                self._weights[i] = []  # fresh: nothing left from a step that failed
            if not call.trains(leaves):  # a frozen stage with inputs needing no gradient: no backward to redo it for
                checkpoint, saving = False, "forward"
            if checkpoint:
                replay = call.replay_point(leaves)
                out = call.run(i, leaves, "checkpoint")
                if loss is None:
                    self._saved[i] = ("recompute", leaves, replay, None)
                    return out
                result, again = first_loss(loss, out, self.device)
                self._saved[i] = ("recompute", leaves, replay, (loss, again))
                return result.detach()
            with self._collecting(i):
                out = call.run(i, leaves, saving)
                result = loss(out) if loss is not None else out
        self._saved[i] = ("keep", leaves, result)
        return result.detach() if loss is not None else _detached(out)

    def backward(self, i: int, grads: Sequence[Any] | None, kind: str = "B") -> list[Any]:
        """Backpropagate micro-batch ``i`` given its outputs' gradients; return input gradients.

        ``kind`` is ``"B"`` (everything) or ``"I"`` (input gradients; the weight gradients
        wait for :meth:`weights`). ``grads`` aligns with the stage's outputs (None on the
        last stage, whose output is the loss). The result aligns with the inputs: a tensor
        (or structure) for each input that carries a gradient, None for the others.
        """
        saved = self._saved.pop(i)
        if self.before_backward is not None:
            self.before_backward(i == self.final)
        if saved[0] == "recompute":
            _, leaves, replay, loss_and_replay = saved
            with self._collecting(i):
                out = self.call.run(i, leaves, "recompute", replay)
                if loss_and_replay is None:
                    result = out
                else:  # the loss as it ran in forward: its random numbers, its modules' buffers
                    loss, again = loss_and_replay
                    with torch.enable_grad(), replaying(again, self.device):
                        result = loss(out)
        else:
            _, leaves, result = saved
        with on_device(self.device), self.call.span("backward", i), self._deferring(i, kind), autocast_off():
            tensors, grad_tensors = _pairs(result, grads)
            try:
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors)
            except RuntimeError as exc:
                note_written_weights(exc, [self.call.gm])
                raise
            if kind == "B" and self.defer:
                wgrad.run(self._weights.pop(i, []))
        # the gradients wait (a send, the hand-over, the end of the step) while later backwards
        # accumulate into the parameters' .grad: none may share memory with one (stage.owned; the
        # leaves' hooks copied those that did as autograd made them, this checks once more)
        self._released += [(x, owned(leaf.grad)) for x, leaf in self._outside.pop(i, []) if leaf.grad is not None]
        return [owned(_grad_of(leaf)) if g else None for leaf, g in zip(leaves, self.input_grads)]

    @property
    def fetches(self) -> bool:
        """Tell whether the stage's saved activations wait elsewhere and are fetched ahead (offload)."""
        return hasattr(self.call.saver, "prefetch")

    def prefetch(self, i: int) -> None:
        """Start bringing micro-batch ``i``'s saved activations back for its coming backward (offload)."""
        if self.fetches:
            self.call.saver.prefetch(i)

    def weights(self, i: int) -> None:
        """Compute micro-batch ``i``'s deferred weight gradients (after its ``I``)."""
        with on_device(self.device), self.call.span("weight", i), autocast_off():
            wgrad.run(self._weights.pop(i, []))

    def _collecting(self, i: int) -> contextlib.AbstractContextManager:
        """Queue micro-batch ``i``'s weight gradients while deferring; otherwise do nothing."""
        return wgrad.collecting(self._weights[i]) if self._defers(i) else contextlib.nullcontext()

    def _defers(self, i: int) -> bool:
        """Tell whether micro-batch ``i``'s weight gradients wait for its ``W`` (not its last, not fused).

        A compiled stage keeps its split for every micro-batch: its backward graph is cut once,
        into the I and W halves it compiled.
        """
        return self.defer and i != self.final and (i not in self.fused or self.call.compiled is not None)

    def _deferring(self, i: int, kind: str) -> contextlib.AbstractContextManager:
        """In a compiled stage's ``I``, queue micro-batch ``i``'s weight-gradient work for its ``W``."""
        compiled = self.call.compiled
        if compiled is None or kind != "I" or not self._defers(i):
            return contextlib.nullcontext()
        return compiled.deferring(self._weights.setdefault(i, []))

    def discard(self) -> None:
        """Drop what a failed step left: activations awaiting backward, deferred weight gradients."""
        self._saved.clear()
        self._weights.clear()
        self._outside.clear()
        self._released.clear()

    def _attached(self, i: int, inputs: Sequence[Any], leaves: list[Any]) -> list[Any]:
        """Run on detached leaves where a model input requires grad; remember each with its user's tensor."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, (value, g) in enumerate(zip(inputs, self.input_grads)):
            flat, spec = tree_flatten(value)
            if g or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                continue
            new = []
            for t in flat:
                if isinstance(t, torch.Tensor):
                    leaf = t.detach().requires_grad_(t.requires_grad)
                    if t.requires_grad:
                        leaf.register_hook(owned)
                        pairs.append((t, leaf))
                    t = leaf
                new.append(t)
            leaves[k] = spec.unflatten(new)
        if pairs:
            self._outside[i] = pairs
        return leaves

    def released(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return (and forget) the step's model inputs requiring grad with their gradients, for one backward."""
        pairs, self._released = self._released, []
        return pairs

    def pending(self) -> int:
        """Return how many micro-batches hold activations awaiting backward."""
        return len(self._saved)


def _leaf(value: Any, grad: bool) -> Any:
    """Detach a received value; make its floating and complex tensors require grad if it carries one."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        if grad and differentiable(leaf.dtype):
            leaf.requires_grad_(True)
            leaf.register_hook(owned)  # its gradient waits: none may share a parameter's .grad (stage.owned)
        return leaf
    if grad:
        leaves, spec = tree_flatten(value)
        if spec.is_leaf():  # None, a number, a string: nothing to detach
            return value
        return spec.unflatten([_leaf(v, True) for v in leaves])
    return value


def _detached(out: Any) -> Any:
    """Return the outputs with every tensor detached, for sending."""
    leaves, spec = tree_flatten(out)
    return unflatten(spec, [v.detach() if isinstance(v, torch.Tensor) else v for v in leaves])


def _grad_of(leaf: Any) -> Any:
    """Return the gradient of a leaf (None where autograd produced none: no path to the loss)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.grad if leaf.requires_grad else None
    leaves, spec = tree_flatten(leaf)
    if spec.is_leaf():  # None, a number, a string: no gradient
        return None
    return unflatten(spec, [_grad_of(v) for v in leaves])


def _pairs(result: Any, grads: Sequence[Any] | None) -> tuple[list[torch.Tensor], list[Any]]:
    """Match output tensors that require grad with their incoming gradients, value by value."""
    if grads is None:  # the last stage: result is the loss
        return ([result], [None]) if isinstance(result, torch.Tensor) and result.requires_grad else ([], [])
    tensors, grad_tensors = [], []
    for out, grad in zip(result, grads):
        if grad is None:
            continue
        outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        gs = [grad] if isinstance(grad, torch.Tensor) else tree_flatten(grad)[0]
        for t, g in zip(outs, gs):
            if isinstance(t, torch.Tensor) and t.requires_grad and isinstance(g, torch.Tensor):
                tensors.append(t)
                grad_tensors.append(g)
    return tensors, grad_tensors
