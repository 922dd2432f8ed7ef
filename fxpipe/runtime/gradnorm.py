"""The norm of the whole model's gradients across ranks, and the parameters each rank clips.

Each rank holds its stages' parameters (shards of them under FSDP2). The norm sums each rank's
share over the pipeline (and over the replicas' shards; replicated gradients are equal, so
one replica counts), counting a tensor tied across ranks once, on the tie's lowest rank, so it
equals ``torch.nn.utils.clip_grad_norm_``'s norm over the unpipelined model. Under tensor
parallelism a DTensor sharded over ``tp`` counts its shard on every rank of the group (the sum
over the group is the whole), and a tensor whole on every rank of the group counts once, on
its first rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["held", "local", "total_norm"]


def local(t: torch.Tensor) -> torch.Tensor:
    """Return the part of a (possibly sharded DTensor) gradient this process holds."""
    return t.to_local() if hasattr(t, "to_local") else t


def held(runtime: Any, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return the parameters of ``params`` that this rank's stages hold."""
    mine = {id(p) for w in runtime.workers.values() for p in w.call.gm.parameters()}
    return [p for p in params if id(p) in mine]


def _sharded_over_tp(p: torch.Tensor) -> bool:
    """Tell whether a parameter is a DTensor sharded over the ``tp`` mesh dim (each rank holds its part)."""
    mesh = getattr(p, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return "tp" in names and p.placements[names.index("tp")].is_shard()  # type: ignore[attr-defined]


def _values(grad: torch.Tensor) -> torch.Tensor:
    """Return what a gradient's norm is taken over: a sparse one's values (its norm has no sparse kernel)."""
    return grad.coalesce().values() if grad.is_sparse else grad


def total_norm(runtime: Any, params: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Return the norm of order ``norm_type`` of every stage's gradients, the same on every rank."""
    not_mine = {id(p) for _, tied, first in runtime.tied if not first for p in tied}  # counted on the tie's first
    layout = runtime.layout
    whole_elsewhere = layout.tp > 1 and layout.tp_index != 0  # tensors whole over tp count on its first rank
    counted = [_values(local(p.grad)) for p in held(runtime, params) if id(p) not in not_mine and p.grad is not None
               and not (whole_elsewhere and not _sharded_over_tp(p))]
    device = runtime.device
    part = torch.nn.utils.get_total_norm(counted, norm_type) if counted else torch.zeros((), device=device)
    # reduced in float64 (a float64 model's norm was rounded to float32), with a flag beside it saying
    # whether any rank's gradients are float64: every rank then returns eager's dtype, the same everywhere
    wide = float(bool(counted) and part.dtype == torch.float64)
    inf = float("inf")
    if norm_type == -inf:  # the least over ranks, taken as the most of the negated (a rank holding none: no part)
        part = -part if counted else torch.full((), -inf, device=device)
    elif norm_type not in (inf, 0):  # a 0-"norm" counts the nonzero entries: the counts add
        part = part.double() ** norm_type if counted else part.double()  # none held: adds 0 (0 ** -1 is inf)
    part = part.to(device=device, dtype=torch.float64)
    # and a flag for a NaN: a max over ranks may drop one (gloo's kept the other rank's number, and
    # error_if_nonfinite let a NaN gradient step)
    both = torch.stack([part, torch.tensor(wide, device=device, dtype=torch.float64), part.isnan().double()])
    groups = [layout.pp_group] + ([layout.dp_group] if runtime.grad_sync is not None and runtime.grad_sync.shard
                                  else [])  # replicated gradients are equal on every replica: count one
    groups += [layout.tp_group] if layout.tp > 1 else []
    most = abs(norm_type) == inf
    for group in groups:  # the flags add (+-inf: take the max): above 0 where any rank's is float64 (or NaN)
        dist.all_reduce(both, op=dist.ReduceOp.MAX if most else dist.ReduceOp.SUM, group=group)
    norm = both[0] if norm_type in (inf, 0) else -both[0] if norm_type == -inf else both[0] ** (1.0 / norm_type)
    norm = torch.where(both[2] > 0, torch.full_like(norm, float("nan")), norm)
    return norm.to(torch.float64 if bool(both[1] > 0) else torch.float32)
