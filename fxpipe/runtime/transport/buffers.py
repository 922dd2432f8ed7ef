"""Receive buffers that outlive their message: a rank reuses a buffer once nothing holds it.

Every message a rank receives lands in buffers sized from the plan's specs (a channels-last
activation in a buffer of its channels-last order, seen through the view that gives it its
shape back: see :func:`dense`). Allocating them
anew per message costs a host allocation (and, for the sizes of activations, fresh pages to
fault in) on the path between a receive and the compute that needs it. The pool keeps each
buffer after its message, and hands it out again for a message of the same shape and dtype
once nothing but the pool refers to it::

    step k:   RECV_F3 ─▶ buf A ─▶ stage input (detached alias) ─▶ saved for B3 ─▶ B3 done: A idle
    step k:   RECV_F5 ─▶ A is held? no ─▶ reuse A (its pages are warm)

"Nothing refers to it" is checked on the buffer itself: no other Python reference, no other
owner of the tensor (a pending receive, autograd), no other tensor on its storage (a detached
input, a view, a weight gradient's queued ``dy``). A buffer still in use is never handed out;
one of a shape the last step did not ask for is dropped at the next step. Only CPU buffers are
pooled: on a GPU the caching allocator already reuses memory, and a buffer idle for the host
may still be read by a kernel queued on a stream.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes import TensorSpec, differentiable
from fxpipe.passes.spec import unflatten

__all__ = ["BufferPool", "dense", "empty_like_spec", "floating", "tensor_leaves"]


def _use_counts(free: list[torch.Tensor], k: int) -> tuple[int, int, int]:
    """Return the references to ``free[k]``: Python's, the tensor's owners, its storage's tensors."""
    buf = free[k]
    return (sys.getrefcount(buf), buf._use_count(),  # type: ignore[attr-defined]
            torch._C._storage_Use_Count(buf.untyped_storage()._cdata))


try:  # what the counts are for a buffer only the pool holds, measured the way they are checked
    _IDLE: tuple[int, int, int] | None = _use_counts([torch.empty(1)], 0)
except (AttributeError, RuntimeError):  # a torch without these counts: allocate every buffer
    _IDLE = None


class BufferPool:
    """Hand out CPU receive buffers by shape and dtype, reusing those nothing refers to any more."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu" and _IDLE is not None
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._asked: set[tuple] = set()  # the shapes asked for since :meth:`begin`
        self.allocated = 0  # buffers allocated (not reused), for the benchmarks' counts

    def begin(self) -> None:
        """Start a step: drop the buffers of shapes the last step did not ask for (a new layout's)."""
        for key in [k for k in self._free if k not in self._asked]:
            del self._free[key]
        self._asked = set()

    def take(self, shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
        """Return a buffer of ``shape`` and ``dtype``: an idle one of the pool's, or a new one."""
        key = (tuple(shape), dtype)
        if not self.reuse:
            self.allocated += 1
            return torch.empty(shape, dtype=dtype, device=self.device)
        self._asked.add(key)
        free = self._free.setdefault(key, [])
        for k in range(len(free)):
            if _use_counts(free, k) == _IDLE:
                return free[k]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        free.append(buf)
        self.allocated += 1
        return buf

    def clear(self) -> None:
        """Drop every buffer (a failed step)."""
        self._free, self._asked = {}, set()


def floating(spec: Any) -> bool:
    """Tell whether a spec leaf is a floating or complex tensor (one that carries a gradient)."""
    return isinstance(spec, TensorSpec) and differentiable(spec.dtype)


def tensor_leaves(spec: Any, floating_only: bool) -> list[TensorSpec]:
    """Return the tensor specs of a value's spec that a message carries, in flattening order."""
    return [leaf for leaf in tree_flatten(spec)[0]
            if isinstance(leaf, TensorSpec) and (floating(leaf) or not floating_only)]


def dense(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Return ``t`` as the contiguous tensor a message carries for ``spec``.

    A channels-last spec's tensor goes in its channels-last order, as the contiguous
    channels-last permutation of it (NCHW -> NHWC, a view where ``t`` is channels-last)::

        sender:   t (N,C,H,W) channels-last ─▶ permute(0,2,3,1) (N,H,W,C) contiguous ─▶ send
        receiver: buffer (N,H,W,C) ─▶ permute(0,3,1,2) ─▶ (N,C,H,W) channels-last, no copy

    A complex tensor's lazy conjugate (``.conj()``) is resolved: it goes as its real view.
    """
    t = t.resolve_conj().resolve_neg()
    if not spec.channels_last:
        return t.contiguous()
    return t.contiguous(memory_format=spec.memory_format).permute(0, *range(2, t.dim()), 1)


def _dense_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Return the shape of the contiguous buffer that carries a tensor of ``spec``."""
    shape = tuple(spec.shape)
    return (shape[0], *shape[2:], shape[1]) if spec.channels_last else shape


def _restore(spec: TensorSpec) -> tuple[int, ...]:
    """Return the permutation from a channels-last spec's buffer back to the spec's shape."""
    n = len(spec.shape)
    return (0, n - 1, *range(1, n - 1))


def empty_like_spec(spec: Any, pool: BufferPool, floating_only: bool):
    """Take receive buffers for a value's tensors from ``pool``; return (build value, buffers)."""
    leaves, tree = tree_flatten(spec)
    bufs: list[torch.Tensor] = []
    filled: list[Any] = []  # the value's leaves: buffers, and the spec's other leaves
    for leaf in leaves:
        if isinstance(leaf, TensorSpec) and (floating(leaf) or not floating_only):
            buf = pool.take(_dense_shape(leaf), leaf.dtype)
            bufs.append(buf)
            filled.append(buf.permute(*_restore(leaf)) if leaf.channels_last else buf)
        else:
            filled.append(None if floating_only else leaf)
    return (lambda: unflatten(tree, filled)), bufs
