"""Tell which arguments a graph node changes in place: fxpipe's one mutation detector.

Reads:  the graph (call targets and arguments, the modules of ``call_module`` nodes) and, in
        :func:`is_mutating`, ``node.meta["fxpipe.mutates"]`` when annotation wrote it.
Writes: nothing.

Every pass that must know whether a node writes into a value asks here: the orderer (which
must not reorder a graph with mutations), the signature cache of annotation, the profiler
(which must not write into its leaves) and the in-place analysis of :mod:`fxpipe.passes.inplace`.
A node is known to write an argument in place when

    an ATen op (``OpOverload``)   its schema marks the argument as written (``Tensor(a!)``):
                                  ``aten.fill_``, ``copy_``, ``index_put_``, ``add.out``'s ``out``
    an overload packet            one of its overloads' schemas does, at that position or name
    a Python function or method   its name ends in ``_`` (``x.add_``, ``torch.relu_``), it is an
                                  in-place operator (``operator.setitem``, ``operator.iadd``),
                                  it is called with ``inplace=True`` (by keyword or position,
                                  ``F.relu(x, True)``), or it is given ``out=``
    a module                      it has ``inplace=True`` (``nn.ReLU(inplace=True)``)
    a higher-order op             its body writes the placeholder the argument becomes
                                  (``wrap_with_set_grad_enabled(False, body, w, u)``)

A node that wraps a call (a node of one mode only, :class:`fxpipe.passes.modes.When`; a call
under the forward's autocast, :class:`fxpipe.passes.amp.UnderAutocast`) is judged by that call. Views are told apart the same way (:func:`aliases`): from the schema's alias sets for ATen
ops, by name for Python-level calls, by class for modules that may return their input (``nn.Identity``,
a dropout, ``nn.Flatten``); a function marking ``returns_an_argument`` (fxpipe's
``pick`` of the mode's value) aliases the arguments at those positions.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

__all__ = ["VIEW_NAMES", "alias_closure", "aliases", "is_mutating", "may_mutate", "op_name", "written_args"]

_IOPS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
         operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
         operator.ixor, operator.ilshift, operator.irshift, operator.setitem, operator.delitem}
_IMETHODS = {"__setitem__", "__delitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
             "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__",
             "__ixor__", "__ilshift__", "__irshift__"}
_NOT_DATA = {"requires_grad_", "retain_grad", "share_memory_", "record_stream"}
_VIEW_ATTRIBUTES = {"data", "T", "mT", "H", "mH", "real", "imag"}  # attributes that are views of the tensor
VIEW_NAMES = {"view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims",
              "permute", "t", "narrow", "select", "squeeze", "unsqueeze", "expand", "expand_as",
              "flatten", "unflatten", "split", "split_with_sizes", "tensor_split", "chunk", "unbind",
              "unfold", "diagonal", "as_strided", "detach", "getitem", "contiguous", "movedim",
              "moveaxis", "real", "imag", "view_as_real", "view_as_complex", "alias", "slice",
              "__getitem__"}
_INPLACE_POSITION: dict[Any, int | None] = {}  # Python callable -> index of its ``inplace`` parameter


def op_name(target: Any) -> str:
    """Return the bare name of a call target (method name, function or op name)."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


class _Call:
    """The call a wrapping node makes, seen as a node: its op, target and arguments (and the node's graph)."""

    def __init__(self, node: Any) -> None:
        self.op, self.target, self.args, self.kwargs = node.target.inner_call(node)
        self.name, self.graph, self.meta = node.name, node.graph, node.meta


def unwrapped(node: torch.fx.Node) -> Any:
    """Return the call a wrapping node makes (its target has ``inner_call``), seen as a node; else ``node``."""
    call: Any = node
    while call.op == "call_function" and hasattr(call.target, "inner_call"):  # a wrapper may wrap another
        call = _Call(call)
    return call


def _schemas(target: Any) -> list:
    """Return the schemas of an ATen op or of every overload of a packet (else an empty list)."""
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, name)._schema for name in target.overloads()]
    return []


def _inplace_position(target: Any) -> int | None:
    """Return the position of a Python callable's ``inplace`` parameter, or None."""
    try:
        if target in _INPLACE_POSITION:
            return _INPLACE_POSITION[target]
    except TypeError:  # unhashable
        return None
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # builtins: torch's own functions have no ``inplace``
        names = []
    _INPLACE_POSITION[target] = names.index("inplace") if "inplace" in names else None
    return _INPLACE_POSITION[target]


def _by_name(name: str) -> bool:
    """Tell whether a function or method name says it works in place (``add_``, not ``__add__``)."""
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA


def _from_schemas(node: torch.fx.Node, schemas: list) -> list[Any]:
    """Return the arguments that some schema marks as written, matched by position or keyword."""
    out = []
    for k, value in enumerate(node.args):
        if any(k < len(s.arguments) and not s.arguments[k].kwarg_only and _writes(s.arguments[k])
               for s in schemas):
            out.append(value)
    for key, value in node.kwargs.items():
        if any(a.name == key and _writes(a) for s in schemas for a in s.arguments):
            out.append(value)
    return out


def _writes(argument: Any) -> bool:
    """Tell whether a schema argument is written in place (``Tensor(a!)``)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def written_args(node: torch.fx.Node) -> list[Any]:
    """Return the arguments (nodes, or lists of them) that ``node`` changes in place, from the node alone."""
    node = unwrapped(node)
    if node.op == "call_module":
        return [node.args[0]] if node.args and getattr(_module(node), "inplace", False) is True else []
    if node.op not in ("call_function", "call_method"):
        return []
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _body_writes(node)
    schemas = _schemas(node.target)
    if schemas:
        return _from_schemas(node, schemas)
    out = [node.kwargs["out"]] if node.kwargs.get("out") is not None else []
    if not node.args:
        return out
    if node.op == "call_method":
        mutating = node.target in _IMETHODS or _by_name(str(node.target))
    else:
        position = _inplace_position(node.target)
        mutating = (node.target in _IOPS or _by_name(op_name(node.target))
                    or node.kwargs.get("inplace") is True
                    or (position is not None and len(node.args) > position and node.args[position] is True))
    return [node.args[0], *out] if mutating else out


def _body_writes(node: Any) -> list[Any]:
    """Return the arguments a higher-order op's one body (a GraphModule after them) writes in place.

    torch.export wraps a block under ``torch.no_grad()`` or autocast in a body called as
    ``wrap_with_set_grad_enabled(False, body, *args)``: the body's placeholders are the
    arguments after it (a spectral norm's power iteration writes its buffers there, ``out=``).
    Ops with several bodies (``cond``) are not looked into.
    """
    owner = node.graph.owning_module
    bodies = [k for k, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
              and isinstance(_attr(owner, str(a.target)), torch.fx.GraphModule)]
    if owner is None or len(bodies) != 1:
        return []
    body: torch.fx.GraphModule = _attr(owner, str(node.args[bodies[0]].target))
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    written = alias_closure(w for n in body.graph.nodes for value in written_args(n)  # a write into a view
                            for w in (value if isinstance(value, (list, tuple)) else [value])  # writes what it views
                            if isinstance(w, torch.fx.Node))
    return [v for p, v in zip(placeholders, node.args[bodies[0] + 1:]) if p in written]


def _attr(owner: Any, target: str) -> Any:
    """Return the attribute at the dotted path ``target`` of ``owner`` (None where missing)."""
    obj = owner
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def is_mutating(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` changes a value in place: known from the node, or seen by annotation."""
    return bool(written_args(node)) or bool(node.meta.get("fxpipe.mutates"))


def may_mutate(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` might change a value in place, counting calls it cannot see into.

    Besides :func:`is_mutating`: a call of a module from outside ``torch.nn`` (a leaf
    module), whose forward may do anything.
    """
    if is_mutating(node):
        return True
    call = unwrapped(node)
    if call.op == "call_module":
        return not type(_module(call)).__module__.startswith("torch.nn")
    return False


def _module(node: torch.fx.Node) -> torch.nn.Module:
    """Return the module a ``call_module`` node calls."""
    owner = node.graph.owning_module
    assert owner is not None, f"node {node.name!r} belongs to no GraphModule"
    return owner.get_submodule(str(node.target))


# modules whose output may be their input or a view of it: nn.Identity, a dropout (its input
# itself at p=0, as timm's and Hugging Face's drop_rate=0.0 make it, and in eval), flattening
_PASS_THROUGH = (torch.nn.Identity, torch.nn.modules.dropout._DropoutNd, torch.nn.Flatten, torch.nn.Unflatten)


def _passes_through(node: torch.fx.Node) -> bool:
    """Tell whether a ``call_module`` node's module may return its input's storage (see ``_PASS_THROUGH``)."""
    try:
        return isinstance(_module(node), _PASS_THROUGH)
    except (AssertionError, AttributeError):  # a graph without its module: nothing to judge by
        return False


def alias_closure(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """Return ``nodes`` with every node whose storage they may share, following :func:`aliases` transitively."""
    seen: set[torch.fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += aliases(node)
    return seen


def aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Return the input nodes whose storage ``node``'s value may share (views, in-place results)."""
    node = unwrapped(node)
    if node.op not in ("call_function", "call_method", "call_module"):
        return []
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    schemas = _schemas(node.target) if node.op == "call_function" else []
    if schemas:  # a view returns an alias of ``self`` that it does not write: ``Tensor(a)``
        view = any(r.alias_info is not None and not r.alias_info.is_write for s in schemas for r in s.returns)
    elif node.op == "call_module":
        view = _passes_through(node)
    elif node.op == "call_function" and node.target is getattr:  # fx's x.data (x.T, x.mT, x.real...)
        view = len(node.args) > 1 and node.args[1] in _VIEW_ATTRIBUTES
    else:
        view = op_name(node.target) in VIEW_NAMES
    found = [first] if view and first is not None else []
    positions = getattr(node.target, "returns_an_argument", ())  # fxpipe's pick: the running mode's argument
    positions += getattr(node.target, "shares_storage_of", ())  # fxpipe's detach of a no-grad block's value
    found += [node.args[k] for k in positions if k < len(node.args) and isinstance(node.args[k], torch.fx.Node)]
    for value in written_args(node):
        for n in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(n, torch.fx.Node) and n not in found:
                found.append(n)
    return found
