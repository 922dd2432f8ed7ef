"""Neighbouring cuts: one stage boundary moved to the nearest cut as narrow, either way.

Reads:  a :class:`~fxpipe.passes.partition.Partition` (its order, starts and cut widths), the cost
        annotations :func:`fxpipe.passes.partition.partition` reads.
Writes: :func:`recut` writes ``node.meta["fxpipe.stage"]`` and ``fxpipe.position`` as the partition does.

In a stack of equal blocks the narrowest cuts are where only the residual stream crosses: a
block boundary (or the middle of a block, between its attention and its MLP). Moving a stage
boundary to the next such cut gives one stage a block (or half) less and its neighbour one more,
which changes what fits in memory more than any other small move::

    balanced   | b0 b1 b2 | b3 b4 b5 |          cut widths w[p]: ▁ at block boundaries
    moved left | b0 b1 | b2 b3 b4 b5 |          the first stage (which 1F1B loads most) lighter

No stage begins where an in-place op would be cut from the values it changes
(:func:`fxpipe.passes.inplace.joined_positions`), and none is left empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx
from fxpipe.passes.cost import memory_factors, node_costs, node_memory
from fxpipe.passes.cut import group_costs
from fxpipe.passes.inplace import joined_positions
from fxpipe.passes.partition import Partition, assign_stages

__all__ = ["neighbours", "recut"]


def neighbours(gm: torch.fx.GraphModule, cut: Partition) -> list[list[int]]:
    """Return the cuts with one boundary of ``cut`` moved to the nearest position, before or after it,
    where no more bytes cross than where it is."""
    joined = joined_positions(gm, cut.order)
    starts, w, n = cut.starts, cut.widths, len(cut.order)
    out = []
    for b in range(1, len(starts)):
        here = starts[b]
        low, high = starts[b - 1] + 1, (starts[b + 1] if b + 1 < len(starts) else n) - 1
        for way in (range(here - 1, low - 1, -1), range(here + 1, high + 1)):
            for p in way:
                if p not in joined and w[p] <= w[here] * (1 + 1e-9):
                    out.append(starts[:b] + [p] + starts[b + 1:])
                    break
    return out


def recut(gm: torch.fx.GraphModule, cut: Partition, starts: Sequence[int], *, balance_by: str = "flops",
          comm: float | Sequence[float] = 0.0, checkpoint: str = "never", micro_batches: int = 1) -> Partition:
    """Assign ``gm``'s nodes to the stages beginning at ``starts`` of ``cut``'s order; return that cut.

    Stage costs and memory estimates are the partition's (:mod:`fxpipe.passes.cost`).
    """
    order, widths = cut.order, cut.widths
    assign_stages(gm, list(starts), order)
    f_act, f_in = memory_factors(checkpoint, micro_batches)
    costs = node_costs(order, balance_by, f_act)
    if not any(costs):
        costs = [1.0] * len(order)
    rho = f_in if balance_by == "memory" else 0.0
    memory = group_costs([node_memory(n, f_act) for n in order], widths, starts, 0.0, f_in)
    return Partition(order, list(starts), group_costs(costs, widths, starts, comm, rho), widths, memory)
