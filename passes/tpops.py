"""What tensor parallelism needs to know of a graph's ops: their names, kinds and dim mappings.

Reads:  ``node.target`` and ``node.meta["fxpipe.value"]`` (shapes, from :func:`fxpipe.passes.annotate`).
Writes: nothing.

The layout propagation (:mod:`fxpipe.passes.tplayout`) follows a sharded dimension through a
node by its kind: ``torch.fx`` front end ops (``operator.add``, ``torch.relu``, ``x.view``) and
``torch.export``'s ATen ops (``aten.view.default``) get one name each (:func:`op_name`), so one
table serves both. A reshape maps a sharded input dim to the output dim that carries it, from
the global shapes::

    (b, s, 768)  ──view──▶ (b, s, 12, 64)     dim 2 ──▶ dim 2 (12 heads: 6 per rank at t=2)
    (b, s, 12, 64) ─reshape▶ (b, s, 768)       dim 2 ──▶ dim 2
    (b, 12, s, 64) ─reshape▶ (b, 12 * s * 64)  dim 1 ──▶ dim 1 (a leading block of the product)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from fxpipe.passes.spec import TensorSpec

__all__ = ["ELEMENTWISE_MODULES", "NORM_MODULES", "POINTWISE", "VIEWS", "divisors", "ndim_of", "op_name",
           "reshape_dim", "shape_of"]

# ops that compute each output element from the elements at the same index (inputs broadcast)
POINTWISE = frozenset([
    "add", "sub", "rsub", "mul", "div", "truediv", "floordiv", "mod", "neg", "pos", "pow", "rsqrt", "sqrt",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "relu", "relu6", "gelu", "silu",
    "mish", "softplus", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "elu", "celu", "selu", "sin",
    "cos", "tan", "abs", "sign", "clamp", "clamp_min", "clamp_max", "clip", "where", "masked_fill", "erf",
    "erfc", "reciprocal", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_not", "and_", "or_", "__and__", "__or__", "bitwise_and", "bitwise_or", "square",
    "dropout", "feature_alpha_dropout", "alpha_dropout", "to", "type", "type_as", "float", "half", "bfloat16",
    "double", "contiguous", "clone", "detach", "alias", "_to_copy", "lift_fresh_copy", "add_", "sub_", "mul_",
    "div_", "relu_", "gelu_", "silu_", "tanh_", "sigmoid_", "masked_fill_", "zero_", "fill_", "copy_",
    "nan_to_num", "lerp", "addcmul", "addcdiv",
])
# ops whose output is the input's elements, read as another shape (global shapes decide the mapping)
VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten"})
ELEMENTWISE_MODULES = (torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid,
                       torch.nn.Dropout, torch.nn.Identity, torch.nn.Mish, torch.nn.LeakyReLU, torch.nn.ELU,
                       torch.nn.Softplus, torch.nn.Hardswish, torch.nn.ReLU6)
NORM_MODULES = (torch.nn.LayerNorm,) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())

_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv",
              operator.floordiv: "floordiv", operator.neg: "neg", operator.pow: "pow", operator.getitem: "getitem",
              operator.matmul: "matmul", operator.mod: "mod", operator.and_: "and_", operator.or_: "or_",
              operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
              operator.ge: "ge", operator.iadd: "add", operator.imul: "mul", getattr: "getattr"}


def op_name(node: torch.fx.Node) -> str | None:
    """Return the one name of a node's op, whichever front end traced it (None: not a call)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATORS:
        return _OPERATORS[target]
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        return {"_softmax": "softmax", "_log_softmax": "log_softmax"}.get(name, name)
    return getattr(target, "__name__", None)


def shape_of(node: Any) -> tuple[int, ...] | None:
    """Return the global shape of a node's tensor value (None: not one tensor)."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("fxpipe.value")
    return tuple(value.shape) if isinstance(value, TensorSpec) else None


def ndim_of(node: Any) -> int | None:
    """Return the number of dims of a node's tensor value (None: not one tensor)."""
    shape = shape_of(node)
    return None if shape is None else len(shape)


def reshape_dim(before: Sequence[int], after: Sequence[int], dim: int, t: int) -> int | tuple[str, int | None]:
    """Return the dim of ``after`` that carries ``before``'s dim ``dim`` split over ``t`` ranks.

    The ranks' chunks of ``dim`` are contiguous blocks of the elements of the group of dims
    reshaped together, so they map to chunks of that group's first dim of ``after`` (not of
    size 1) when its size is a multiple of ``t`` and ``dim`` leads its group. Return a reason
    (a string) when no dim carries it.
    """
    i = j = 0
    while i < len(before) or j < len(after):
        gi, gj = [i], [j]  # the smallest groups with equal products
        p, q = (before[i] if i < len(before) else 1), (after[j] if j < len(after) else 1)
        i, j = i + 1, j + 1
        while p != q:
            if p < q and i < len(before):
                p, gi = p * before[i], gi + [i]
                i += 1
            elif j < len(after):
                q, gj = q * after[j], gj + [j]
                j += 1
            else:
                return "the shapes do not reshape into each other", None
        if dim in gi:
            lead = [k for k in gi if k < len(before) and before[k] != 1]
            if not lead or lead[0] != dim:
                return (f"dim {dim} of {tuple(before)} is not the leading dim of the dims reshaped together "
                        f"({tuple(before[k] for k in gi if k < len(before))})"), None
            out = [k for k in gj if k < len(after) and after[k] != 1]
            if not out:
                return f"the dims it becomes in {tuple(after)} have size 1", None
            if after[out[0]] % t:
                return f"dim {out[0]} of {tuple(after)} has {after[out[0]]}, which {t} ranks do not divide", after[out[0]]
            return out[0]
    return f"dim {dim} is not in {tuple(before)}", None


def divisors(n: int, most: int = 64) -> list[int]:
    """Return the tensor-parallel sizes up to ``most`` that divide ``n``."""
    return [k for k in range(1, min(n, most) + 1) if n % k == 0]
