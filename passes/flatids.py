"""Find embedding bags that take flat ids with offsets from the split inputs: a jagged batch.

Reads:  the graph (``call_module`` nodes of ``nn.EmbeddingBag``; ``F.embedding_bag`` calls;
        torch.export's ``aten.embedding_bag``/``aten._embedding_bag``) whose ids are a 1-D input
        (or an item of one), the placeholders they depend on, and the ids' ``fxpipe.value``.
Writes: nothing; :func:`flat_ids` names each such bag with the inputs its ids and offsets come from.

Flat ids hold every sample's ids one after another, and the offsets (or the lengths they are
made of) say where each sample's start: the ids have no row per sample. Split on dim 0 into
micro-batches, each would get the ids of other samples; where the ids happen to number the
batch's rows the sizes agree and nothing else tells::

    forward(dense, values, lengths): self.bag(values, torch.cumsum(lengths, 0) - lengths)
    values: (8 ids,) for B = 8 samples of 2, 2, 0, 0, 1, 1, 1, 1 ids
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection

import torch
import torch.fx
import torch.nn.functional as F
from fxpipe.passes.spec import TensorSpec
from torch import nn

__all__ = ["flat_ids", "placeholders_behind"]

_BAG_OPS = frozenset(getattr(packet, name) for packet in (torch.ops.aten.embedding_bag, torch.ops.aten._embedding_bag)
                     for name in packet.overloads())


def _ids_and_offsets(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[object, object] | None:
    """Return an embedding bag call's ids and offsets arguments, or None when ``node`` is none."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.EmbeddingBag):
        ids = node.args[0] if node.args else node.kwargs.get("input")
        return ids, node.args[1] if len(node.args) > 1 else node.kwargs.get("offsets")
    if node.op == "call_function" and node.target is F.embedding_bag:
        ids = node.args[0] if node.args else node.kwargs.get("input")
        return ids, node.args[2] if len(node.args) > 2 else node.kwargs.get("offsets")
    if node.op == "call_function" and node.target in _BAG_OPS:  # (weight, indices, offsets, ...)
        return (node.args[1] if len(node.args) > 1 else None), (node.args[2] if len(node.args) > 2 else None)
    return None


def placeholders_behind(node: object, through: Callable[[torch.fx.Node], bool] = lambda n: True,
                        inputs: Callable[[torch.fx.Node], list[torch.fx.Node]] = lambda n: n.all_input_nodes
                        ) -> set[torch.fx.Node]:
    """Return the placeholders a node's value is computed from, following only the nodes ``through`` accepts.

    ``inputs`` says which of a node's inputs its value is made of (all of them unless told).
    """
    found: set[torch.fx.Node] = set()
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or not through(n):
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        todo.extend(inputs(n))
    return found


def _inputs_of(node: object) -> set[str]:
    """Return the names of the placeholders a node's value is computed from."""
    return {str(p.target) for p in placeholders_behind(node)}


def _input_leaf(node: object) -> str | None:
    """Return the placeholder a node reads as it is (itself, or an item of it), or None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return str(node.target) if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def flat_ids(gm: torch.fx.GraphModule, unbatched: Collection[str] = ()) -> list[tuple[str, list[str]]]:
    """Return each embedding bag given a 1-D input as its ids, with offsets, and the split inputs they come from.

    Ids the forward flattens itself (``x.flatten()`` of a 2-D input, offsets by its row length)
    are split by sample and are not returned.
    """
    found = []
    for node in gm.graph.nodes:
        args = _ids_and_offsets(gm, node)
        if args is None or not isinstance(args[1], torch.fx.Node):
            continue
        ids, offsets = args
        spec = ids.meta.get("fxpipe.value") if isinstance(ids, torch.fx.Node) else None
        if _input_leaf(ids) is None or not (isinstance(spec, TensorSpec) and len(spec.shape) == 1):
            continue
        own = _input_leaf(ids)
        if own not in unbatched and _inputs_of(offsets) <= {own}:
            continue  # offsets from the split ids' own size (torch.arange(len(ids)): one id per sample)
        split = sorted((_inputs_of(ids) | _inputs_of(offsets)) - set(unbatched))
        if split:
            found.append((str(node.target) if node.op == "call_module" else node.name, split))
    return found
