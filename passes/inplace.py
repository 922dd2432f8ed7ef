"""Find in-place ops on values that cross stages; plan copies for them or report conflicts.

Reads:  ``node.meta["fxpipe.stage"]`` (from :func:`fxpipe.passes.partition`) and
        ``node.meta["fxpipe.mutates"]`` (from :func:`fxpipe.passes.annotate`); without annotations,
        in-place ops are found from the graph by :mod:`fxpipe.passes.mutates` (schemas of ATen
        ops, names, ``inplace=True``) and followed through views (:func:`static_mutations`).
Writes: nothing; returns a :class:`MutationPlan`.

A stage that changes one of its *inputs* in place (a model input, a boundary value, a popped
skip, or a view of one) breaks the pipeline in three ways: its recomputation in backward
would see the changed input instead of the one its first forward saw; an earlier stage
that read the same value and is recomputed later would see it changed too; and a copy of
the value on another device would not change at all::

    stage i ──v──▶ stage j: v.mul_(2) ...        recompute(j) reads 2v, not v
       └───────────────────────▶ stage k > j     reads v (a stash, or a copy): eager reads 2v

So the stage works on a private copy of such an input, made on entry (``copy_on_write``):
its forward, its recomputation and every other stage see exactly the values eager sees, as
long as no *later* stage reads the changed value through the original. That last case (the
third arrow) cannot be pipelined: it is reported as a :class:`Conflict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from fxpipe.passes.mutates import aliases, unwrapped, written_args
from fxpipe.passes.nesting import nesting_regions
from torch.utils._pytree import tree_map

__all__ = [
    "Conflict",
    "MutationPlan",
    "clone_tree",
    "copy_on_write",
    "joined_positions",
    "known_mutations",
    "plan_mutations",
    "static_mutations",
    "written_state",
]


@dataclass
class Conflict:
    """An in-place change in stage ``stage`` (node ``node``) of ``value``, read later by ``reader``."""

    node: str
    stage: int
    value: str
    reader: str | None = None
    reader_stage: int | None = None
    aliases: list[str] = field(default_factory=list)


@dataclass
class MutationPlan:
    """Per stage, the inputs that stage changes in place (to copy on entry); and the conflicts."""

    copies: dict[int, list[str]] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)
    mutated_model_inputs: list[str] = field(default_factory=list)


def _storage_groups(gm: torch.fx.GraphModule) -> tuple[Any, dict[torch.fx.Node, list[torch.fx.Node]]]:
    """Group nodes that may share storage; return the group of a node (a function) and each in-place op's targets."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        for a in aliases(node):  # views and in-place results share their input's storage
            parent[root(node)] = root(a)
        written = [n for v in written_args(node) for n in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(n, torch.fx.Node)]
        if written:
            found[node] = written
    return root, found


def static_mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Find in-place ops from the graph; return each with the earlier nodes that may share its storage."""
    root, found = _storage_groups(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    out = {}
    for node, written in found.items():
        groups = {root(w) for w in written}
        out[node] = [n for n in gm.graph.nodes if order[n] < order[node] and n.op != "get_attr"
                     and root(n) in groups]
    return out


def known_mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Return :func:`static_mutations` joined with what annotation saw change (``fxpipe.mutates``, by storage).

    Annotation names every earlier value living in the storage an op changed, which the graph
    alone may not show: a module returning its input (timm's ``GroupNormAct``: norm, an
    ``nn.Identity``, then an in-place activation writes the norm's output).
    """
    out = static_mutations(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        seen = [by_name[v] for v in node.meta.get("fxpipe.mutates") or () if v in by_name]
        if seen:
            have = out.setdefault(node, [])
            have += [n for n in seen if n not in have]
    return out


def written_state(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Return the ``get_attr`` nodes of buffers the graph writes in place, with every node that may share their storage."""
    root, found = _storage_groups(gm)
    state = {root(n) for n in gm.graph.nodes if n.op == "get_attr"}  # a write through an alias writes the buffer too
    groups = {root(w) for written in found.values() for w in written} & state
    return {n for n in gm.graph.nodes if root(n) in groups}


def _mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Return each mutating node with the earlier nodes whose storage it changed."""
    nodes = list(gm.graph.nodes)
    if not all("fxpipe.mutates" in n.meta for n in nodes):
        return static_mutations(gm)
    by_name = {n.name: n for n in nodes}
    return {n: [by_name[v] for v in n.meta["fxpipe.mutates"]] for n in nodes if n.meta["fxpipe.mutates"]}


def joined_positions(gm: torch.fx.GraphModule, order: list[torch.fx.Node]) -> set[int]:
    """Return the positions of ``order`` no stage may begin at, so that no cut makes a conflict.

    An in-place op stays in the stage of the values it changes (no cut from the first of them
    up to it); one that changes a model input also stays with every later reader of it, so
    that its stage alone works on the private copy. A node marked ``fxpipe.detaches`` (the
    detach of a value leaving a ``torch.no_grad()`` block) stays with the node it detaches, so
    that value never crosses a boundary still carrying a gradient. An exported batch norm stays
    with the ``add_`` of its ``num_batches_tracked``, so that deferring it finds its counter. An
    exported ``torch.vmap`` stays whole (:mod:`fxpipe.passes.nesting`).
    """
    pos = {n: i for i, n in enumerate(order)}
    joined: set[int] = set()
    for node in order:
        if node.meta.get("fxpipe.detaches"):
            made = [pos[a] for a in node.all_input_nodes if a in pos]
            if made:
                joined.update(range(min(made) + 1, pos[node] + 1))
    for start, end in nesting_regions(order):  # an exported torch.vmap: its level opens and closes in one stage
        joined.update(range(start + 1, end + 1))
    for counter, norm in _counted_norms(order):  # an exported batch norm and the add_ of its counter
        joined.update(range(min(pos[counter], pos[norm]) + 1, max(pos[counter], pos[norm]) + 1))
    for node, group in _mutations(gm).items():
        if node not in pos:
            continue
        made = [pos[u] for u in group if u in pos]
        if made:
            joined.update(range(min(made) + 1, pos[node] + 1))
        if any(u.op == "placeholder" for u in group):
            last = max((pos.get(r, -1) for u in group for r in u.users), default=-1)
            joined.update(range(pos[node] + 1, last + 1))
    return joined


def _counted_norms(order: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Pair each ``aten.batch_norm`` on a module's running statistics with the in-place op on that module's counter."""
    counters: dict[str, torch.fx.Node] = {}
    for node in order:
        for v in written_args(node):
            if isinstance(v, torch.fx.Node) and v.op == "get_attr" and str(v.target).endswith("num_batches_tracked"):
                counters[str(v.target)[: -len("num_batches_tracked")]] = node
    pairs = []
    for node in order:
        call = unwrapped(node)  # a mode-guarded batch norm too
        stats = call.args[3] if call.op == "call_function" and call.target is torch.ops.aten.batch_norm.default \
            and len(call.args) > 3 else None
        if isinstance(stats, torch.fx.Node) and stats.op == "get_attr" and str(stats.target).endswith("running_mean"):
            counter = counters.get(str(stats.target)[: -len("running_mean")])
            if counter is not None:
                pairs.append((counter, node))
    return pairs


def plan_mutations(gm: torch.fx.GraphModule) -> MutationPlan:
    """Decide, for every in-place op on a value from outside its stage, a copy or a conflict."""
    stage = {n: n.meta["fxpipe.stage"] for n in gm.graph.nodes}
    plan = MutationPlan()
    for node, group in _mutations(gm).items():
        j = stage[node]
        outside = [u for u in group if u.op == "placeholder" or stage[u] < j]
        if not outside:
            continue  # a value of the stage's own: eager order, nothing crosses a boundary
        inputs = [u for u in outside if any(stage[r] == j for r in u.users)]
        names = [u.name for u in outside]
        if len(inputs) > 1:  # two inputs share storage: private copies would split them
            plan.conflicts.append(Conflict(node.name, j, inputs[0].name, aliases=names))
            continue
        late = [(r, stage[r]) for u in outside for r in u.users if stage[r] > j]
        for r, k in late[:1]:
            plan.conflicts.append(Conflict(node.name, j, inputs[0].name if inputs else names[0],
                                           r.name, k, aliases=names))
        if late or not inputs:
            continue
        copies = plan.copies.setdefault(j, [])
        if inputs[0].name not in copies:
            copies.append(inputs[0].name)
        if inputs[0].op == "placeholder" and inputs[0].name not in plan.mutated_model_inputs:
            plan.mutated_model_inputs.append(inputs[0].name)
    return plan


def clone_tree(value: Any) -> Any:
    """Return ``value`` with every tensor in it cloned (autograd follows the clone)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def copy_on_write(stage: torch.fx.GraphModule, inputs: list[str]) -> torch.fx.GraphModule:
    """Make ``stage`` read private copies of the named placeholders, made on entry; return it."""
    placeholders = {n.name: n for n in stage.graph.nodes if n.op == "placeholder"}
    last = [n for n in stage.graph.nodes if n.op == "placeholder"][-1]
    for name in inputs:
        ph = placeholders[name]
        with stage.graph.inserting_after(last):
            copy = stage.graph.call_function(clone_tree, (ph,))
        copy.meta = {k: v for k, v in ph.meta.items() if k != "fxpipe.mutates"}
        ph.replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
        last = copy
    stage.recompile()
    return stage
