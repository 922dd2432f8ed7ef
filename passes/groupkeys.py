"""Find integer inputs that group the batch's rows for a reduction: a flat batch of groups.

Reads:  the graph (``index_add``/``scatter*``/``index_reduce``/``index_put`` calls: fx's methods and functions,
        torch.export's ATen ops) and the ``fxpipe.value`` of the placeholders their index is
        made from.
Writes: nothing; :func:`group_keys` names each integer input an index of such a reduction is
        made from, with the node.

A flat batch of graphs or point clouds holds every group's rows one after another, and a
per-row vector says which group each row belongs to (PyG's ``batch``, ``edge_index``). Cut
into micro-batches by rows, a group may straddle the cut, and each part is reduced alone::

    pos (14, 3), batch = [0 0 0 0 1 1 1 | 1 2 2 2 3 3 3]     chunks=2 cuts cloud 1 in two
    g = zeros(B, H).index_add_(0, batch, h)                   each half pools part of cloud 1

Nothing in the shapes tells (the pooled value has B rows either way), so compile warns.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx
from fxpipe.passes.flatids import placeholders_behind
from fxpipe.passes.spec import TensorSpec

__all__ = ["group_keys"]

_METHODS = frozenset({"index_add", "index_add_", "scatter", "scatter_", "scatter_add", "scatter_add_",
                      "scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"})
_FUNCTIONS = frozenset({torch.index_add, torch.scatter, torch.scatter_add, torch.scatter_reduce, torch.index_reduce})


def _index_arg(node: torch.fx.Node) -> object:
    """Return the index argument of a reduction grouping rows (``self, dim, index, ...`` along dim 0), or None.

    Along another dim (a one-hot of labels, ``scatter_(1, labels[:, None], 1.0)``) each row keeps to itself.
    """
    if _puts(node):  # index_put_((batch,), h, accumulate=True): the first index picks rows (a plain write: no sum)
        indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices")
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return indices[0] if accumulate is True and isinstance(indices, (tuple, list)) and indices else None
    grouping = (node.op == "call_method" and node.target in _METHODS) or (node.op == "call_function" and (
        node.target in _FUNCTIONS or _aten_name(node) in {"index_add", "scatter", "scatter_add", "scatter_reduce",
                                                          "index_reduce"}))
    if not grouping:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim != 0:
        return None
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("index")


def _aten_name(node: torch.fx.Node) -> str | None:
    """Return an ATen op's name without its in-place underscore (``index_put_`` -> ``index_put``), or None."""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1].rstrip("_")
    return None


def _puts(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` writes rows at an index (``index_put(_)``, ``torch.index_put``, ATen's)."""
    return (node.op == "call_method" and node.target in ("index_put", "index_put_")) or (
        node.op == "call_function" and (node.target in (torch.index_put, torch.index_put_)
                                        or _aten_name(node) in ("index_put", "_index_put_impl")))


def _integer(spec: object) -> bool:
    """Tell whether a spec is an integer tensor's."""
    return isinstance(spec, TensorSpec) and not (spec.dtype.is_floating_point or spec.dtype.is_complex
                                                 or spec.dtype == torch.bool)


def _integer_inputs(node: object) -> set[str]:
    """Return the integer placeholders (of one or two dims) an integer node's value is taken from, through integer values.

    Only integer values are followed (``batch[:, None].expand_as(x)``, ``edge_index[1]``): a
    router's top-k indices come from float scores, and their model's token ids are no group key.
    """
    found = placeholders_behind(node, through=lambda n: _integer(n.meta.get("fxpipe.value")), inputs=_made_of)
    return {str(p.target) for p in found if len(p.meta["fxpipe.value"].shape) in (1, 2)}


_SHAPED = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_full",
                     "new_empty", "size"})  # of an input's shape only, not its values
_AS = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})  # the first's values, the second's shape


def _made_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Return the inputs whose values ``node``'s value is made of (not ``ids`` of ``arange(B)[:, None].expand_as(ids)``)."""
    name = node.target if node.op == "call_method" else _aten_name(node) or getattr(node.target, "__name__", "")
    if name in _SHAPED:
        return []
    if name in _AS:
        return [node.args[0]] if isinstance(node.args[0], torch.fx.Node) else []
    return node.all_input_nodes


def group_keys(gm: torch.fx.GraphModule, skip: Collection[str] = ()) -> list[tuple[str, str]]:
    """Return (input, node) for each integer input an index of a grouping reduction is made from (not in ``skip``)."""
    found: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        index = _index_arg(node)
        for name in sorted(_integer_inputs(index) - set(skip)) if isinstance(index, torch.fx.Node) else ():
            if name not in [f for f, _ in found]:
                found.append((name, node.name))
    return found
