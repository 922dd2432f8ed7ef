"""Copy tensors between devices on copy streams, with the stream waits in both directions.

A copy from stage ``a`` to stage ``b`` runs with ``a``'s copy stream and ``b``'s copy stream
both current, so it orders after the producer's queued work and before the consumer's.
Before a stage computes, its compute stream waits for the copy stream (:class:`Wait`); in
backward the same functions run the other way::

    forward:   compute[a] ─wait─▶ copy[a] ══Copy══▶ copy[b] ─wait─▶ compute[b]
    backward:  compute[a] ◀─wait─ copy[a] ◀══Copy══ copy[b] ◀─wait─ compute[b]

``record_stream`` tells the caching allocator that a tensor allocated on one stream is read
on another, so its memory is not reused before the copy finishes.
"""

from __future__ import annotations

from collections import deque

import torch

from fxpipe.runtime.stream import AbstractStream, current_stream, record_stream, use_stream, wait_stream

__all__ = ["Copy", "Wait", "copy", "wait", "transfer"]


def transfer(tensors, src: AbstractStream, dst: AbstractStream, to: torch.device, reader: AbstractStream):
    """Copy ``tensors`` to device ``to`` with ``src`` and ``dst`` current; return the copies."""
    out: deque = deque()
    with use_stream(src), use_stream(dst):
        for x in tensors:
            if x is None:
                out.append(None)
                continue
            y = x.to(to, non_blocking=True)
            record_stream(x, src)
            record_stream(y, reader)
            out.append(y)
    return tuple(out)


class Copy(torch.autograd.Function):
    """Copy tensors from ``src``'s device to ``dst``'s device; copy gradients back."""

    @staticmethod
    def forward(ctx, src: AbstractStream, dst: AbstractStream, to: torch.device, *tensors):  # type: ignore[override]
        ctx.src, ctx.dst = src, dst
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
        wait_stream(dst, src)
        return tuple(x.detach() for x in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        wait_stream(ctx.src, ctx.dst)
        return (None, None) + grads


def copy(values: tuple, src: AbstractStream, dst: AbstractStream, to: torch.device) -> tuple:
    """Copy the tensors among ``values`` to device ``to``; other values pass through."""
    idx = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if not idx:
        return values
    tensors = [values[k] for k in idx]
    if src is None and dst is None:  # CPU to CPU, or a host device without streams
        moved = tuple(t.to(to) for t in tensors)
    else:
        moved = Copy.apply(src, dst, to, *tensors)
    out = list(values)
    for k, y in zip(idx, moved):
        out[k] = y
    return tuple(out)


def wait(values: tuple, src: AbstractStream, dst: AbstractStream) -> tuple:
    """Make stream ``dst`` wait for ``src`` before it reads the tensors among ``values``."""
    if src is None or dst is None or src == dst:
        return values
    idx = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not idx:
        wait_stream(dst, src)
        return values
    waited = Wait.apply(src, dst, *[values[k] for k in idx])
    out = list(values)
    for k, y in zip(idx, waited):
        out[k] = y
    return tuple(out)
