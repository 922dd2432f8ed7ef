"""How views, indexing, moves, joins and splits carry a sharded dimension (the shape rules of :mod:`fxpipe.passes.tprules`).

Reads:  ``node.meta["fxpipe.value"]`` (global shapes) and the layouts of the node's inputs.
Writes: nothing.

Each rule takes the node, the layout of its first input, the layout function and the tp size,
and returns the layout of the node's value or raises :class:`Refusal`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from fxpipe.passes.tpops import (
    VIEWS,
    ndim_of,
    op_name,
    reshape_dim,
    shape_of,
)

__all__ = ["SHAPE_RULES", "Refusal", "call_arg", "dim_index"]

_NOT_TENSORS = frozenset({"dtype", "device", "ndim", "requires_grad", "is_cuda", "layout"})


class Refusal(Exception):
    """A node that cannot run on a shard: why, of which kind, and the replicated operands in the way."""

    def __init__(self, kind: str, message: str, replicated: list[torch.fx.Node] | None = None,
                 size: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind  # "mixed" | "input" | "indivisible" | "unsupported" | "dtensor"
        self.replicated = replicated or []
        self.size = size  # "indivisible": the size that t must divide



def dim_index(value: Any, nd: int) -> int:
    """Normalize a dim index (negative from the end)."""
    return int(value) % nd if nd else 0



def call_arg(node: torch.fx.Node, k: int, name: str, default: Any = None) -> Any:
    """Return argument ``k`` (or keyword ``name``) of a call."""
    return node.args[k] if len(node.args) > k else node.kwargs.get(name, default)



def _full(s: Any) -> bool:
    """Tell whether an index is the whole of its dim (``:``)."""
    return isinstance(s, slice) and s.start in (None, 0) and s.stop in (None, 2 ** 63 - 1) and s.step in (None, 1)



def _view(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Reshapes: the global shapes decide which output dim carries the shard."""
    sizes = [a for a in node.args[1:] for a in (a if isinstance(a, (list, tuple)) else [a])]
    if lx is None:
        if any(layout(s) == "L" for s in sizes):
            raise Refusal("unsupported", "it reshapes a replicated value with a sharded dim's local size")
        return None
    d = reshape_dim(shape_of(node.args[0]) or (), shape_of(node) or (), lx, t)
    if isinstance(d, tuple):
        why, size = d
        raise Refusal("unsupported" if size is None else "indivisible", f"its shard cannot be carried: {why}",
                      size=size)
    return d



def _expand(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """expand and repeat add leading dims; repeat may not tile the sharded dim."""
    if lx is None:
        return None
    d = lx + (ndim_of(node) or 0) - (ndim_of(node.args[0]) or 0)
    if op_name(node) == "repeat":
        reps = [a for a in node.args[1:] for a in (a if isinstance(a, (list, tuple)) else [a])]
        if reps[d] != 1:
            raise Refusal("unsupported", f"it tiles the sharded dim {d} ({reps[d]} times)")
    return d



def _size(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Sizes of a shard are local: the sharded dim's is an ``L`` int."""
    nd = ndim_of(node.args[0]) or 0
    if op_name(node) == "getattr":
        if node.args[1] in _NOT_TENSORS:
            return None
        if node.args[1] != "shape":
            raise Refusal("unsupported", f"it reads .{node.args[1]} of a shard")
        dim = None
    else:
        dim = call_arg(node, 1, "dim")
    if not isinstance(lx, int):
        return None
    if dim is None:
        return tuple("L" if k == lx else None for k in range(nd))
    return "L" if dim_index(dim, nd) == lx else None



def _getitem(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Items of a tuple keep their layouts; indexing a tensor may not cut the sharded dim."""
    index = node.args[1]
    if isinstance(lx, tuple):
        return lx[index] if isinstance(index, int) else lx[index] if isinstance(index, slice) else None
    if not isinstance(lx, int):
        return None
    items = list(index) if isinstance(index, tuple) else [index]
    nd = ndim_of(node.args[0]) or 0
    if Ellipsis in items:
        k = items.index(Ellipsis)
        fill = nd - sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:k] + [slice(None)] * fill + items[k + 1:]
    out = dim = 0
    if any(isinstance(i, torch.fx.Node) for i in items):
        raise Refusal("unsupported", "it indexes a shard with a tensor")
    for item in items:
        if item is None:
            out += 1
            continue
        if dim == lx:
            if not _full(item):
                raise Refusal("unsupported", f"it indexes the sharded dim {lx} with {item!r}")
            return out
        if not isinstance(item, int):
            out += 1
        dim += 1
    return out + (lx - dim)



def _slice(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """slice, narrow, select along another dim than the sharded one."""
    if not isinstance(lx, int):
        return None
    nd = ndim_of(node.args[0]) or 0
    name = op_name(node)
    dim = dim_index(call_arg(node, 1, "dim", 0), nd)
    if dim == lx:
        if name == "slice" and _full(slice(call_arg(node, 2, "start"), call_arg(node, 3, "end"), call_arg(node, 4, "step"))):
            return lx
        raise Refusal("unsupported", f"it cuts the sharded dim {lx}")
    return lx - 1 if name == "select" and dim < lx else lx



def _moves(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """transpose, permute, unsqueeze, squeeze move the sharded dim."""
    if not isinstance(lx, int):
        return None
    name, nd, out = op_name(node), ndim_of(node.args[0]) or 0, ndim_of(node) or 0
    if name in ("transpose", "swapaxes", "swapdims", "t"):
        a, b = (0, 1) if name == "t" else (dim_index(node.args[1], nd), dim_index(node.args[2], nd))
        return b if lx == a else a if lx == b else lx
    if name == "permute":
        dims = [a for a in node.args[1:] for a in (a if isinstance(a, (list, tuple)) else [a])]
        return [dim_index(k, nd) for k in dims].index(lx)
    if name == "unsqueeze":
        k = dim_index(call_arg(node, 1, "dim"), out)
        return lx + 1 if k <= lx else lx
    dims = call_arg(node, 1, "dim")  # squeeze
    shape = shape_of(node.args[0]) or ()
    gone = [k for k in range(nd) if shape[k] == 1] if dims is None else \
        [dim_index(k, nd) for k in (dims if isinstance(dims, (list, tuple)) else [dims]) if shape[dim_index(k, nd)] == 1]
    return lx - sum(1 for k in gone if k < lx)



def _joins(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """cat and stack along another dim; every operand sharded alike."""
    args: Any = node.args
    tensors = list(args[0])
    lays = {layout(a) for a in tensors}
    if lays == {None}:
        return None
    if len(lays) > 1:
        rep = [a for a in tensors if layout(a) is None]
        raise Refusal("mixed" if rep else "unsupported", "it joins shards with other values", rep)
    d = lays.pop()
    nd = ndim_of(tensors[0]) or 0
    if op_name(node) == "stack":
        k = dim_index(call_arg(node, 1, "dim", 0), nd + 1)
        return d + 1 if k <= d else d
    if dim_index(call_arg(node, 1, "dim", 0), nd) == d:
        raise Refusal("unsupported", f"it concatenates along the sharded dim {d}")
    return d



def _splits(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """split, chunk and unbind along another dim: every piece keeps the shard."""
    if not isinstance(lx, int):
        return None
    nd = ndim_of(node.args[0]) or 0
    name = op_name(node)
    dim = dim_index(call_arg(node, 1 if name == "unbind" else 2, "dim", 0), nd)
    if dim == lx:
        raise Refusal("unsupported", f"it splits the sharded dim {lx} (a fused projection): split the module, "
                                     "or leave it out of the plan")
    pieces = node.meta.get("fxpipe.value")
    count = len(pieces) if isinstance(pieces, (list, tuple)) else 1
    return tuple([lx - 1 if name == "unbind" and dim < lx else lx] * count)



def _repeat_interleave(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """repeat_interleave along a dim repeats each local slice: the shard stays."""
    if not isinstance(lx, int):
        return None
    if call_arg(node, 2, "dim") is None:
        raise Refusal("unsupported", "repeat_interleave without dim flattens the shard")
    return lx



SHAPE_RULES: dict[str, Callable[..., Any]] = {
    **{n: _view for n in VIEWS},
    "expand": _expand, "expand_as": _expand, "repeat": _expand,
    "size": _size, "sym_size": _size, "getattr": _size, "getitem": _getitem,
    "slice": _slice, "narrow": _slice, "select": _slice,
    "transpose": _moves, "swapaxes": _moves, "swapdims": _moves, "t": _moves, "permute": _moves,
    "unsqueeze": _moves, "squeeze": _moves,
    "cat": _joins, "concat": _joins, "concatenate": _joins, "stack": _joins,
    "split": _splits, "split_with_sizes": _splits, "chunk": _splits, "unbind": _splits, "tensor_split": _splits,
    "repeat_interleave": _repeat_interleave,
}
