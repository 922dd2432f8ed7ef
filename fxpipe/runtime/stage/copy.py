"""Copy tensors between devices on copy streams, with the stream waits in both directions.

A copy from stage ``a`` to stage ``b`` runs with ``a``'s copy stream and ``b``'s copy stream
both current, so it orders after the producer's queued work and before the consumer's.
Before a stage computes, its compute stream waits for the copy stream (:class:`Wait`); in
backward the same functions run the other way::

    forward:   compute[a] ─wait─▶ copy[a] ══Copy══▶ copy[b] ─wait─▶ compute[b]
    backward:  compute[a] ◀─wait─ copy[a] ◀══Copy══ copy[b] ◀─wait─ compute[b]

``record_stream`` tells the caching allocator that a tensor allocated on one stream is read
on another, so its memory is not reused before the copy finishes. A copy to the CPU is
blocking: a non-blocking one would return pinned memory that the CPU stage could read
before the GPU had written it.

Values may be structures (a tuple model input read by a later stage): every tensor in them
is copied and waited for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes.spec import differentiable, unflatten
from fxpipe.runtime.stage.stream import AbstractStream, current_stream, record_stream, use_stream, wait_stream

__all__ = ["Copy", "Wait", "copy", "transfer", "wait"]


def transfer(tensors, src: AbstractStream, dst: AbstractStream, to: torch.device, reader: AbstractStream):
    """Copy ``tensors`` to device ``to`` with ``src`` and ``dst`` current; return the copies."""
    out: deque = deque()
    with use_stream(src), use_stream(dst):
        for x in tensors:
            if x is None:
                out.append(None)
                continue
            y = x.to(to, non_blocking=to.type != "cpu")  # the host reads a CPU copy at once
            record_stream(x, src)
            record_stream(y, reader)
            out.append(y)
    return tuple(out)


class Copy(torch.autograd.Function):
    """Copy tensors from ``src``'s device to ``dst``'s device; copy gradients back."""

    @staticmethod
    def forward(ctx, src: AbstractStream, dst: AbstractStream, to: torch.device, *tensors):  # type: ignore[override]
        ctx.src, ctx.dst = src, dst
        ctx.set_materialize_grads(False)  # a tensor the loss does not reach passes None back, not zeros
        ctx.back = tensors[0].device
        return transfer(tensors, src, dst, to, current_stream(to))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None) + transfer(grads, ctx.src, ctx.dst, ctx.back, current_stream(ctx.back))


class Wait(torch.autograd.Function):
    """Make ``dst`` wait for ``src`` before using the tensors; the reverse in backward."""

    @staticmethod
    def forward(ctx, src: AbstractStream, dst: AbstractStream, *tensors):  # type: ignore[override]
        ctx.src, ctx.dst = src, dst
        ctx.set_materialize_grads(False)
        wait_stream(dst, src)
        return tuple(x.detach() for x in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        wait_stream(ctx.src, ctx.dst)
        return (None, None) + grads


def _tensor_leaves(values: tuple, keep: Callable[[torch.Tensor], bool]) -> tuple[list, Any, list[int]]:
    """Flatten ``values``; return the leaves, their structure and the indices of the tensors kept."""
    leaves, spec = tree_flatten(values)
    return leaves, spec, [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and keep(v)]


def _replaced(leaves: list, spec: Any, idx: list[int], new: tuple) -> tuple:
    """Rebuild the structure with the leaves at ``idx`` replaced by ``new``."""
    for k, y in zip(idx, new):
        leaves[k] = y
    return unflatten(spec, leaves)


def copy(values: tuple, src: AbstractStream, dst: AbstractStream, to: torch.device) -> tuple:
    """Copy the tensors in ``values`` (at any depth) to device ``to``; other values pass through."""
    leaves, spec, idx = _tensor_leaves(values, lambda t: True)
    if not idx:
        return values
    tensors = [leaves[k] for k in idx]
    if src is None and dst is None:  # CPU to CPU, or a host device without streams
        moved = tuple(t.to(to) for t in tensors)
    else:
        moved = Copy.apply(src, dst, to, *tensors)
    return _replaced(leaves, spec, idx, moved)


def wait(values: tuple, src: AbstractStream, dst: AbstractStream) -> tuple:
    """Make stream ``dst`` wait for ``src`` before it reads the tensors in ``values`` (at any depth)."""
    if src is None or dst is None or src == dst:
        return values
    leaves, spec, idx = _tensor_leaves(values, lambda t: differentiable(t.dtype))
    if not idx:
        wait_stream(dst, src)
        return values
    waited = Wait.apply(src, dst, *[leaves[k] for k in idx])
    return _replaced(leaves, spec, idx, waited)
