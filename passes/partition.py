"""Cut a GraphModule into contiguous stages: the optimal cut for a cost model, or the user's split points.

Reads:  the cost annotations of :mod:`fxpipe.passes.cost` (from :func:`fxpipe.passes.annotate` and
        :func:`fxpipe.passes.profile`), depending on ``balance_by``.
Writes: ``node.meta["fxpipe.stage"]``, the index of the stage that runs the node, and on
        compute nodes ``node.meta["fxpipe.position"]``, their index in the order that was cut.

Stages are contiguous in a topological order of the compute nodes (:mod:`fxpipe.passes.order`), so a
stage only depends on earlier stages. Placeholders belong to stage 0, the output node to the
last stage, and a ``get_attr`` node to the stage of its first user (the split pass copies it
into every stage that reads it). The graph itself is not reordered: within a stage, the
graph's own order is a valid order too. :func:`assign_by_name` writes a given (saved)
assignment of compute nodes with the same rules and reads no annotations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx
from fxpipe.passes.bufferreads import read_before_write
from fxpipe.passes.cost import BALANCE_KINDS, COMPUTE_OPS, cut_widths, memory_factors, node_costs, node_memory
from fxpipe.passes.cut import NoFeasibleCut, group_costs, min_bottleneck_cut
from fxpipe.passes.gcpause import gc_paused
from fxpipe.passes.inplace import joined_positions
from fxpipe.passes.nesting import nesting_regions
from fxpipe.passes.order import candidate_orders

__all__ = [
    "COMPUTE_OPS",
    "Partition",
    "assign_by_name",
    "assign_stages",
    "balanced_cut",
    "compute_nodes",
    "node_cost",
    "partition",
    "partition_at",
    "stage_costs",
]


@dataclass
class Partition:
    """A cut: its order, each stage's first position, cost and memory estimate, the cut widths."""

    order: list[torch.fx.Node]
    starts: list[int]
    costs: list[float]
    widths: list[float]
    memory: list[float]

    def stage_nodes(self, j: int) -> list[torch.fx.Node]:
        """Return the compute nodes of stage ``j`` in the cut order."""
        end = self.starts[j + 1] if j + 1 < len(self.starts) else len(self.order)
        return self.order[self.starts[j]:end]


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Return the nodes that do work (module, function and method calls), in graph order."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def node_cost(node: torch.fx.Node, balance_by: str) -> float:
    """Return a node's cost under ``balance_by`` from its annotations (0 when missing)."""
    return node_costs([node], balance_by)[0]


def balanced_cut(costs: Sequence[float], n_parts: int) -> list[int]:
    """Return the start index of each of ``n_parts`` contiguous non-empty groups of ``costs``.

    The cut minimizes the largest group sum (:func:`fxpipe.passes.cut.min_bottleneck_cut` without
    communication).
    """
    return min_bottleneck_cut(list(costs), [0.0] * (len(costs) + 1), n_parts)


def assign_stages(gm: torch.fx.GraphModule, starts: Sequence[int],
                  order: Sequence[torch.fx.Node] | None = None) -> None:
    """Write ``fxpipe.stage`` on every node, given where each stage starts in ``order``.

    ``order`` is a topological order of the compute nodes (default: the graph's order).
    """
    order = compute_nodes(gm) if order is None else list(order)
    stage_of: dict[str, int] = {}
    for j, start in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else len(order)
        for i in range(start, end):
            stage_of[order[i].name] = j
            order[i].meta["fxpipe.position"] = i
    assign_by_name(gm, stage_of, len(starts))


def assign_by_name(gm: torch.fx.GraphModule, stage_of: Mapping[str, int], n_stages: int) -> None:
    """Write ``fxpipe.stage`` on every node from a compute-node name -> stage map.

    Placeholders go to stage 0, the output node to stage ``n_stages - 1``, and a ``get_attr``
    node to the first stage among its users. Raises ValueError naming a compute node that
    ``stage_of`` leaves out or puts outside ``range(n_stages)``.
    """
    for node in compute_nodes(gm):
        j = stage_of.get(node.name)
        if j is None or not 0 <= j < n_stages:
            raise ValueError(f"node {node.name!r} is assigned to stage {j}, not to one of the "
                             f"{n_stages} stages; every compute node needs a stage")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["fxpipe.stage"] = 0
        elif node.op == "output":
            node.meta["fxpipe.stage"] = n_stages - 1
        elif node.op == "get_attr":
            users = [stage_of[u.name] for u in node.users if u.op in COMPUTE_OPS]
            node.meta["fxpipe.stage"] = min(users) if users else 0
        else:
            node.meta["fxpipe.stage"] = stage_of[node.name]


def _check_stages(gm: torch.fx.GraphModule, n_stages: int) -> int:
    """Return the number of compute nodes, refusing more stages than nodes."""
    n = sum(1 for node in gm.graph.nodes if node.op in COMPUTE_OPS)
    if n == 0:
        raise ValueError("the model's traced forward computes nothing from its inputs (its output is a constant or an "
                         "input returned as it came): there is nothing to pipeline; check that forward uses its "
                         "inputs, or that its work is not hidden from the tracer (tracer='export' traces the code "
                         "that runs on example_inputs=)")
    if not 1 <= n_stages <= n:
        most = "1 stage" if n == 1 else f"between 1 and {n} stages"
        modules = dict(gm.named_modules())
        whole = [str(node.target) for node in gm.graph.nodes if node.op == "call_module"
                 and any(True for _ in modules[str(node.target)].children())]
        whole.sort(key=lambda w: _kept_by_fx(modules[w]))  # a user's leaf first
        one = len(whole) == 1
        kept = (f" ({'module' if one else 'modules'} {', '.join(repr(w) for w in whole[:3])} "
                f"{'is called as one node' if one else 'are each called as one node'}: trace through "
                f"{'it' if one else 'them'} for more places to cut; {_through(gm, whole[0])})"
                if whole and n_stages > n else "")
        raise ValueError(f"n_stages={n_stages} but the model has {n} compute node{'s' if n != 1 else ''}; "
                         f"use {most}, or pipeline a larger model{kept}")
    return n


def _kept_by_fx(module: torch.nn.Module) -> bool:
    """Tell whether torch.fx keeps ``module`` whole by default (torch.nn's own, but ``Sequential``)."""
    return type(module).__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(module, torch.nn.Sequential)


def _through(gm: torch.fx.GraphModule, name: str) -> str:
    """Say how to trace through a module the graph calls as one node (a user's leaf, or one of torch.nn's)."""
    if gm.meta.get("fxpipe.tracer") == "export":
        return "torch.export inlines every module it can"
    if type(gm.get_submodule(name)).__name__ == "OptimizedModule":  # torch.compile(submodule): kept whole
        return (f"{name!r} was given to torch.compile, which fxpipe calls as one node: pass the plain module and "
                "compile the stages with fxpipe.compile(..., torch_compile=True) instead")
    if _kept_by_fx(gm.get_submodule(name)):
        return (f"the fx tracer keeps torch.nn's own modules such as {name!r} whole: use tracer='export', which "
                "traces through them")
    return (f"drop {name!r} (or its class) from leaf_modules=, or use tracer='export', which traces through every "
            "module")


@gc_paused
def partition(gm: torch.fx.GraphModule, n_stages: int, *, balance_by: str = "flops",
              comm: float | Sequence[float] = 0.0, max_memory: float | None = None,
              checkpoint: str = "except_last", micro_batches: int = 1) -> Partition:
    """Cut ``gm`` into ``n_stages`` stages minimizing the largest stage cost; return the cut.

    A stage's cost is its nodes' cost under ``balance_by`` plus ``comm`` (per crossing byte;
    one number or one per boundary) times the bytes crossing its two cuts (:mod:`fxpipe.passes.cost`).
    The cut is exact for each candidate order (:mod:`fxpipe.passes.order`); the cheapest wins, ties
    going to the narrower cuts. No stage begins between an in-place op and the values it
    changes (:func:`fxpipe.passes.inplace.joined_positions`), nor, where places are left, between
    a buffer's read and a later write of it (:func:`fxpipe.passes.bufferreads.read_before_write`).
    With ``max_memory`` every stage's memory estimate for ``checkpoint`` and ``micro_batches``
    stays within it, or a ``ValueError`` says how much the least possible largest stage needs.
    """
    if balance_by not in BALANCE_KINDS:
        raise ValueError(f"unknown balance_by={balance_by!r}; use one of {list(BALANCE_KINDS) + ['auto']}")
    _check_stages(gm, n_stages)
    f_act, f_in = memory_factors(checkpoint, micro_batches)
    rho = f_in if balance_by == "memory" else 0.0  # a stage's memory includes the inputs it keeps
    best, least = None, None
    for order in candidate_orders(gm):
        costs = node_costs(order, balance_by, f_act)
        if not any(costs):
            costs = [1.0] * len(order)  # nothing to balance: equal node counts
        widths = cut_widths(gm, order)
        mem = [node_memory(n, f_act) for n in order] if max_memory is not None else None
        joined = joined_positions(gm, order)
        if len(order) - len(joined) < n_stages:  # too few places: let the in-place analysis refuse
            joined = set()
        kept = joined | read_before_write(gm, order)
        if len(order) - len(kept) >= n_stages:  # else route_buffer_reads warns of the reads cut from their writes
            joined = kept
        try:
            starts = min_bottleneck_cut(costs, widths, n_stages, beta=comm, rho=rho, m=mem, phi=f_in,
                                        cap=max_memory, joined=joined)
        except NoFeasibleCut as exc:
            least = exc.least if least is None else min(least, exc.least)
            continue
        stage = group_costs(costs, widths, starts, comm, rho)
        score = (max(stage), sum(widths[s] for s in starts[1:]))
        if best is None or _better(score, best[0]):
            memory = group_costs([node_memory(n, f_act) for n in order], widths, starts, 0.0, f_in)
            best = (score, Partition(order, starts, stage, widths, memory))
    if best is None:  # every candidate order was refused for memory
        assert least is not None
        raise NoFeasibleCut(_memory_refusal(max_memory, least, n_stages, checkpoint, micro_batches),
                            least=least)
    cut = best[1]
    assign_stages(gm, cut.starts, cut.order)
    return cut


def _better(score: tuple[float, float], other: tuple[float, float]) -> bool:
    """Compare (bottleneck, width) scores, treating bottlenecks within 1e-9 as equal."""
    if abs(score[0] - other[0]) > 1e-9 * max(abs(score[0]), abs(other[0]), 1e-300):
        return score[0] < other[0]
    return score[1] < other[1]


def _memory_refusal(cap, least, n_stages, checkpoint, micro_batches) -> str:
    """Explain that no cut fits ``max_memory`` and what would."""
    return (f"max_memory={cap:.6g} bytes fits no cut into {n_stages} stages: the least possible "
            f"largest stage needs {least:.6g} bytes (parameters and their gradients, plus the "
            f"activations kept with checkpoint={checkpoint!r} over {micro_batches} micro-batch(es)); "
            "raise max_memory, use more stages, more micro-batches or checkpoint='always'")


def partition_at(gm: torch.fx.GraphModule, split_points: Sequence[str], *, balance_by: str = "flops",
                 comm: float | Sequence[float] = 0.0, max_memory: float | None = None,
                 checkpoint: str = "except_last", micro_batches: int = 1) -> Partition:
    """Cut ``gm`` where each named module or node begins; return the cut (in graph order).

    A split point names a module (its first compute node begins the stage, like PiPPy's
    ``SplitPoint.BEGINNING``) or a node of ``gm``. Raises ``ValueError`` for an unknown name,
    points out of graph order, a point that would leave a stage empty, or (with
    ``max_memory``) a stage over the cap. ``balance_by`` and ``comm`` only price the stages.
    """
    compute = compute_nodes(gm)
    first = _first_indices(gm, compute)
    starts: list[int] = [0]
    names: list[str | None] = [None]
    for point in split_points:
        i = _locate(gm, compute, first, point)
        prev = starts[-1]
        if i == 0:
            raise ValueError(f"split point {point!r} begins at the model's first compute node "
                             f"{compute[0].name!r}, which leaves stage 0 empty; drop it or name "
                             "a later module")
        if i == prev:
            raise ValueError(f"split points {names[-1]!r} and {point!r} both begin at node "
                             f"{compute[i].name!r}, which leaves stage {len(starts) - 1} empty; "
                             "drop one of them")
        if i < prev:
            raise ValueError(f"split point {point!r} (node {compute[i].name!r}, position {i}) comes "
                             f"before the previous split point {names[-1]!r} (node "
                             f"{compute[prev].name!r}, position {prev}); list split points in "
                             "the order the model runs them")
        inside = next(((a, b) for a, b in nesting_regions(compute) if a < i <= b), None)
        if inside is not None:
            a, b = inside
            raise ValueError(f"split point {point!r} (node {compute[i].name!r}) falls inside a torch.vmap, from node "
                             f"{compute[a].name!r} to {compute[b].name!r}, which runs whole in one stage: name a point "
                             f"before {compute[a].name!r} or after {compute[b].name!r}")
        starts.append(i)
        names.append(point)
    assign_stages(gm, starts)
    f_act, f_in = memory_factors(checkpoint, micro_batches)
    widths = cut_widths(gm, compute)
    mem = group_costs([node_memory(n, f_act) for n in compute], widths, starts, 0.0, f_in)
    if max_memory is not None:
        over = [j for j, m in enumerate(mem) if m > max_memory]
        if over:
            j = over[0]
            raise NoFeasibleCut(f"with these split points stage {j} needs an estimated {mem[j]:.6g} "
                                f"bytes, over max_memory={max_memory:.6g}; move the split points "
                                "or drop them and let fxpipe find a cut that fits",
                                least=max(mem))
    costs = node_costs(compute, balance_by, f_act)
    rho = f_in if balance_by == "memory" else 0.0
    return Partition(compute, starts, group_costs(costs, widths, starts, comm, rho), widths, mem)


def _first_indices(gm: torch.fx.GraphModule, compute: list[torch.fx.Node]) -> dict[str, int]:
    """Map every node name, and every module path called in forward, to its first compute index."""
    first: dict[str, int] = {}
    for i, node in enumerate(compute):
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        if node.op == "call_module":
            paths.append(node.target)
        for path in paths:
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                first.setdefault(".".join(parts[:k]), i)
    first.update({node.name: i for i, node in enumerate(compute)})  # node names take precedence
    return first


def _locate(gm: torch.fx.GraphModule, compute: list[torch.fx.Node], first: dict[str, int],
            point: str) -> int:
    """Return the compute index where split point ``point`` begins, or explain why none does."""
    if point in first:
        return first[point]
    names = [n.name for n in gm.graph.nodes]
    if point in names:
        raise ValueError(f"split point {point!r} is a {next(n.op for n in gm.graph.nodes if n.name == point)} "
                         "node, which does no work; name a module or a compute node")
    modules = dict(gm.named_modules())
    whole = next((str(n.target) for n in compute if n.op == "call_module" and point.startswith(f"{n.target}.")), None)
    if whole is not None:
        raise ValueError(f"split point {point!r} is inside module {whole!r} ({type(modules[whole]).__name__}), which "
                         f"the traced graph calls as one node: split before or after {whole!r}, or trace through it "
                         f"({_through(gm, whole)})")
    if point in modules:
        raise ValueError(f"split point {point!r} is a module that forward never calls; name a "
                         "module that runs")
    hint = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise ValueError(f"unknown split point {point!r}: it names no module called in forward and "
                     f"no node of the traced graph (nodes: {hint}); use fxpipe.trace(model) to "
                     "list the node names")


def stage_costs(gm: torch.fx.GraphModule, n_stages: int, balance_by: str) -> list[float]:
    """Sum the cost of each stage's compute nodes under ``balance_by`` (no communication)."""
    totals = [0.0] * n_stages
    nodes = compute_nodes(gm)
    for node, cost in zip(nodes, node_costs(nodes, balance_by)):
        totals[node.meta["fxpipe.stage"]] += cost
    return totals
