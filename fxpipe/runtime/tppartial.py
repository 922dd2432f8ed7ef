"""Sum over the tensor-parallel group the gradients each rank computes only in part.

A parameter left whole that an op combines with a shard (Qwen3's per-head ``q_norm`` and
``k_norm``, :mod:`fxpipe.passes.tppartial`) gets from each rank the gradient of its own shard;
eager's is their sum. After a step's backwards the runtime adds the group's parts of what the
step added to these gradients, in one all-reduce per dtype::

    before the step:  g0 = p.grad                     (what earlier steps accumulated, whole)
    after:            p.grad = g0 + Σ_ranks (p.grad - g0)

Only the step's own part is summed, so gradients accumulated over several steps (``no_sync``,
or no ``zero_grad``) are not summed twice. Under FSDP2 the gradients are the replicas' shards,
the same slice on every rank of a tensor-parallel group, so the sum works on the local shards;
and since steps inside ``pipe.no_sync()`` keep theirs in FSDP2's unsharded parameters until the
synced step reduce-scatters them all, the sum there covers the window from its first step
(``window=True``: ``g0`` is taken at the window's first step, the sum made at the synced one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.tensor import DTensor

from fxpipe.passes.tppartial import partial_params

__all__ = ["PartialGrads"]


class PartialGrads:
    """The whole parameters of a rank's stages whose gradients the tensor-parallel group sums."""

    def __init__(self, stages: Sequence[torch.fx.GraphModule], group: Any, window: bool = False) -> None:
        self.group = group
        self.window = window
        self.names = [(gm, name) for gm in stages for name in partial_params(gm)]
        self._before: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def params(self) -> list[torch.Tensor]:
        """Return the parameters as the stages hold them now (FSDP2 swaps them), DTensor shards of a style left out."""
        out: dict[int, torch.Tensor] = {}
        for gm, name in self.names:
            p = gm.get_parameter(name)
            if p.requires_grad and not (isinstance(p, DTensor) and _tp_sharded(p)):
                out[id(p)] = p
        return list(out.values())

    def before(self) -> None:
        """Remember what the parameters' gradients hold before a step (before a window's first, ``window``)."""
        if self.window and self._before is not None:
            return  # inside a no_sync window: its first step's gradients are the base
        self._before = [(p, None if p.grad is None else _local(p.grad).clone()) for p in self.params()]

    def based(self) -> bool:
        """Tell whether a base is held (inside a no_sync window, or a step under way)."""
        return self._before is not None

    def discard(self) -> None:
        """Forget the base of a failed step."""
        self._before = None

    def after(self, sync: bool = True) -> None:
        """Sum over the group what the step (with ``window``: the window, at its synced step) added to each gradient."""
        if self._before is None or (self.window and not sync):
            return
        parts = [(p, g0, _local(p.grad)) for p, g0 in self._before if p.grad is not None]
        self._before = None
        for dtype in dict.fromkeys(g.dtype for _, _, g in parts):
            same = [(g0, g) for _, g0, g in parts if g.dtype == dtype]
            added = torch.cat([(g - g0 if g0 is not None else g).reshape(-1) for g0, g in same])
            dist.all_reduce(added, group=self.group)
            for (g0, g), part in zip(same, added.split([g.numel() for _, g in same])):
                g.copy_(part.view_as(g) if g0 is None else g0 + part.view_as(g))


def _local(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _tp_sharded(p: DTensor) -> bool:
    """Tell whether a DTensor parameter is a tensor-parallel style's (its mesh has a ``tp`` dim)."""
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names
