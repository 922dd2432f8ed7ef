"""Rewrite the sizes a trace baked into reshapes of sharded values into the sizes one rank holds.

Reads:  ``node.meta["fxpipe.tp"]`` (:func:`fxpipe.passes.tplayout.propagate` with ``record=True``) and
        ``node.meta["fxpipe.value"]`` (global shapes).
Writes: the size arguments of ``view``, ``reshape``, ``expand`` and ``unflatten`` nodes whose output
        is a local shard; a ``floordiv`` node before one whose size is computed from a whole value.

With column-wise projections each rank holds ``heads / t`` heads, so a model's
``q.view(b, s, 12, 64)`` is wrong on every rank. Module-level tensor parallelism needs the model
written with ``-1`` or a local head count; here the graph knows which dim of each value is
sharded, so the constant at that dim is divided::

    view(q, b, s, 12, 64)         q: (b, s, 768) sharded on dim 2    ─▶ view(q, b, s, 6, 64)   (t=2)
    expand(k, [b, 2, 2, s, 8])     GQA: 2 key/value heads on dim 1    ─▶ expand(k, [b, 1, 2, s, 8])
    view(x, b, s, x.size(-1))      the size is already local ("L")   ─▶ unchanged
    view(x, b, s, h.size(-1))      h whole: its size is global       ─▶ view(x, b, s, h.size(-1) // 2)

``-1`` stays. Splits along a sharded dim are refused by the propagation, not rewritten.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx
from fxpipe.passes.tpops import ndim_of, op_name, shape_of

__all__ = ["rewrite_sizes"]

_SIZED = {"view", "reshape", "_unsafe_view", "expand"}


def rewrite_sizes(gm: torch.fx.GraphModule, t: int) -> list[str]:
    """Make the reshapes of ``gm`` produce local shards; return the names of the nodes rewritten."""
    changed = []
    for node in list(gm.graph.nodes):
        d = node.meta.get("fxpipe.tp")
        name = op_name(node)
        if not isinstance(d, int) or name not in _SIZED | {"unflatten"}:
            continue
        shape = shape_of(node)
        if shape is None:
            continue
        before = (node.args, node.kwargs)
        if name == "unflatten":
            dim = int(node.args[1]) % (ndim_of(node.args[0]) or 1)
            if not dim <= d < dim + len(node.args[2]):
                continue
            node.args = (node.args[0], node.args[1], _replaced(gm, node, list(node.args[2]), d - dim, shape[d], t))
        elif len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
            node.args = (node.args[0], type(node.args[1])(_replaced(gm, node, list(node.args[1]), d, shape[d], t)))
        elif "size" in node.kwargs or "shape" in node.kwargs:
            key = "size" if "size" in node.kwargs else "shape"
            node.kwargs = {**node.kwargs, key: _replaced(gm, node, list(node.kwargs[key]), d, shape[d], t)}
        else:
            sizes = _replaced(gm, node, list(node.args[1:]), d, shape[d], t)
            node.args = (node.args[0], *sizes)
        if (node.args, node.kwargs) != before:
            changed.append(node.name)
    gm.graph.lint()
    gm.recompile()
    return changed


def _replaced(gm: torch.fx.GraphModule, node: torch.fx.Node, sizes: list[Any], d: int, whole: int, t: int) -> list:
    """Return ``sizes`` with entry ``d`` (the sharded dim, of global size ``whole``) made local."""
    if d >= len(sizes):
        return sizes
    v = sizes[d]
    if isinstance(v, int) and v != -1:
        if v != whole:
            raise ValueError(f"node '{node.name}' reshapes to size {v} on the sharded dim {d}, whose global size "
                             f"is {whole}")
        sizes[d] = v // t
    elif isinstance(v, torch.fx.Node) and v.meta.get("fxpipe.tp") != "L":
        with gm.graph.inserting_before(node):
            local = gm.graph.call_function(operator.floordiv, (v, t))
        local.meta = {"fxpipe.value": whole // t, "fxpipe.tp": "L"}
        sizes[d] = local
    return sizes
