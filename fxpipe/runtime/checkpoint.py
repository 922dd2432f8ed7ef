"""Activation checkpointing with recomputation on a side branch and replayed RNG state.

:class:`Checkpoint` runs a stage under ``no_grad`` and saves the RNG state. :class:`Recompute`
hangs off the stage's output through a fork/join pair, so that in backward it runs *before*
the checkpoint's own backward, as soon as the output's gradient is due (torchgpipe, 3.2.3)::

           ┌──────── Checkpoint (no_grad forward) ──▶ y ──Fork──▶ y' ──Join──▶ y''
    inputs ┤                                                │          ▲
           └──────── Recompute (identity in forward) ◀──phony┘   phony─┘

    backward: Join ─▶ Recompute (replay forward with grad, same RNG) ─▶ Fork ─▶ Checkpoint
              (backward through the recomputed graph, gradients to the inputs)

Recomputation restores the CPU RNG state and that of the stage's CUDA device, so dropout
draws the same mask. :func:`is_checkpointing` and :func:`is_recomputing` tell a module which
pass it is in.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.tools import recorder
from fxpipe.runtime.dependency import fork, get_phony, join

__all__ = ["is_checkpointing", "is_recomputing", "checkpointed"]


class _State(threading.local):
    """Per-thread flags telling which pass a stage's forward is in."""

    checkpointing = False
    recomputing = False


_state = _State()


def is_checkpointing() -> bool:
    """Tell whether the current forward runs under checkpointing (its activations are dropped)."""
    return _state.checkpointing


def is_recomputing() -> bool:
    """Tell whether the current forward is a recomputation for backward."""
    return _state.recomputing


@contextmanager
def _flag(name: str) -> Iterator[None]:
    """Set one of the per-thread pass flags for the block."""
    previous = getattr(_state, name)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def _save_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capture the CPU RNG state and that of ``device`` if it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _restore_rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run the block with a saved RNG state, then put back the state from before."""
    cpu, cuda = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class _Record:
    """What a checkpointed call shares between its Checkpoint and Recompute nodes."""

    def __init__(self, function: Callable[..., tuple], device: torch.device) -> None:
        self.function = function
        self.device = device
        self.rng: tuple | None = None
        self.recomputed: deque = deque(maxlen=1)
        self.where = recorder.where()  # timeline: the stage call being recorded, if any

    def replay(self, inputs: tuple) -> None:
        """Recompute the forward with grad and the saved RNG state; keep the result."""
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        assert self.rng is not None
        with _restore_rng(self.device, self.rng), torch.enable_grad(), _flag("recomputing"), \
                recorder.span_at("recompute", self.where):  # timeline
            outputs = self.function(*leaves)
        self.recomputed.append((outputs, leaves))


class Checkpoint(torch.autograd.Function):
    """Run the function without keeping activations; backpropagate through its recomputation."""

    @staticmethod
    def forward(ctx, phony, record: _Record, *inputs):  # type: ignore[override]
        ctx.record = record
        ctx.save_for_backward(*inputs)
        record.rng = _save_rng(record.device)
        with torch.no_grad(), _flag("checkpointing"):
            return record.function(*inputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        record: _Record = ctx.record
        if not record.recomputed:  # the side branch was not reached: recompute here
            record.replay(ctx.saved_tensors)
        outputs, leaves = record.recomputed.pop()
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in leaves)


class Recompute(torch.autograd.Function):
    """Pass a phony through in forward; recompute the checkpointed function in backward."""

    @staticmethod
    def forward(ctx, phony, record: _Record, *inputs):  # type: ignore[override]
        ctx.record = record
        ctx.save_for_backward(*inputs)
        return phony.detach()

    @staticmethod
    def backward(ctx, grad_phony):  # type: ignore[override]
        ctx.record.replay(ctx.saved_tensors)
        return (None, None) + (None,) * len(ctx.saved_tensors)


def _flatten(value: Any) -> tuple[list, Any]:
    """Flatten a value into leaves; a plain tuple of tensors (the common case) skips pytree."""
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), None
    return tree_flatten(value)


def _unflatten(leaves: list, spec: Any) -> Any:
    """Invert :func:`_flatten`."""
    return tuple(leaves) if spec is None else tree_unflatten(leaves, spec)


def checkpointed(function: Callable[..., Any], inputs: tuple, device: torch.device) -> Any:
    """Call ``function(*inputs)`` without keeping its activations; recompute them in backward.

    ``inputs`` and the result may hold any structure of tensors and other values; only the
    tensors pass through autograd.
    """
    in_leaves, in_spec = _flatten(inputs)
    in_idx = [k for k, v in enumerate(in_leaves) if isinstance(v, torch.Tensor)]
    tensors = tuple(in_leaves[k] for k in in_idx)
    # Keep only the structure and the non-tensor values: the tensors reach the function as
    # arguments (saved by autograd), and holding them here would keep every micro-batch's
    # inputs and outputs alive as long as the autograd graph.
    frame = [None if isinstance(v, torch.Tensor) else v for v in in_leaves]
    shape: dict[str, Any] = {}

    def flat_function(*args: torch.Tensor) -> tuple:
        leaves = list(frame)
        for k, t in zip(in_idx, args):
            leaves[k] = t
        out_leaves, out_spec = _flatten(function(*_unflatten(leaves, in_spec)))
        shape["spec"] = out_spec
        shape["tensor_at"] = {k for k, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)}
        shape["frame"] = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        return tuple(v for v in out_leaves if isinstance(v, torch.Tensor))

    record = _Record(flat_function, device)
    phony = get_phony(device, requires_grad=True)
    outputs = list(Checkpoint.apply(phony, record, *tensors))
    # Hang the recomputation off the first output that requires grad.
    for k, y in enumerate(outputs):
        if y.requires_grad:
            outputs[k], branch = fork(y)
            branch = Recompute.apply(branch, record, *tensors)
            outputs[k] = join(outputs[k], branch)
            break
    it = iter(outputs)
    leaves = [next(it) if k in shape["tensor_at"] else v for k, v in enumerate(shape["frame"])]
    return _unflatten(leaves, shape["spec"])
