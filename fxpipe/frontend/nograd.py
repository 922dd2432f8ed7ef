"""Keep a forward's ``torch.no_grad()`` blocks in an fx trace: their values leave them detached.

torch.fx records calls, not grad mode: the code of ``with torch.no_grad():`` (a frozen teacher,
a position table under ``@torch.no_grad()``) runs at trace time like any other, and the graph
would let gradients flow through it into parameters eager never trains. While fxpipe traces,
each node made where grad mode is off is marked (``fxpipe.no_grad``); afterwards every value
such a block computes is detached right after it (a stage boundary may fall inside the block)::

    with torch.no_grad():                t = a(x)            (marked)
        t = self.a(x)                    t_1 = detached(t)   read by every node that read t
    h = self.b(x) + t                    add(b, t_1)

The block's ops still run with autograd on, but nothing after it reaches back through them:
the gradients equal eager's.

Reads:  ``fxpipe.no_grad`` in ``node.meta`` (written by the tracer while tracing).
Writes: ``detached`` nodes into the graph, after each marked node that has users, marked
        ``fxpipe.detaches`` (the partition keeps each in the stage of the node it detaches).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

from fxpipe.passes.mutates import aliases, written_args

__all__ = ["detach_no_grad_blocks", "detached"]

_CALLS = ("call_function", "call_method", "call_module")


def detached(value: Any) -> Any:
    """Return ``value`` with every tensor in it detached."""
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


# a detached tensor shares its argument's storage: an in-place op on it writes that argument (a buffer's
# ``ema.mul_(0.9).add_(x)`` in a no-grad block, detached between the two ops), as passes.mutates.aliases reads it
detached.shares_storage_of = (0,)  # type: ignore[attr-defined]


def _marked(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` was made inside a no-grad block (and computes: not a placeholder nor an attribute)."""
    return node.op in _CALLS and bool(node.meta.get("fxpipe.no_grad"))


def _write_through_detached(gm: torch.fx.GraphModule) -> int:
    """Make each in-place write a no-grad block makes to a tensor from outside it go through a detached alias.

    Eager writes a parameter in place inside ``torch.no_grad()`` (an ActNorm set from the data:
    ``self.loc.copy_(...)``); with autograd on, as the block runs here, the write is refused ("a
    leaf Variable that requires grad is being used in an in-place operation"), or recorded: a
    masked gradient (``g[:, 0] = 0``, ``torch.clamp_(g, ...)``) then stopped the gradient eager
    passes through. The alias shares the tensor's storage and version counter, so the write lands
    where eager's does. Methods, functions and ``operator.setitem`` alike (what
    :func:`~fxpipe.passes.mutates.written_args` finds written).
    """
    count = 0
    for node in list(gm.graph.nodes):
        if not _marked(node) or node.op not in ("call_method", "call_function") or not node.args:
            continue
        if isinstance(node.kwargs.get("out"), torch.fx.Node):  # torch.clamp(g, max=0.2, out=g): autograd refuses
            outside = [a for a in node.all_input_nodes if not _marked(a)]  # any input requiring grad: detach each
            for a in outside:
                with gm.graph.inserting_before(node):
                    alias = gm.graph.call_function(detached, (a,))
                alias.meta["fxpipe.detaches"] = True
                node.replace_input_with(a, alias)
            count += len(outside)
            continue
        target = node.args[0]
        if not isinstance(target, torch.fx.Node) or target not in written_args(node):
            continue
        writer = node
        while _marked(target) and target.args and len(aliases(target)) == 1:
            writer, target = target, aliases(target)[0]  # a view the block took of it: g.view(-1)[::3] = 0
        if _marked(target) or not isinstance(target, torch.fx.Node):
            continue  # a tensor the block made itself: detached after it anyway
        with gm.graph.inserting_before(writer):
            alias = gm.graph.call_function(detached, (target,))
        alias.meta["fxpipe.detaches"] = True
        writer.args = (alias, *writer.args[1:])
        count += 1
    return count


def detach_no_grad_blocks(gm: torch.fx.GraphModule) -> int:
    """Detach each value a no-grad block computes, for every node that reads it; return how many were.

    Every value, not only those read after the block: a stage boundary may fall inside the
    block, and a value crossing it must not carry a gradient back either.
    """
    count = _write_through_detached(gm)
    for node in list(gm.graph.nodes):
        if not _marked(node) or not node.users:
            continue
        users = list(node.users)
        with gm.graph.inserting_after(node):
            cut = gm.graph.call_function(detached, (node,))
        cut.meta["fxpipe.detaches"] = True  # kept in its producer's stage (passes.inplace.joined_positions)
        for user in users:
            user.replace_input_with(node, cut)
        count += 1
    if count:
        gm.recompile()
    return count
