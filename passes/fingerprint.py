"""The structure of a graph as plain data, to tell whether two processes traced the same graph.

Reads:  the graph (node names, ops, targets, and each node's arguments: nodes by name, constants).
Writes: nothing; :func:`fingerprint` returns one line per node, :func:`first_difference`
        names the first node at which two fingerprints differ.

Two processes tracing the same model get the same graph unless the model's forward depends on
the process: Python iterating a set of strings (whose order follows the process's hash seed),
as transformers' ModernBERT does to build its rotary tables per attention type. Both graphs are
then valid, with the same node names meaning different values; a pipeline whose ranks cut
them by name would exchange the wrong values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["fingerprint", "first_difference"]


def _target(target: Any) -> str:
    """Name a node's target the same way in every process (no object addresses)."""
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else str(target)


def _arg(a: Any) -> str:
    """Write one argument of a node: a node by its name, a constant by its value, other objects by type."""
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(v) for v in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return repr(a)
    return type(a).__name__


def fingerprint(gm: torch.fx.GraphModule) -> list[str]:
    """Return one line per node: ``name = op target(its arguments, nodes by name)``."""
    return [f"{n.name} = {n.op} {_target(n.target)}({_arg(list(n.args))[1:-1]}{', ' if n.args and n.kwargs else ''}"
            f"{_arg(n.kwargs)[1:-1]})" for n in gm.graph.nodes]


def first_difference(expected: list[str], got: list[str]) -> str | None:
    """Return the first node line that differs between two fingerprints (``None``: the same graph)."""
    for a, b in zip(expected, got):
        if a != b:
            return f"{b!r} where the other has {a!r}"
    if len(expected) != len(got):
        return f"{len(got)} nodes where the other has {len(expected)}"
    return None
