"""Markers in a stage's code: after each compute node, the tape recording on this thread hears of its value.

Selective recomputation (:mod:`fxpipe.runtime.stage.selective`) tells a saved tensor apart by
the storage it lives in, so it must know which node made each value. The stage runs a copy of
its GraphModule with a call of :func:`made` after every compute node::

    h = self.norm(x); made(0, h); y = self.up(h); made(1, y); ...

Outside a recording (:func:`recording`) the marker does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

__all__ = ["COMPUTE", "instrument", "made", "recording"]

COMPUTE = ("call_module", "call_function", "call_method")
_local = threading.local()  # .tape: what records a forward on this thread


def made(k: int, value: Any) -> None:
    """Tell the tape recording on this thread that compute node ``k`` made ``value`` (the marker)."""
    tape = getattr(_local, "tape", None)
    if tape is not None:
        tape.made(k, value)


def instrument(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Return a copy of ``gm`` calling :func:`made` after each compute node (names, meta and modules kept)."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    k = 0
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = node.meta
        if node.op in COMPUTE:
            graph.call_function(made, (k, env[node]))
            k += 1
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


@contextmanager
def recording(tape: Any) -> Iterator[None]:
    """Let the markers of forwards run on this thread in the block tell ``tape`` (its ``made(k, value)``)."""
    before = getattr(_local, "tape", None)
    _local.tape = tape
    try:
        yield
    finally:
        _local.tape = before
