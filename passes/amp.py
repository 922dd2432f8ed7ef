"""Run each node a forward made inside its own ``torch.autocast`` blocks under those blocks.

Reads:  ``node.meta["fxpipe.autocast"]``: the blocks a node was made in, each
        ``(device_type, dtype, enabled, cache_enabled)``, innermost last (the fx tracer writes it).
Writes: the marked call nodes, in place: each becomes a call of :class:`UnderAutocast`, which
        enters the blocks around the call (a module call takes its module from a ``get_attr``);
        names and the rest of ``node.meta`` are kept.

A node is wrapped alone, so a stage boundary may fall anywhere inside a block, and a stage's
recomputation runs each node under its blocks again. Inside the blocks the outer autocast of
the step still holds for the other device types, as in eager.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
import torch.fx
from fxpipe.passes.fingerprint import call_name

__all__ = ["UnderAutocast", "run_under_autocast"]

Block = tuple[str, torch.dtype, bool, bool]


class UnderAutocast:
    """Call a node's target (a function, a method of the first argument, or a module) under autocast blocks."""

    def __init__(self, fn: Any, blocks: tuple[Block, ...], kind: str = "call_function") -> None:
        self.fn, self.blocks, self.kind = fn, blocks, kind
        self.__name__ = f"under_autocast_{call_name(fn, kind != 'call_function')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Enter the blocks, innermost last, and make the call."""
        with ExitStack() as stack:
            for device, dtype, enabled, cache in self.blocks:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
            if self.kind == "call_function":
                return self.fn(*args, **kwargs)
            obj, *rest = args
            return getattr(obj, self.fn)(*rest, **kwargs) if self.kind == "call_method" else obj(*rest, **kwargs)

    def inner_call(self, node: torch.fx.Node) -> tuple[str, Any, tuple, dict]:
        """Return the op, target, args and kwargs of the call ``node`` (a call of this wrapper) makes."""
        if self.kind == "call_module":
            module = node.args[0]
            return "call_module", (module.target if isinstance(module, torch.fx.Node) else module), node.args[1:], \
                dict(node.kwargs)
        return self.kind, self.fn, node.args, dict(node.kwargs)

    def __repr__(self) -> str:
        return self.__name__


def run_under_autocast(gm: torch.fx.GraphModule) -> int:
    """Make every call node marked with autocast blocks run under them; return how many were."""
    count = 0
    for node in list(gm.graph.nodes):
        blocks = node.meta.get("fxpipe.autocast")
        if not blocks or node.op not in ("call_function", "call_method", "call_module"):
            continue
        args = node.args
        if node.op == "call_module":
            with gm.graph.inserting_before(node):
                module = gm.graph.create_node("get_attr", node.target)
            args = (module, *args)
        node.target = UnderAutocast(node.target, tuple(blocks), node.op)
        node.op, node.args = "call_function", args
        count += 1
    if count:
        gm.recompile()
    return count
