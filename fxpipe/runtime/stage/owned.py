"""Input gradients that own their memory: nothing later in the step may change them.

A stage's input gradient leaves the stage's backward as the ``.grad`` of the leaf the stage
ran on, and waits: for a send to finish (gloo and NCCL read it after ``isend`` returns), in
the hand-over box until the producing stage's backward, or until the end of the step (a
model input requiring grad). Autograd may have given that leaf a gradient that shares its
memory with a parameter's ``.grad``: an op whose backward hands one tensor to both sides (a
broadcast add of a parameter to the input with a micro-batch of one row, ``table[None] +
t.view(1, 6, -1)`` in PixArt's and DiT's adaLN) and ``AccumulateGrad``, which keeps an
incoming gradient rather than copy it when nothing else holds it::

    table[None] + t.view(1, 6, d) ──▶ dy ──┬─▶ table.grad  (kept: same memory as dy)
                                           └─▶ t.grad = dy.view(1, 6d)  (sent back)
    next micro-batch's backward:  table.grad += dy'   ── changes t.grad in place

The next backward's accumulation into ``table.grad`` (or, with one micro-batch, DDP writing
the replicas' mean into it at the end of this very backward) then changes the gradient this
stage sent, before (or while) the producing stage reads it: wrong gradients upstream, on a
distributed pipe only when the send is slow (a loaded machine). So a stage's leaves carry
:func:`owned` as a hook, which copies a gradient whose memory is shared as autograd makes it
(a view counts as alone only where nothing else holds its base: autograd may
still hand that base to the parameter); one alone on its storage
(nearly all) goes as it is. The same holds for the output gradient a deferred weight gradient
queues for ``W`` (:mod:`fxpipe.runtime.stage.wgrad`).

The same happens inside one autograd graph (``pipe(x)``'s GPipe program): a micro-batch that is
not checkpointed leaves its input gradient pending in autograd's buffers while the next
micro-batch's :class:`~fxpipe.runtime.stage.recompute.Checkpoint` backpropagates through the
same stage, whose accumulation into ``table.grad`` would change that pending gradient.
:func:`unshare_grads` gives such a parameter a ``.grad`` of its own first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes.spec import unflatten

__all__ = ["owned", "unshare_grads"]


def _holders(t: torch.Tensor) -> int:
    """Return how many tensors (and storage objects) refer to ``t``'s memory."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _view_alone() -> tuple[int, int]:
    """Return the counts of a view alone with its base (nothing else holds either), measured as checked."""
    base = torch.empty(2)
    view = base.view(1, 2)
    del base
    return _holders(view), view._base._use_count()  # type: ignore[union-attr]


try:  # the count of a tensor alone on its storage, and of a view alone with its base
    _ALONE: int | None = _holders(torch.empty(1))
    _VIEW_ALONE: tuple[int, int] = _view_alone()
except (AttributeError, RuntimeError):  # a torch without the counts: copy every gradient
    _ALONE = None


def owned(grad: Any) -> Any:
    """Return ``grad`` with every tensor that shares its memory with another tensor copied."""
    if isinstance(grad, torch.Tensor):
        return _own(grad)
    leaves, spec = tree_flatten(grad)
    if spec.is_leaf():  # None, a number, a string
        return grad
    return unflatten(spec, [_own(t) if isinstance(t, torch.Tensor) else t for t in leaves])


def _own(t: torch.Tensor) -> torch.Tensor:
    """Return ``t``, or a copy of it where another tensor shares its memory."""
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard is where its memory is
    if local.layout != torch.strided or type(local) is not torch.Tensor:
        return t  # a sparse gradient: never kept as a dense parameter's .grad
    if _ALONE is None:
        return t.clone()
    n = _holders(local)
    if n <= _ALONE:
        return t
    base = local._base
    if base is not None and n == _VIEW_ALONE[0] and base._use_count() <= _VIEW_ALONE[1]:  # type: ignore[attr-defined]
        return t  # a view of a base nothing else holds (the logits' gradient reshaped): alone too
    return t.clone()


def unshare_grads(params: Iterable[torch.Tensor]) -> None:
    """Give each parameter whose ``.grad`` shares memory with another tensor a copy of its own."""
    for p in params:
        g = p.grad
        if g is not None and _own(g) is not g:
            p.grad = g.clone()
