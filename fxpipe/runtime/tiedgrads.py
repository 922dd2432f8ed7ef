"""Sum the gradients of parameters tied across ranks once per accumulation window, like eager.

A parameter read by stages on several ranks (tied embeddings) lives on each of them; after a
synced step each holds the tie's summed gradient. Gradients may accumulate over several steps
before the optimizer runs (``pipe.no_sync()`` steps, or plain steps without ``zero_grad``):
summing the whole accumulated ``.grad`` again would count what an earlier sum already made
equal on every rank once per rank. So the part already summed is set aside when the window
opens (at the first step after a sum) and only what was added since is summed::

    window opens   before = p.grad (summed, the same on every rank; None after zero_grad)
    steps          p.grad = before + this rank's new gradients
    synced step    p.grad = before + sum over the tie of (p.grad - before)

A sparse gradient (``nn.Embedding(sparse=True)``) is summed as one: gloo all-reduces sparse
tensors; another backend sums it dense and hands it back sparse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpipe.runtime import gradnorm

__all__ = ["open_window", "sum_tied"]


def open_window(tied: list[tuple[Any, list, bool]]) -> dict[int, torch.Tensor]:
    """Return the tied gradients already summed (by parameter id), set aside as the window opens."""
    before: dict[int, torch.Tensor] = {}
    for _, params, _ in tied:
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                before[id(p)] = p.grad.detach().clone()
            elif p.grad is not None and bool(gradnorm.local(p.grad).any()):  # a zeroed gradient: nothing to keep
                before[id(p)] = gradnorm.local(p.grad).detach().clone()
    return before


def _reached(group: Any, params: list) -> list[tuple[torch.Tensor, bool]]:
    """Return ``(param, sparse)`` for the trainable ``params`` some rank of the tie holds a gradient of.

    A parameter no rank's backward reached (a critic-only step of a model whose actor is read on
    two ranks) keeps ``.grad`` None on every rank, as eager's: zeros would move it under Adam.
    ``sparse``: some rank's gradient is sparse (one small all-reduce tells both).
    """
    trainable = [p for p in params if p.requires_grad]  # frozen on every rank alike (the same model): None
    if not trainable:
        return []
    flags = torch.tensor([[p.grad is not None, p.grad is not None and p.grad.is_sparse] for p in trainable],
                         dtype=torch.int32, device=trainable[0].device)
    dist.all_reduce(flags, group=group)
    return [(p, bool(sparse)) for p, (flag, sparse) in zip(trainable, flags.tolist()) if flag]


def _sum_sparse(p: torch.Tensor, base: torch.Tensor | None, group: Any) -> None:
    """Sum a sparse tied gradient over the tie (what was added since ``base``), in ``p.grad``."""
    grad = p.grad if p.grad is not None else torch.sparse_coo_tensor(
        torch.empty(1, 0, dtype=torch.long, device=p.device), p.new_empty(0, *p.shape[1:]), p.shape)
    added = (grad - base if base is not None else grad).coalesce()
    if dist.get_backend(group) == "gloo":  # sums sparse tensors in place
        dist.all_reduce(added, group=group)
        total = added
    else:
        dense = added.to_dense()
        dist.all_reduce(dense, group=group)
        total = dense.to_sparse(sparse_dim=grad.sparse_dim())
    p.grad = (total + base if base is not None else total).coalesce()


def sum_tied(tied: list[tuple[Any, list, bool]], before: dict[int, torch.Tensor], wait: Any) -> None:
    """Sum over each tie what each rank added to its tied gradients since ``before``; ``wait(works, what)``."""
    kept = []
    for group, params, _ in tied:
        works = []
        for p, sparse in _reached(group, params):
            if sparse:
                _sum_sparse(p, before.get(id(p)), group)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not gradnorm.local(p.grad).is_contiguous():  # a transposed product (a DTensor's shard)
                p.grad = p.grad.contiguous()
            local = gradnorm.local(p.grad)
            base = before.get(id(p))
            if base is not None:
                local.sub_(base)
                kept.append((local, base))
            works.append(dist.all_reduce(local, group=group, async_op=True))
        wait(works, "summing the gradients of tied parameters")
    for local, base in kept:
        local.add_(base)
