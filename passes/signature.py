"""Hashable signatures of graph nodes, so that annotation runs each distinct computation once.

Two nodes with equal signatures compute values of equal shapes, dtypes and strides with
equal FLOPs: the same op or function (or a ``torch.nn`` module of the same type, config and
parameter shapes, in the same training mode) on inputs with equal tensor metadata and equal
constants. A 48-layer transformer then runs one layer's nodes on fake tensors and looks the
other 47 up.

A node gets no signature (``None``) when that reasoning might fail: an in-place op (it may
change its input's metadata; :mod:`fxpipe.passes.mutates` tells), a module from outside ``torch.nn`` (its forward may read any
attribute), or an argument that is not plain data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from fxpipe.passes.mutates import is_mutating
from torch import nn

__all__ = ["node_key", "value_key"]


class _Opaque(Exception):
    """Raised inside key building when a value has no safe hashable form."""


_PLAIN = (int, float, bool, str, complex, type(None), type(Ellipsis), torch.dtype, torch.device,
          torch.layout, torch.memory_format)

def _freeze(x: Any, keys: dict | None) -> Any:
    """Return a hashable form of ``x``; graph nodes become their value's key (from ``keys``)."""
    if isinstance(x, torch.fx.Node):
        if keys is None or keys.get(x) is None:
            raise _Opaque
        return keys[x]
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.requires_grad,
                x.storage_offset())
    if isinstance(x, _PLAIN):
        return (type(x), x)  # 1, 1.0 and True hash alike but make different dtypes
    if isinstance(x, slice):
        return ("slice", _freeze(x.start, keys), _freeze(x.stop, keys), _freeze(x.step, keys))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_freeze(v, keys) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _freeze(v, keys)) for k, v in x.items()))
    raise _Opaque


def value_key(value: Any) -> Any:
    """Return a hashable key of a node's value (tensor metadata, plain constants), or None."""
    try:
        return _freeze(value, None)
    except _Opaque:
        return None


def _module_key(module: nn.Module) -> Any:
    """Return the config of a ``torch.nn`` module and its submodules, or None for other modules."""
    if not type(module).__module__.startswith("torch.nn"):
        return None
    if module._modules:
        subs = list(module.named_modules())
        tensors = (list(module.named_parameters(remove_duplicate=False))
                   + list(module.named_buffers(remove_duplicate=False)))
    else:  # a leaf (Linear, LayerNorm, ...): the same, without the generators
        subs = [("", module)]
        tensors = [(k, t) for k, t in module._parameters.items() if t is not None]
        tensors += [(k, t) for k, t in module._buffers.items() if t is not None]
    parts = []
    for name, sub in subs:
        attrs: list[tuple] = []  # (name, type, value) of plain values, (name, frozen) of others
        for k, v in vars(sub).items():  # "training" included; the order is the class's own
            if k[0] == "_":
                continue
            if isinstance(v, _PLAIN):
                attrs.append((k, type(v), v))
                continue
            try:
                attrs.append((k, _freeze(v, None)))
            except _Opaque:
                return None
        parts.append((name, type(sub), tuple(attrs)))
    return (tuple(parts), tuple((name, _freeze(t, None)) for name, t in tensors))


def node_key(node: torch.fx.Node, keys: dict, modules: dict) -> Any:
    """Return the signature of a call node from its inputs' keys, or None when it has none.

    ``modules`` memoizes module configs by ``call_module`` target and is filled in as a side
    effect.
    """
    if is_mutating(node):
        return None
    if node.op == "call_module":
        if node.target not in modules:
            owner = node.graph.owning_module
            assert owner is not None and isinstance(node.target, str)  # a call_module node of a GraphModule
            module = owner.get_submodule(node.target)
            modules[node.target] = _module_key(module)
        mkey = modules[node.target]
        if mkey is None:
            return None
        target = ("module", mkey)
    else:
        target = (node.op, node.target)
    try:
        return (target, _freeze(node.args, keys), _freeze(node.kwargs, keys))
    except _Opaque:
        return None
