"""Selective recomputation's swaps: keep a cheap value instead of the kept values only its recomputation reads.

Reads:  ``fxpipe.retains`` (from :func:`fxpipe.passes.retain`) and ``fxpipe.value`` (from
        :func:`fxpipe.passes.annotate`) of a stage's compute nodes.
Writes: nothing.

By default ``checkpoint="selective"`` keeps what the expensive nodes make and recomputes the
cheap nodes between them in backward. Where an expensive node's backward needs a cheap value
whose recomputation needs nothing else of its own (rotary embeddings: multiplications by
constant tables, slices, a stack), recomputing it only to hand it back costs time and saves no
memory: the kept values it is recomputed from are held for it alone. Keeping the cheap value
instead holds no more bytes and recomputes nothing::

    q = linear(h) ─▶ rope (mul by cos/sin, stack) ─▶ q_rot ─▶ attention (saves q_rot)
    default:  keep q (for rope)       backward: recompute rope, then attention's backward
    swapped:  keep q_rot (as big)     backward: attention's backward at once; q is freed

A swap is made for a cheap value ``v`` that a kept node's backward retains when the kept values
its recomputation (its cheap ancestors back to kept values) reads hold at least ``v``'s bytes,
counting only those nothing else reads or retains and that the recomputation still needed for
the region's own backward does not read (a norm's statistics need its input; rotary tables made
per call come back from the tables' state alone): keeping ``v`` then holds no more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx
from fxpipe.passes.spec import TensorSpec
from torch.utils._pytree import tree_flatten

__all__ = ["swaps"]


def _nbytes(node: torch.fx.Node) -> int:
    """Return the bytes of a node's annotated value (0 if unknown)."""
    leaves = tree_flatten(node.meta.get("fxpipe.value"), is_leaf=lambda v: isinstance(v, TensorSpec))[0]
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, TensorSpec))


def _region(j: int, nodes: Sequence[torch.fx.Node], index: dict[str, int], kept: Sequence[bool]
            ) -> tuple[set[int], set[int]] | None:
    """Return node ``j``'s recomputation (its cheap ancestors, itself included, sizes too: ``x.shape``
    needs ``x``) and the kept nodes it reads; None if some ancestor's value is not annotated."""
    region, frontier, stack = {j}, set(), [j]
    while stack:
        for a in nodes[stack.pop()].all_input_nodes:
            i = index.get(a.name)
            if i is None:  # a stage input, a parameter or buffer: there anyway
                continue
            if "fxpipe.value" not in a.meta:
                return None
            if kept[i]:
                frontier.add(i)
            elif i not in region:
                region.add(i)
                stack.append(i)
    return region, frontier


def _still_read(region: set[int], frontier: set[int], nodes: Sequence[torch.fx.Node], index: dict[str, int],
                retains: Sequence[dict[str, int]]) -> set[int]:
    """Return the kept nodes that what ``region`` must still recompute for its own backward reads (a).

    A region node recomputes if storage of its own is retained (a norm's statistics, a mask), or if
    a region node retains its value (rotary tables made per call); so do the region nodes it reads.
    """
    redo = {k for k in region for name in retains[k] if name == ""}
    redo |= {index[name] for k in region for name in retains[k] if index.get(name) in region}
    stack = list(redo)
    while stack:
        for a in nodes[stack.pop()].all_input_nodes:
            i = index.get(a.name)
            if i in region and i not in redo:
                redo.add(i)
                stack.append(i)
    return {i for k in redo for a in nodes[k].all_input_nodes if (i := index.get(a.name)) in frontier}


def swaps(nodes: Sequence[torch.fx.Node], saved: Sequence[bool], kept: Sequence[bool]) -> set[int]:
    """Return the positions in ``nodes`` of the cheap nodes to keep as well (see the module); empty without
    ``fxpipe.retains`` on every node.

    ``saved`` tells the nodes kept for their cost, ``kept`` those and the values kept because they
    cross levels (a residual stream, rotary tables read by every block): a recomputation reads both.
    """
    if any("fxpipe.retains" not in n.meta for n in nodes):
        return set()
    retains: list[dict[str, int]] = [n.meta["fxpipe.retains"] for n in nodes]
    index = {n.name: k for k, n in enumerate(nodes)}
    retained_by: dict[int, set[int]] = {}
    for k, names in enumerate(retains):
        for name in names:
            if name in index:
                retained_by.setdefault(index[name], set()).add(k)
    keep, held = list(saved), list(kept)
    chosen: set[int] = set()
    for j in sorted(retained_by):
        if held[j] or not any(keep[k] for k in retained_by[j]):
            continue
        found = _region(j, nodes, index, held)
        if found is None:
            continue
        region, frontier = found
        read = _still_read(region, frontier, nodes, index, retains)
        freed = [i for i in frontier if keep[i] and i not in retained_by and i not in read
                 and all(index.get(c.name) in region for c in nodes[i].users)]
        if freed and sum(_nbytes(nodes[i]) for i in freed) >= _nbytes(nodes[j]) > 0:  # (b)
            keep[j] = held[j] = True
            chosen.add(j)
    return chosen
