"""Give every read of a buffer written in place in the forward the value as written, per micro-batch.

Reads:  ``node.meta["fxpipe.stage"]`` (from :func:`fxpipe.passes.partition`), the in-place ops
        of :mod:`fxpipe.passes.mutates` (and ``fxpipe.mutates`` where annotation wrote it).
Writes: the graph: a ``clone`` of the buffer right after its last write before a read, in the
        writing stage, read instead of the buffer (meta copied from the value cloned, with the
        writer's stage, no cost and ``fxpipe.as_written``); returns a :class:`BufferReads`.

A buffer is state, not a per-micro-batch value: each stage reads it where it lives. In a
pipeline every stage runs several micro-batches' forwards before their backwards, so a read
after a write sees later micro-batches' writes::

    eager, per micro-batch m:   stage i: step.add_(1)  ...  stage k: h * step     (step = m + 1)
    pipeline:                   stage i runs micro-batches 0, 1, ... before stage k runs 0
                                 -> stage k reads step = 2 for micro-batch 0  (another rank: 0)
    after this pass:            stage i: step.add_(1); s = step.clone() ──s──▶ stage k: h * s

The same holds inside one stage: ``scale.mul_(1.1); h * scale`` saves the buffer for backward,
which the next micro-batch's write changes (autograd's "modified by an inplace operation", or,
recomputed, the value put back after the recomputation). So every read after a write takes the
value right after the last write before it (a later stage's through a routed value). Reads this
cannot fix are returned for the caller to warn of: a stage reading a buffer before a *later*
stage writes it (each micro-batch should see the previous one's write), a stage reading a
buffer that it and an earlier stage both write, and a buffer written by several stages.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from fxpipe.passes.inplace import known_mutations
from fxpipe.passes.mutates import aliases, op_name, unwrapped, written_args

__all__ = ["BufferReads", "read_before_write", "route_buffer_reads"]

_NO_COST = {"fxpipe.flops": 0, "fxpipe.flops_bwd": 0, "fxpipe.saved_bytes": 0, "fxpipe.param_bytes": 0, "fxpipe.grad_bytes": 0,
            "fxpipe.mutates": []}


@dataclass
class BufferReads:
    """What :func:`route_buffer_reads` did, and what it could not fix.

    ``routed``: the clones it made. ``unordered``: (buffer, writer, its stage, reader, its stage)
    of reads no clone makes eager's. ``spread``: (buffer, the stages writing it).
    """

    routed: list[str] = field(default_factory=list)
    unordered: list[tuple[str, str, int, str, int]] = field(default_factory=list)
    spread: list[tuple[str, list[int]]] = field(default_factory=list)


def _state_of(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, str], dict[str, list[torch.fx.Node]]]:
    """Map each node sharing a buffer's storage to the buffer's name; map each buffer to the nodes writing it.

    A parameter written in place counts as a buffer (a momentum encoder's frozen target, a weight
    pruned under ``torch.no_grad()``): its later readers take the value as written too.
    """
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)} | \
        {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    owner: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in buffers:
            owner[node] = str(node.target)
        else:
            through = _through_body(node)
            held = {owner[a] for a in ([through] if through is not None else aliases(node)) if a in owner}
            if len(held) == 1 and not isinstance(node.meta.get("fxpipe.value"), (list, tuple, dict)) and \
                    not isinstance(node.target, torch._ops.HigherOrderOperator):
                owner[node] = held.pop()  # a tensor sharing its storage (not a tuple of a block's outputs)
    writers: dict[str, list[torch.fx.Node]] = {}
    for node, changed in known_mutations(gm).items():
        written = [a for v in written_args(node) for a in (v if isinstance(v, (list, tuple)) else [v])]
        for name in {owner[a] for a in [*changed, *written] if a in owner}:
            writers.setdefault(name, []).append(node)
    return owner, writers


def _through_body(node: torch.fx.Node) -> torch.fx.Node | None:
    """Return the argument of a higher-order op whose storage ``getitem(op, k)`` shares, where its body says so.

    torch.export wraps a ``torch.no_grad()`` block in ``wrap_with_set_grad_enabled(False, body,
    *args)``; a buffer the block writes comes back as an output of the body aliasing one of its
    placeholders (``copy_(b_mean, ...)``), read afterwards through ``getitem``.
    """
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 or \
            not isinstance(node.args[0], torch.fx.Node) or not isinstance(node.args[1], int):
        return None
    op, k = node.args[0], node.args[1]
    owner = op.graph.owning_module
    if not isinstance(op.target, torch._ops.HigherOrderOperator) or owner is None:
        return None
    bodies = [(i, a) for i, a in enumerate(op.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
              and isinstance(getattr(owner, str(a.target), None), torch.fx.GraphModule)]
    if len(bodies) != 1:
        return None
    at, attr = bodies[0]
    body: torch.fx.GraphModule = getattr(owner, str(attr.target))
    out = next(n for n in body.graph.nodes if n.op == "output").args[0]
    value = out[k] if isinstance(out, (tuple, list)) and k < len(out) else None
    while isinstance(value, torch.fx.Node) and value.op != "placeholder":
        found = aliases(value)
        value = found[0] if len(found) == 1 else None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if value not in placeholders:
        return None
    position = at + 1 + placeholders.index(value)
    arg = op.args[position] if position < len(op.args) else None
    return arg if isinstance(arg, torch.fx.Node) else None


def _clones(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` is a clone (the model's own, as torch's spectral norm clones its vectors)."""
    return node.op in ("call_function", "call_method") and \
        str(getattr(node.target, "__name__", node.target)).split(".")[0] == "clone"


def _norm_writers(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Map each running statistic to the batch norms updating it (a module call, an exported op in training).

    Their updates are not in-place ops of the graph; they count only where a stage reads the
    statistic before a later stage's norm updates it (``w / sqrt(bn.running_var)``, a fused QAT ConvBn).
    """
    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        call = unwrapped(node)
        names: list[str] = []
        if call.op == "call_module":
            module = gm.get_submodule(str(call.target))
            if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats:
                names = [f"{call.target}.running_mean", f"{call.target}.running_var"]
        elif call.op == "call_function" and "batch_norm" in op_name(call.target):
            args = list(call.args) + [None] * 6
            if args[5] is not False:
                names = [str(a.target) for a in args[3:5] if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
        for name in names:
            found.setdefault(name, []).append(node)
    return found


def read_before_write(gm: torch.fx.GraphModule, order: list[torch.fx.Node]) -> set[int]:
    """Return the positions of ``order`` no stage may begin at, so that a buffer read before a later write stays with it.

    A stage reading a buffer that a later stage writes (``w / sqrt(bn.running_var)`` before the
    norm updating it: an exported QAT ConvBn) reads it before the earlier micro-batches' writes
    (:func:`route_buffer_reads` warns of it); in one stage each micro-batch reads it in eager's order.
    """
    owner, writers = _state_of(gm)
    written = {name: set(nodes) for name, nodes in writers.items()}
    for name, nodes in _norm_writers(gm).items():
        written.setdefault(name, set()).update(nodes)
    pos = {n: i for i, n in enumerate(order)}
    joined: set[int] = set()
    for reader in order:
        for name in {owner[v] for v in reader.all_input_nodes if v in owner} & written.keys():
            if reader in written[name] or owner.get(reader) == name and any(u in written[name] for u in reader.users):
                continue  # a write, or an alias a write goes through
            later = [pos[w] for w in written[name] if pos.get(w, -1) > pos[reader]]
            if later:
                joined.update(range(pos[reader] + 1, max(later) + 1))
    return joined


def _find(gm: torch.fx.GraphModule, found: BufferReads) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, str] | None:
    """Return the first (reader, value read, last earlier-stage write, buffer) to route, noting reads that cannot be."""
    owner, writers = _state_of(gm)
    norms = _norm_writers(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    stage = {n: n.meta["fxpipe.stage"] for n in gm.graph.nodes}
    for reader in gm.graph.nodes:
        if reader.op in ("get_attr", "output") or reader.meta.get("fxpipe.as_written"):
            continue
        for value in reader.all_input_nodes:
            name = owner.get(value)
            if name is not None and reader not in norms.get(name, ()) and any(
                    stage[w] > stage[reader] for w in norms.get(name, ())):  # before a later stage's norm updates it
                w = next(w for w in norms[name] if stage[w] > stage[reader])
                note = (name, w.name, stage[w], reader.name, stage[reader])
                if note not in found.unordered:
                    found.unordered.append(note)
                continue
            if name is None or reader in writers.get(name, ()) or (
                    owner.get(reader) == name and any(u in writers.get(name, ()) for u in reader.users)):
                continue  # not a read: a write, or an alias a write goes through (ema.mul_(a).add_(b), detached between)
            before = [w for w in writers.get(name, ()) if order[w] < order[reader]]
            earlier = [w for w in before if stage[w] < stage[reader]]
            later = [w for w in writers.get(name, ()) if stage[w] > stage[reader]]
            if later or (earlier and len(earlier) < len(before)):
                w = (later or [b for b in before if b not in earlier])[0]
                note = (name, w.name, stage[w], reader.name, stage[reader])
                if note not in found.unordered:
                    found.unordered.append(note)
                continue
            if not before:
                continue
            last = max(before, key=order.__getitem__)
            if stage[last] == stage[reader] and _clones(reader):
                continue  # a copy taken in the writing stage is the value as written already
            if value.op == "get_attr" or stage[value] == stage[last]:
                return reader, value, last, name
    return None


def route_buffer_reads(gm: torch.fx.GraphModule) -> BufferReads:
    """Make every read of a buffer after a write read the value as written (a clone); return what was done."""
    found = BufferReads()
    _, writers = _state_of(gm)
    for name, nodes in writers.items():
        stages = sorted({n.meta["fxpipe.stage"] for n in nodes})
        if len(stages) > 1:
            found.spread.append((name, stages))
    made: dict[tuple[torch.fx.Node, torch.fx.Node], torch.fx.Node] = {}
    while (hit := _find(gm, found)) is not None:
        reader, value, last, name = hit
        clone = made.get((value, last))
        if clone is None:
            clone = _clone_after(gm, value, last, name)
            made[(value, last)] = clone
            found.routed.append(clone.name)
        reader.replace_input_with(value, clone)
    if found.routed:
        gm.recompile()
    return found


def _clone_after(gm: torch.fx.GraphModule, value: torch.fx.Node, last: torch.fx.Node, buffer: str) -> torch.fx.Node:
    """Insert, in ``last``'s stage, a clone of ``value`` taken after ``last`` (and after ``value``)."""
    nodes = list(gm.graph.nodes)
    source = value
    if value.op == "get_attr" and nodes.index(value) > nodes.index(last):  # read again further on: read it here
        with gm.graph.inserting_after(last):
            source = gm.graph.get_attr(str(value.target))
        source.meta = {**value.meta, "fxpipe.stage": last.meta["fxpipe.stage"]}
    where = max(last, source, key=nodes.index) if source in nodes else source
    with gm.graph.inserting_after(where):
        clone = gm.graph.create_node("call_function", torch.ops.aten.clone.default, (source,),
                                     name=f"{buffer.replace('.', '_')}_as_written")
    clone.meta = {**{k: v for k, v in value.meta.items() if k != "nn_module_stack"}, **_NO_COST,
                  "fxpipe.stage": last.meta["fxpipe.stage"], "fxpipe.as_written": True}
    return clone
