"""Selective recomputation's view of a stage: which nodes keep their results, how the others group.

Reads:  the graph; ``fxpipe.flops`` and ``fxpipe.value`` (from :func:`fxpipe.passes.annotate`)
        when present; in-place writes (:mod:`fxpipe.passes.mutates`, and ``fxpipe.mutates``
        from annotation: :func:`fxpipe.passes.inplace.known_mutations`); ``fxpipe.retains``
        (from :func:`fxpipe.passes.retain`) in :func:`selective_bytes`.
Writes: nothing.

``checkpoint="selective"`` keeps the results of a stage's expensive nodes and recomputes the
others in backward. A node is expensive (:func:`expensive`) when its call target is a GEMM, a
convolution or attention, or when annotation counted at least ``16`` FLOPs per element of its
output (a leaf module doing matmuls). A cheap node's *segment* is its level: how many expensive
nodes the longest path from the stage's inputs to it passes. A segment is recomputed from kept
values, the cheap nodes of one level between two levels of kept ones::

    x ─▶ norm ─▶ [q] [k] [v] ─▶ rope ─▶ [attention] ─▶ [o] ─▶ add, norm ─▶ [gate] [up] ─▶ silu, mul ─▶ [down] ─▶ add
         level 0               level 1                      level 3                      level 4            level 5

A cheap value that a cheap node of another level reads (the residual stream) is kept too (a
*crossing* value), so no recomputation reaches back through the stage. Nodes of one level that
run one after another in the graph form a *run*, the unit in which random numbers are replayed.
Some nodes are kept whatever the rule says: an in-place write and every node from the value it
writes to it (a recomputation would write twice), a norm updating running statistics, and a
node reading a buffer the stage writes in place (a spectral norm's power iteration: recomputed
in backward, it would read the value later micro-batches left).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from fxpipe.passes.inplace import known_mutations, written_state
from fxpipe.passes.mutates import aliases, op_name, unwrapped
from fxpipe.passes.selectswap import swaps
from fxpipe.passes.spec import TensorSpec
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["INTENSITY", "SelectiveBytes", "SelectivePlan", "expensive", "selective_bytes", "selective_plan"]

INTENSITY = 16  # FLOPs per output element from which an annotated node counts as expensive

_MODULES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.MultiheadAttention, nn.RNNBase)
_FUNCTIONS = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
              F.conv_transpose3d, F.scaled_dot_product_attention, F.multi_head_attention_forward,
              torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.einsum,
              torch.tensordot, torch._C._nn.linear, operator.matmul}
_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__", "__rmatmul__"}
_ATEN = {"linear", "mm", "bmm", "addmm", "baddbmm", "matmul", "convolution", "conv1d", "conv2d", "conv3d",
         "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "einsum"}


def _elements(node: torch.fx.Node) -> int:
    """Return the number of elements of the tensors in a node's annotated value (0 if unknown)."""
    leaves = tree_flatten(node.meta.get("fxpipe.value"), is_leaf=lambda v: isinstance(v, TensorSpec))[0]
    total = 0
    for leaf in leaves:
        if isinstance(leaf, TensorSpec):
            count = 1
            for d in leaf.shape:
                count *= int(d)
            total += count
    return total


def expensive(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` is a GEMM, a convolution or attention (the default of ``save=``)."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(str(node.target)) if owner is not None else None
        if isinstance(module, _MODULES):
            return True
    elif node.op == "call_function":
        target = node.target
        if target in _FUNCTIONS:
            return True
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
                target.__name__.split(".")[0] in _ATEN:
            return True
    elif node.op == "call_method" and node.target in _METHODS:
        return True
    flops, elements = node.meta.get("fxpipe.flops") or 0, _elements(node)
    return elements > 0 and flops >= INTENSITY * elements


# torch functions writing their buffer arguments unseen by the graph (fx traces QAT's fake-quant modules to these)
_UNSEEN_WRITES = {"fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq_helper"}
_STATEFUL_OPS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                 "instance_norm", "cudnn_batch_norm", "miopen_batch_norm"}  # ATen ops writing running statistics


def _stateful(node: torch.fx.Node) -> bool:
    """Tell whether a node updates running statistics (a recomputation would update them twice).

    A module called whole that holds buffers may write them inside its forward, unseen by the
    graph and, where a fused kernel writes them, by their version counters too (a QAT observer's
    ``min_val`` and ``scale``): it is kept, not recomputed.
    """
    call = unwrapped(node)  # a mode-guarded call too
    if call.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(str(call.target)) if owner is not None else None
        if isinstance(module, nn.modules.batchnorm._NormBase):
            return module.track_running_stats
        return module is not None and next(module.buffers(), None) is not None
    if call.op != "call_function":
        return False
    if call.target in (F.batch_norm, F.instance_norm) or op_name(call.target) in _UNSEEN_WRITES:
        return True
    if not isinstance(call.target, torch._ops.OpOverload) or op_name(call.target) not in _STATEFUL_OPS:
        return False
    args = list(call.args) + [None] * 6  # an exported batch norm: stateful with running statistics, in training
    return op_name(call.target) != "batch_norm" or (isinstance(args[3], torch.fx.Node) and args[5] is not False)


def _statistics(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Return the ``get_attr`` nodes of running statistics: a norm's buffers, or what a stateful node reads.

    The norm updates them unseen by the graph; a node that reads them too (a weight scaled by
    ``1 / sqrt(bn.running_var + eps)`` before the norm runs) would read a later micro-batch's
    values when recomputed.
    """
    found = set()
    buffers = {name for name, _ in gm.named_buffers()}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in buffers:
            continue
        owner, _, _ = str(node.target).rpartition(".")
        try:
            module = gm.get_submodule(owner)
        except AttributeError:
            module = None
        if (isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats) or any(
                _stateful(u) for u in node.users):
            found.add(node)
    return found


@dataclass
class SelectivePlan:
    """Per compute node of a stage (graph order): kept or recomputed, its segment and run, whether it crosses."""

    names: list[str]
    saved: list[bool]  # its result is kept, never recomputed
    segment: list[int]  # the level of a recomputed node (-1 for a kept one)
    crossing: list[bool]  # a recomputed node whose value another level (or stage) reads: kept too
    run: list[int]  # the run of a recomputed node: consecutive nodes of one segment (-1 for a kept one)

    def candidate(self, k: int) -> bool:
        """Tell whether node ``k``'s value may be kept: a kept node's, or a crossing one."""
        return self.saved[k] or self.crossing[k]

    @property
    def segments(self) -> int:
        """Return the number of segment ids (levels; some may hold no node)."""
        return 1 + max(self.segment, default=-1)

    @property
    def runs(self) -> int:
        """Return the number of runs."""
        return 1 + max(self.run, default=-1)


def _judged(save: Callable[[torch.fx.Node], bool] | None, node: torch.fx.Node) -> bool:
    """Ask ``save`` (default :func:`expensive`) whether ``node`` keeps its result, naming the node if it raises."""
    if save is None:
        return bool(expensive(node))
    try:
        return bool(save(node))
    except Exception as err:
        raise TypeError(f"save= raised {type(err).__name__}: {err} on node {node.name!r} "
                        f"(op={node.op!r}, target={getattr(node.target, '__name__', node.target)!r}): save(node) "
                        f"receives every call node of a stage (call_module, call_function and call_method), so "
                        f"check node.op before reading node.target") from err


def selective_plan(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node] | None = None,
                   save: Callable[[torch.fx.Node], bool] | None = None,
                   mutations: Mapping[torch.fx.Node, Sequence[torch.fx.Node]] | None = None) -> SelectivePlan:
    """Plan selective recomputation over ``nodes`` (default: ``gm``'s compute nodes) with predicate ``save``.

    ``nodes`` are one stage's compute nodes in graph order; a value read by a node outside
    them (another stage, the output) crosses. ``save(node)`` tells which nodes keep their
    results (default :func:`expensive`, and the cheap values :func:`fxpipe.passes.selectswap.swaps`
    keeps instead of recomputing). ``mutations`` is ``known_mutations(gm)`` when the caller has it
    already.
    """
    if nodes is None:
        nodes = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    index = {n: k for k, n in enumerate(nodes)}
    saved = [_judged(save, n) or _stateful(n) for n in nodes]
    mutations = known_mutations(gm) if mutations is None else mutations
    state = written_state(gm) | _statistics(gm)  # buffers written in place and their views; running statistics
    for k, n in enumerate(nodes):  # a reader of such a buffer would read a later value when recomputed
        saved[k] = saved[k] or any(a in state for a in n.all_input_nodes)
    for node, written in mutations.items():
        if node not in index:  # the value written, and everything up to the write
            continue
        first = min((index[w] for w in written if w in index), default=index[node])
        for k in range(first, index[node] + 1):
            saved[k] = True
    segment, crossing = _levels(nodes, index, saved)
    if save is None:  # the default rule: keep a cheap value where recomputing it saves nothing (selectswap)
        chosen = swaps(nodes, saved, [saved[k] or crossing[k] for k in range(len(nodes))])
        if chosen:
            saved = [saved[k] or k in chosen for k in range(len(nodes))]
            segment, crossing = _levels(nodes, index, saved)
    run, current = [], -1
    for k in range(len(nodes)):
        if not saved[k] and (k == 0 or segment[k - 1] != segment[k]):
            current += 1
        run.append(-1 if saved[k] else current)
    return SelectivePlan([n.name for n in nodes], saved, segment, crossing, run)


def _levels(nodes: Sequence[torch.fx.Node], index: Mapping[torch.fx.Node, int], saved: Sequence[bool]
            ) -> tuple[list[int], list[bool]]:
    """Return each node's segment (its level; -1 if kept) and whether its value crosses levels."""
    level: list[int] = []
    for k, n in enumerate(nodes):
        below = max((level[index[a]] for a in n.all_input_nodes if a in index), default=0)
        level.append(below + saved[k])
    segment = [-1 if saved[k] else level[k] for k in range(len(nodes))]
    crossing = [not saved[k] and any(index.get(u) is None or (not saved[index[u]] and level[index[u]] != level[k])
                                     for u in n.users) for k, n in enumerate(nodes)]
    return segment, crossing


@dataclass
class SelectiveBytes:
    """What selective recomputation keeps of one micro-batch, and recomputes in backward."""

    kept: dict[str, float]  # value -> bytes kept from forward to backward (besides the stage's own)
    internal: float  # storage no value holds, kept by the kept nodes (norm statistics, masks)
    redo: float  # the most a recomputation holds at once
    rerun: list[str]  # the nodes recomputed in backward


def _root(node: torch.fx.Node, index: Mapping[str, int]) -> str:
    """Return the name of the value whose storage ``node``'s value lives in (through views)."""
    while node.name in index:
        shared = aliases(node)
        if not shared:
            break
        node = shared[0]
    return node.name


def selective_bytes(nodes: Sequence[torch.fx.Node], plan: SelectivePlan, size: Mapping[str, float],
                    free: Iterable[str], scale: float = 1.0) -> SelectiveBytes:
    """Account one micro-batch of selective recomputation over ``nodes`` from ``fxpipe.retains``.

    ``size`` gives each value's bytes for the micro-batch, ``free`` the values that cost
    nothing here (the stage's inputs and outputs, the caller's batch); retained bytes are
    multiplied by ``scale``. Mirrors the runtime (:mod:`fxpipe.runtime.stage.selective`): a
    saved tensor whose storage is a kept or free value is kept; one of a cheap value, or made
    inside a cheap node, is recomputed in that value's segment from the kept values it reads.
    ``redo`` is the most a recomputation holds at one node: its value, its saves, and those of the
    recomputed values it reads.
    """
    free = set(free)
    index = {n.name: k for k, n in enumerate(nodes)}
    kept: dict[str, float] = {}
    internal = 0.0
    packs = [0.0] * len(nodes)  # storage a recomputed node's backward saves that no value holds
    rerun: set[int] = set()
    for k, n in enumerate(nodes):
        for v, nbytes in (n.meta.get("fxpipe.retains") or {}).items():
            j = index.get(v)
            if v == "" and plan.saved[k]:
                internal += nbytes * scale
            elif v == "":
                rerun.add(k)
                packs[k] += nbytes * scale
            elif v in free or j is None or plan.candidate(j):
                if v not in free:
                    kept[v] = max(kept.get(v, 0.0), nbytes * scale)
            else:
                rerun.add(j)
    stack = list(rerun)
    while stack:  # a recomputed node reads kept values, or recomputes the cheap ones of its segment
        k = stack.pop()
        for a in nodes[k].all_input_nodes:
            j = index.get(a.name)
            if j is None or j in rerun:
                continue
            if plan.candidate(j):
                root = _root(a, index)
                if root not in free and a.name not in free:
                    kept[root] = max(kept.get(root, 0.0), size.get(root, 0.0))
            else:
                rerun.add(j)
                stack.append(j)
    own = [0.0 if aliases(n) else size.get(n.name, 0.0) for n in nodes]  # a view holds no storage of its own
    redo = 0.0  # live at one recomputed node: what it reads that was recomputed, what it makes and saves
    for k in rerun:
        reads = {index[a.name] for a in nodes[k].all_input_nodes if index.get(a.name) in rerun}
        redo = max(redo, own[k] + packs[k] + sum(own[j] + packs[j] for j in reads))
    return SelectiveBytes(kept, internal, redo, [plan.names[k] for k in sorted(rerun)])
