"""Send a buffer's value to the later stages that read it after an earlier stage wrote it.

Reads:  ``node.meta["fxpipe.stage"]`` (from :func:`fxpipe.passes.partition`), the in-place ops
        of :mod:`fxpipe.passes.mutates` (and ``fxpipe.mutates`` where annotation wrote it).
Writes: the graph: a ``clone`` of the buffer right after its last write in the writing stage,
        read instead of the buffer by the later stage (meta copied from the value cloned, with
        the writer's stage and no cost); returns a :class:`BufferReads`.

A buffer is state, not a per-micro-batch value: each stage reads it where it lives. A stage
that reads a buffer an earlier stage changed in place (a step counter bumped at the start of
the forward and read again at the end) reads it too late in a pipeline, after the earlier
stage has run later micro-batches, and on another rank it reads its own copy, which nothing
changes::

    eager, per micro-batch m:   stage i: step.add_(1)  ...  stage k: h * step     (step = m + 1)
    pipeline:                   stage i runs micro-batches 0, 1, ... before stage k runs 0
                                 -> stage k reads step = 2 for micro-batch 0  (another rank: 0)
    after this pass:            stage i: step.add_(1); s = step.clone() ──s──▶ stage k: h * s

So the value each micro-batch saw is taken right after the last write of the earlier stage
and routed like any other value. Reads this cannot fix are returned for the caller to warn
of: a stage reading a buffer before a *later* stage writes it (each micro-batch should see
the previous one's write), and a stage reading a buffer that it and an earlier stage both
write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from fxpipe.passes.inplace import known_mutations
from fxpipe.passes.mutates import aliases, written_args

__all__ = ["BufferReads", "route_buffer_reads"]

_NO_COST = {"fxpipe.flops": 0, "fxpipe.flops_bwd": 0, "fxpipe.saved_bytes": 0, "fxpipe.param_bytes": 0,
            "fxpipe.mutates": []}


@dataclass
class BufferReads:
    """What :func:`route_buffer_reads` did: the clones it made, and (buffer, writer, its stage, reader, its stage) it could not fix."""

    routed: list[str] = field(default_factory=list)
    unordered: list[tuple[str, str, int, str, int]] = field(default_factory=list)


def _state_of(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, str], dict[str, list[torch.fx.Node]]]:
    """Map each node sharing a buffer's storage to the buffer's name; map each buffer to the nodes writing it."""
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    owner: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in buffers:
            owner[node] = str(node.target)
        else:
            held = {owner[a] for a in aliases(node) if a in owner}
            if len(held) == 1:
                owner[node] = held.pop()
    writers: dict[str, list[torch.fx.Node]] = {}
    for node, changed in known_mutations(gm).items():
        written = [a for v in written_args(node) for a in (v if isinstance(v, (list, tuple)) else [v])]
        for name in {owner[a] for a in [*changed, *written] if a in owner}:
            writers.setdefault(name, []).append(node)
    return owner, writers


def _find(gm: torch.fx.GraphModule, found: BufferReads) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, str] | None:
    """Return the first (reader, value read, last earlier-stage write, buffer) to route, noting reads that cannot be."""
    owner, writers = _state_of(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    stage = {n: n.meta["fxpipe.stage"] for n in gm.graph.nodes}
    for reader in gm.graph.nodes:
        if reader.op in ("get_attr", "output"):
            continue
        for value in reader.all_input_nodes:
            name = owner.get(value)
            if name is None or reader in writers.get(name, ()):
                continue
            before = [w for w in writers.get(name, ()) if order[w] < order[reader]]
            earlier = [w for w in before if stage[w] < stage[reader]]
            later = [w for w in writers.get(name, ()) if stage[w] > stage[reader]]
            if later or (earlier and len(earlier) < len(before)):
                w = (later or [b for b in before if b not in earlier])[0]
                note = (name, w.name, stage[w], reader.name, stage[reader])
                if note not in found.unordered:
                    found.unordered.append(note)
                continue
            if not earlier:
                continue
            last = max(earlier, key=order.__getitem__)
            if value.op == "get_attr" or stage[value] == stage[last]:
                return reader, value, last, name
    return None


def route_buffer_reads(gm: torch.fx.GraphModule) -> BufferReads:
    """Make later stages read the value of a buffer an earlier stage wrote, as of that write; return what was done."""
    found = BufferReads()
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
                  "fxpipe.stage": last.meta["fxpipe.stage"]}
    return clone
