"""Give each call a fresh copy of a traced tensor constant the graph writes in place, as eager makes it anew.

torch.fx runs a call whose arguments are all constants (``torch.zeros(4, 16)``) while tracing
and keeps its result as an attribute of the GraphModule (``_tensor_constant0``). Eager makes
that tensor on every call; the graph reads the one attribute. Where the graph then writes it in
place (``torch.zeros(4, 16).index_add_(0, batch, h)``, a per-group pooling), every call and
every micro-batch would add into the sums of the calls before::

    eager:  zeros ─▶ index_add_ ─▶ ...          (a new zeros per call)
    graph:  _tensor_constant0 ─▶ index_add_      (one tensor, summed into across calls)
    here:   _tensor_constant0 ─▶ clone ─▶ index_add_

Reads:  the ``get_attr`` nodes of fx's tensor constants (``_tensor_constant<i>``), and the
        in-place writes (:func:`fxpipe.passes.mutates.written_args`) through their aliases.
Writes: a ``clone`` after each such constant, read by all its former users.
"""

from __future__ import annotations

import re

import torch
import torch.fx
from fxpipe.passes.mutates import alias_closure, written_args

__all__ = ["fresh_constants"]


def _constants(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, None]:
    """Return the ``get_attr`` nodes of fx's tensor constants (``_tensor_constant<i>``, which GraphModule makes buffers)."""
    return {node: None for node in gm.graph.nodes
            if node.op == "get_attr" and re.fullmatch(r"_tensor_constant\d+", str(node.target))}


def fresh_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Clone each tensor constant ``gm`` writes in place once per call, before its first read; return their names.

    fx fetches the constant anew (another ``get_attr`` node) wherever the code reads it again
    (``sums.index_add_(...)`` then ``self.b(sums)``): every fetch of a written constant reads the clone.
    """
    constants = _constants(gm)
    if not constants:
        return []
    written: dict[str, None] = {}
    for node in gm.graph.nodes:
        for arg in written_args(node):
            for target in (arg if isinstance(arg, (list, tuple)) else [arg]):
                if isinstance(target, torch.fx.Node):
                    written.update((str(r.target), None) for r in alias_closure([target]) if r in constants)
    for name in written:
        fetches = [n for n in constants if str(n.target) == name]
        with gm.graph.inserting_after(fetches[0]):
            fresh = gm.graph.call_method("clone", (fetches[0],))
        fresh.meta.update({k: v for k, v in fetches[0].meta.items() if k in ("val", "tensor_meta", "stack_trace")})
        for fetch in fetches:
            fetch.replace_all_uses_with(fresh, delete_user_cb=fresh.__ne__)
        for fetch in fetches[1:]:
            gm.graph.erase_node(fetch)
    if written:
        gm.recompile()
    return list(written)
