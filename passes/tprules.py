"""How one node carries a sharded dimension from its inputs to its output.

Reads:  ``node.meta["fxpipe.value"]`` (global shapes) and the layouts of the node's inputs.
Writes: nothing.

A layout is what a rank holds of a value (see :mod:`fxpipe.passes.tplayout`): ``None``
replicated, an ``int`` d for a local shard of dim d, ``"D"`` a DTensor, ``"L"`` an int that is
a sharded dim's local size, a tuple per element. :func:`through` returns the layout of a
node's value, or raises :class:`Refusal` saying why the node cannot run on a shard (the
operands that are replicated where a shard was needed, for the pairing to pull in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from fxpipe.passes.tpops import (
    ELEMENTWISE_MODULES,
    NORM_MODULES,
    POINTWISE,
    ndim_of,
    op_name,
    shape_of,
)
from fxpipe.passes.tppartial import activation_beside_shard, params_only
from fxpipe.passes.tpshape import SHAPE_RULES, Refusal, call_arg, dim_index

__all__ = ["Refusal", "through"]

_REDUCTIONS = frozenset(["sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "argmax", "argmin", "prod", "all", "any"])
_LIKE = frozenset(["zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"])


def through(node: torch.fx.Node, layout: Callable[[Any], Any], t: int, module: Callable[[str], Any]) -> Any:
    """Return the layout of ``node``'s value from its inputs' (``layout(arg)``); raise :class:`Refusal`."""
    name = "module" if node.op == "call_module" else op_name(node)
    ins = [a for a in node.all_input_nodes]
    if any(layout(a) == "D" for a in ins):
        return _dtensor(node, ins, layout)
    x = node.args[0] if node.args else None
    lx = layout(x)
    if node.op == "call_module":
        return _module(node, module(str(node.target)), lx, layout)
    if name in POINTWISE or name in _LIKE or _tagged_pointwise(node):
        return _pointwise(node, layout)
    handler = _HANDLERS.get(name or "")
    if handler is not None:
        return handler(node, lx, layout, t)
    raise Refusal("unsupported", f"fxpipe does not know how '{name}' treats a sharded dimension")


def _tagged_pointwise(node: torch.fx.Node) -> bool:
    """Tell whether an ATen op carries torch's pointwise tag."""
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def _dtensor(node: torch.fx.Node, ins: list, layout: Callable) -> Any:
    """Ops on DTensors keep global semantics; mixing one with a local tensor fails."""
    if ndim_of(node) is None and not isinstance(node.meta.get("fxpipe.value"), (tuple, list)):
        return None  # a DTensor's sizes are global
    local = [a for a in ins if ndim_of(a) is not None and layout(a) != "D"]
    if local:
        raise Refusal("dtensor", f"it mixes a DTensor (a style's use_local_output=False) with the local tensor "
                                 f"'{local[0].name}'; give that style use_local_output=True")
    return "D"


def _pointwise(node: torch.fx.Node, layout: Callable) -> Any:
    """Elementwise ops: every sharded operand on one output dim, replicated ones broadcast along it."""
    out = ndim_of(node)
    tensors = [a for a in node.all_input_nodes if ndim_of(a) is not None]
    if out is None:  # arithmetic on sizes
        return "L" if any(layout(a) == "L" for a in node.all_input_nodes) else None
    dims = {layout(a) + out - ndim_of(a) for a in tensors if isinstance(layout(a), int)}
    if len(dims) > 1:
        raise Refusal("unsupported", f"its operands are sharded on different dims {sorted(dims)}")
    if not dims:
        return None
    d = dims.pop()
    blocking = [a for a in tensors if layout(a) is None and _size_at(a, d, out) != 1]
    if blocking:
        behind = _weight_behind(blocking[0])
        raise Refusal("mixed", f"it combines a shard of dim {d} with the whole of '{blocking[0].name}'" + (
            f" ({behind}, as large as the unsharded dim: a weight with an entry per head or per feature would have to "
            "be split with the shard, which no style does)" if behind else ""), blocking)
    graded = [a for a in tensors if layout(a) is None and activation_beside_shard(a)]
    if graded:  # each rank would backpropagate its shard's part of that value's gradient only
        raise Refusal("unsupported", f"it combines a shard of dim {d} with '{graded[0].name}', an activation "
                                     "whose gradient each rank would compute only in part")
    return d


def _weight_behind(node: torch.fx.Node) -> str:
    """Name the parameter a whole value is read from (through casts and views): ``parameter 'fqn', shape (...)``."""
    for _ in range(8):
        if node.op == "get_attr":
            shape = shape_of(node)
            return f"parameter '{node.target}'" + ("" if shape is None else f", shape {tuple(shape)}")
        inputs = [a for a in node.all_input_nodes if params_only(a)]  # not a dtype read off an input
        if len(inputs) != 1:
            return ""
        node = inputs[0]
    return ""


def _size_at(a: torch.fx.Node, d: int, out: int) -> int:
    """Return the size of ``a`` at output dim ``d`` after broadcasting (1 where ``a`` lacks it)."""
    shape = shape_of(a) or ()
    k = d - (out - len(shape))
    return 1 if k < 0 else int(shape[k])


def _module(node: torch.fx.Node, mod: Any, lx: Any, layout: Callable) -> Any:
    """Unstyled leaf modules: elementwise ones pass a shard through, norms over other dims too."""
    if lx is None and not any(layout(a) is not None for a in node.all_input_nodes):
        return None
    if isinstance(mod, ELEMENTWISE_MODULES):
        return _pointwise(node, layout)
    if isinstance(mod, NORM_MODULES) and isinstance(lx, int):
        nd = ndim_of(node.args[0]) or 0
        if lx < nd - len(mod.normalized_shape):
            return lx
        raise Refusal("unsupported", f"{type(mod).__name__} normalizes over the sharded dim {lx}")
    if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
        raise Refusal("input", f"{type(mod).__name__} '{node.target}' is not in the plan but reads a shard of dim {lx}")
    raise Refusal("unsupported", f"{type(mod).__name__} '{node.target}' (not in the plan) reads a sharded value")


def _reduce(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Softmax and reductions over other dims than the sharded one."""
    if not isinstance(lx, int):
        return None
    nd, name = ndim_of(node.args[0]) or 0, op_name(node)
    dims = call_arg(node, 1, "dim")
    if name in ("tril", "triu"):
        dims = [nd - 2, nd - 1]
    if dims is None:
        raise Refusal("unsupported", f"'{name}' reduces every dim, the sharded one too")
    dims = [dim_index(k, nd) for k in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if lx in dims:
        raise Refusal("unsupported", f"'{name}' works along the sharded dim {lx}")
    if name in _REDUCTIONS and not call_arg(node, 2, "keepdim", False):
        lx -= sum(1 for k in dims if k < lx)
    return (lx, lx) if isinstance(node.meta.get("fxpipe.value"), tuple) else lx


def _norm(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """layer_norm / rms_norm over trailing dims other than the sharded one."""
    if not isinstance(lx, int):
        return None
    shape = call_arg(node, 1, "normalized_shape")
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    if lx >= (ndim_of(node.args[0]) or 0) - k:
        raise Refusal("unsupported", f"it normalizes over the sharded dim {lx}")
    return lx


def _attention(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Attention: query, key and value sharded on one batch-like dim (the heads); the mask broadcast."""
    args: Any = node.args
    q, k, v = args[:3]
    lays = [layout(a) for a in (q, k, v)]
    nd = ndim_of(q) or 0
    if all(la is None for la in lays):
        return None
    sharded = {la for la in lays if isinstance(la, int)}
    if len(sharded) > 1 or sharded & {nd - 1, nd - 2}:
        raise Refusal("unsupported", f"attention's query, key and value are sharded on dims {lays}, not all on "
                                     f"one head dim (with fewer key/value heads than tensor_parallel={t}, as in "
                                     "multi-query attention, their projections are cut inside a head: leave those "
                                     "out of the plan)")
    d = sharded.pop()
    missing = [a for a, la in zip((q, k, v), lays) if la is None]
    mask = call_arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node) and layout(mask) is None and _size_at(mask, d, nd) != 1:
        missing.append(mask)
    if missing:
        raise Refusal("mixed", f"attention reads a shard of the heads and the whole of '{missing[0].name}'", missing)
    return d


def _matmul(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """matmul: a shard of a batch dim on both sides, of a's rows, or of b's columns."""
    args: Any = node.args
    a, b = args[:2]
    la, lb = layout(a), layout(b)
    na, nb, out = ndim_of(a) or 0, ndim_of(b) or 0, ndim_of(node) or 0
    if la is None and lb is None:
        return None
    batch = [isinstance(la, int) and la < na - 2, isinstance(lb, int) and lb < nb - 2]
    if any(batch):
        dims = {x + out - n for x, n, b_ in ((la, na, batch[0]), (lb, nb, batch[1])) if b_}
        if len(dims) > 1:
            raise Refusal("unsupported", f"its operands are sharded on different batch dims {sorted(dims)}")
        d = dims.pop()
        for side, lay, is_batch in ((a, la, batch[0]), (b, lb, batch[1])):
            if is_batch:
                continue
            if lay is not None:
                raise Refusal("unsupported", "one operand is sharded on a batch dim, the other on a matrix dim")
            if _size_at(side, d, out) != 1:
                raise Refusal("mixed", f"it multiplies a shard of batch dim {d} with the whole of '{side.name}'",
                              [side])
        return d
    if la == na - 2 and lb is None:
        return out - 2
    if la is None and lb == nb - 1:
        return out - 1
    raise Refusal("unsupported", "it contracts over the sharded dim (a partial sum)")


def _refuse_input(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """A linear or embedding not in the plan reading a shard."""
    if lx is None:
        return None
    raise Refusal("input", f"'{op_name(node)}' is not in the plan but reads a shard of dim {lx}")


def _no_value(node: torch.fx.Node, lx: Any, layout: Callable, t: int) -> Any:
    """Checks with no value (torch.export's tensor metadata assertions)."""
    return None


_HANDLERS: Mapping[str, Callable[..., Any]] = {
    **SHAPE_RULES,
    "softmax": _reduce, "log_softmax": _reduce, "tril": _reduce, "triu": _reduce, **{n: _reduce for n in _REDUCTIONS},
    "layer_norm": _norm, "rms_norm": _norm,
    "scaled_dot_product_attention": _attention, "matmul": _matmul, "bmm": _matmul, "mm": _matmul,
    "linear": _refuse_input, "embedding": _refuse_input, "_assert_tensor_metadata": _no_value,
    "dim": _no_value,
}
