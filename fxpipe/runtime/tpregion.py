"""One backward all-reduce for the column-wise linears that read one input (Megatron's fused QKV count).

PyTorch's ``ColwiseParallel`` turns each linear's whole input into a DTensor of its own, whose
backward all-reduces that linear's partial input gradient: query, key and value projections of
one input run three all-reduces, a SwiGLU's gate and up two. Megatron fuses them into one linear
(one all-reduce). Here the graph shows which linears share an input, so the stage gets one
region node before them instead::

    x ─▶ q, k, v  (3 backward all-reduces)     x ─▶ region ─▶ q, k, v   (region: x as a Replicate DTensor;
                                                                          backward: the summed partial gradient,
                                                                          all-reduced once)

The linears see a DTensor already, so ``ColwiseParallel`` uses it as it is; their styles are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["Region", "share_input_gradients"]

log = logging.getLogger(__name__)


class _ToRegion(torch.autograd.Function):
    """A whole local tensor as a Replicate DTensor; its partial gradient reduced once, back to local."""

    @staticmethod
    def forward(ctx, x, mesh):  # type: ignore[override]
        """Wrap ``x`` (the same on every rank of the mesh) as a Replicate DTensor, without communication."""
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        """Sum the linears' partial gradients over the ranks (one all-reduce) and return the local whole."""
        if isinstance(grad, DTensor):
            if not all(isinstance(p, Replicate) for p in grad.placements):
                grad = grad.redistribute(grad.device_mesh, [Replicate()])
            grad = grad.to_local()
        return grad, None


class Region(nn.Module):
    """The region node before column-wise linears sharing an input (see the module's picture)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> Any:
        """Return ``x`` as a Replicate DTensor whose backward all-reduces once."""
        return _ToRegion.apply(x, self.mesh)


def share_input_gradients(st: torch.fx.GraphModule, calls: Sequence[torch.fx.Node], mesh: Any) -> int:
    """Put one region node before each group of ``calls`` (column-wise linears) reading one input; return the groups."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for call in calls:
        x = call.args[0]
        if isinstance(x, torch.fx.Node) and x.meta.get("fxpipe.tp") is None:
            groups.setdefault(x, []).append(call)
    made = 0
    for x, readers in groups.items():
        if len(readers) < 2:
            continue
        name = f"fxpipe_tp_region_{made}"
        st.add_submodule(name, Region(mesh))
        with st.graph.inserting_before(readers[0]):
            region = st.graph.call_module(name, (x,))
        region.meta = {k: v for k, v in x.meta.items() if k in ("fxpipe.value", "fxpipe.stage")}
        for call in readers:
            call.args = (region, *call.args[1:])
        made += 1
    if made:
        st.recompile()
        log.debug("%d group(s) of column-wise linears share one backward all-reduce", made)
    return made
