"""The structure of a graph as plain data, to tell whether two processes traced the same graph.

Reads:  the graph (node names, ops, targets, and each node's arguments: nodes by name, constants).
Writes: nothing, but :func:`rename_like`, which rebuilds the graph (same nodes, their
        ``node.meta`` kept) in another trace's order and names. :func:`fingerprint` returns one
        line per node, :func:`first_difference` names the first node at which two fingerprints
        differ, :func:`structure` keys each node by what it computes.

Two processes tracing the same model get the same graph unless the model's forward depends on
the process: Python iterating a set of strings (whose order follows the process's hash seed),
as transformers' ModernBERT does to build its rotary tables per attention type. Both graphs are
then valid, with the same node names meaning different values; a pipeline whose ranks cut
them by name would exchange the wrong values. When they compute the same values in another
order, :func:`rename_like` gives one trace the other's names.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Any

import torch
import torch.fx

__all__ = ["call_name", "fingerprint", "first_difference", "rename_like", "state_signature", "structure"]


def _target(target: Any) -> str:
    """Name a node's target the same way in every process (no object addresses)."""
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else str(target)


def call_name(target: Any, by_name: bool = False) -> str:
    """Name a call target briefly as an identifier: the last part of its name (``by_name``: a method's or module's name)."""
    name = str(target) if by_name else _target(target).rsplit(".", 1)[-1]
    return re.sub(r"\W", "_", name)


def _arg(a: Any, keys: dict[torch.fx.Node, str] | None = None) -> str:
    """Write one argument of a node: a node by its name (or its key), a constant by its value, other objects by type."""
    if isinstance(a, torch.fx.Node):
        return a.name if keys is None else f"<{keys[a]}>"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(v, keys) for v in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v, keys)}" for k, v in a.items()) + "}"
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return repr(a)
    return type(a).__name__


def fingerprint(gm: torch.fx.GraphModule) -> list[str]:
    """Return one line per node: ``name = op target(its arguments, nodes by name)``."""
    return [f"{n.name} = {n.op} {_target(n.target)}({_arg(list(n.args))[1:-1]}{', ' if n.args and n.kwargs else ''}"
            f"{_arg(n.kwargs)[1:-1]})" for n in gm.graph.nodes]


def state_signature(gm: torch.fx.GraphModule) -> list[str]:
    """Return one line per tensor (name, shape, dtype) and per module the graph calls (its settings).

    What a graph's lines cannot show: two ranks building a model from different configs trace
    the same nodes when only a size (a 10-class head for a 4-class one), a dtype or a leaf
    module's setting (``LeakyReLU(negative_slope=0.5)``) differs.
    """
    lines = [f"tensor {name}: {tuple(t.shape)} {t.dtype}"
             for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]]
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            settings = re.sub(r" at 0x[0-9a-fA-F]+", "", mod.extra_repr())  # no object addresses
            lines.append(f"module {node.target}: {type(mod).__name__}({settings})")
    return sorted(set(lines))  # by name: a model may register its modules in another order on each rank


def first_difference(expected: list[str], got: list[str]) -> str | None:
    """Return the first node line that differs between two fingerprints (``None``: the same graph)."""
    for a, b in zip(expected, got):
        if a != b:
            return f"{b!r} where the other has {a!r}"
    if len(expected) != len(got):
        return f"{len(got)} nodes where the other has {len(expected)}"
    return None


def structure(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Return ``(name, key)`` per node, where the key hashes what the node computes, not its name.

    A node's key covers its op, its target, its constant arguments and its arguments' keys
    (placeholders are keyed by name, attributes by their path), so two nodes computing the same
    value in two traces of a model share a key whatever they were named or where they stand.
    """
    keys: dict[torch.fx.Node, str] = {}
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            text = f"placeholder {n.target}"
        else:
            text = f"{n.op} {_target(n.target)}({_arg([list(n.args), n.kwargs], keys)})"
        keys[n] = hashlib.sha1(text.encode()).hexdigest()[:16]
        out.append((n.name, keys[n]))
    return out


def rename_like(gm: torch.fx.GraphModule, reference: list[tuple[str, str]]) -> bool:
    """Rebuild ``gm``'s graph in ``reference``'s node order and names, matching nodes by key.

    ``reference`` is another trace's :func:`structure`. Returns False, leaving ``gm`` as it
    was, when the two graphs do not compute the same values (a key without its match).
    """
    mine: dict[str, list[torch.fx.Node]] = {}
    key_of: dict[torch.fx.Node, str] = {}
    for n, (_, key) in zip(gm.graph.nodes, structure(gm)):
        mine.setdefault(key, []).append(n)
        key_of[n] = key
    if sorted((k, len(v)) for k, v in mine.items()) != sorted(Counter(k for _, k in reference).items()):
        return False
    graph = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    made: dict[str, torch.fx.Node] = {}  # the first new node of each key: nodes of one key compute one value

    def new_of(a: torch.fx.Node) -> torch.fx.Node:  # its own copy if made yet, else one of its key
        return env[a] if a in env else made[key_of[a]]

    for name, key in reference:
        old = mine[key].pop(0)
        try:
            args = torch.fx.node.map_arg((old.args, old.kwargs), new_of)
        except KeyError:  # an argument comes later in the reference's order
            return False
        new = graph.create_node(old.op, old.target, args[0], args[1], name=name, type_expr=old.type)
        new.meta = old.meta
        env[old] = new
        made.setdefault(key, new)
    if [n.name for n in graph.nodes] != [name for name, _ in reference]:
        return False
    gm.graph = graph
    gm.recompile()
    return True
