"""Cut a GraphModule into contiguous stages.

Reads:  ``fxpipe.flops``, ``fxpipe.param_bytes``, ``fxpipe.bytes`` (from :func:`passes.annotate`)
        or ``fxpipe.time`` (from :func:`passes.profile`), depending on ``balance_by``.
Writes: ``node.meta["fxpipe.stage"]``, the index of the stage that runs the node.

Stages are contiguous in the graph's topological order, so a stage only depends on earlier
stages. Placeholders belong to stage 0, the output node to the last stage, and a ``get_attr``
node to the stage of its first user (the split pass copies it into every stage that reads it).
:func:`assign_by_name` writes a given (saved) assignment of compute nodes with the same rules
and reads no annotations.
"""

from __future__ import annotations

import bisect
from typing import Mapping, Sequence

import torch.fx

__all__ = ["COMPUTE_OPS", "compute_nodes", "node_cost", "partition", "partition_at",
           "balanced_cut", "assign_stages", "assign_by_name", "stage_costs"]

COMPUTE_OPS = ("call_module", "call_function", "call_method")

_BALANCE_KEYS = {
    "flops": ("fxpipe.flops",),
    "params": ("fxpipe.param_bytes",),
    "memory": ("fxpipe.bytes", "fxpipe.param_bytes"),
    "time": ("fxpipe.time",),
}


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Return the nodes that do work (module, function and method calls), in graph order."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def node_cost(node: torch.fx.Node, balance_by: str) -> float:
    """Return a node's cost under ``balance_by`` from its annotations (0 when missing)."""
    try:
        keys = _BALANCE_KEYS[balance_by]
    except KeyError:
        raise ValueError(f"unknown balance_by={balance_by!r}; use one of "
                         f"{sorted(_BALANCE_KEYS) + ['auto']}") from None
    return float(sum(node.meta.get(k, 0) or 0 for k in keys))


def balanced_cut(costs: Sequence[float], n_parts: int) -> list[int]:
    """Return the start index of each of ``n_parts`` contiguous non-empty groups of ``costs``.

    The cut minimizes the largest group sum (exact up to float rounding): a bisection on the
    bottleneck, each probe packing greedily with prefix sums in O(n_parts log n).
    """
    n = len(costs)
    if not 1 <= n_parts <= n:
        raise ValueError(f"cannot cut {n} items into {n_parts} non-empty groups")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(float(c), 0.0))

    def starts_for(limit: float) -> list[int] | None:
        starts, i = [], 0
        while i < n:
            if len(starts) == n_parts:
                return None
            starts.append(i)
            # the furthest end j with prefix[j] - prefix[i] <= limit, at least one item
            j = bisect.bisect_right(prefix, prefix[i] + limit, lo=i + 1) - 1
            i = max(j, i + 1)
        return starts

    lo, hi = max(prefix[i + 1] - prefix[i] for i in range(n)), prefix[-1]
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        if starts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    starts = starts_for(hi * (1 + 1e-12)) or starts_for(prefix[-1])
    assert starts is not None
    # Fewer groups than asked: split the groups with most items; a split never raises the max.
    while len(starts) < n_parts:
        bounds = starts + [n]
        sizes = [bounds[k + 1] - bounds[k] for k in range(len(starts))]
        k = max(range(len(sizes)), key=lambda g: sizes[g])
        starts.insert(k + 1, starts[k] + sizes[k] // 2)
    return starts


def assign_stages(gm: torch.fx.GraphModule, starts: Sequence[int]) -> None:
    """Write ``fxpipe.stage`` on every node, given the compute-node index where each stage starts."""
    compute = compute_nodes(gm)
    stage_of: dict[str, int] = {}
    for j, start in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else len(compute)
        for node in compute[start:end]:
            stage_of[node.name] = j
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


def partition(gm: torch.fx.GraphModule, n_stages: int, *, balance_by: str = "flops") -> list[int]:
    """Cut ``gm`` into ``n_stages`` contiguous stages of balanced cost; return each stage's start."""
    compute = compute_nodes(gm)
    if not 1 <= n_stages <= len(compute):
        raise ValueError(f"n_stages={n_stages} but the model has {len(compute)} compute nodes; "
                         f"use between 1 and {len(compute)} stages")
    costs = [node_cost(n, balance_by) for n in compute]
    if not any(costs):
        costs = [1.0] * len(compute)
    starts = balanced_cut(costs, n_stages)
    assign_stages(gm, starts)
    return starts


def partition_at(gm: torch.fx.GraphModule, split_points: Sequence[str]) -> list[int]:
    """Cut ``gm`` where each named module or node begins; return each stage's start."""
    compute = compute_nodes(gm)
    index = {n.name: i for i, n in enumerate(compute)}
    starts = [0]
    for point in split_points:
        i = _first_compute_index(gm, compute, index, point)
        if i <= starts[-1]:
            where = "the first node" if i == 0 else f"before or at the previous split point ({starts[-1]})"
            raise ValueError(f"split point {point!r} begins at compute node {i}, {where}; "
                             "split points must be given in graph order, each starting a non-empty stage")
        starts.append(i)
    assign_stages(gm, starts)
    return starts


def _first_compute_index(gm, compute, index, point: str) -> int:
    """Return the index of the first compute node of a module or node named ``point``."""
    if point in index:
        return index[point]
    for i, node in enumerate(compute):
        if node.op == "call_module" and (node.target == point or node.target.startswith(point + ".")):
            return i
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            if path == point or path.startswith(point + "."):
                return i
    names = [n.name for n in gm.graph.nodes]
    hint = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise ValueError(f"unknown split point {point!r}: it names no module called in forward and "
                     f"no node of the traced graph (nodes: {hint}); use fxpipe.trace(model) to "
                     "list the node names")


def stage_costs(gm: torch.fx.GraphModule, n_stages: int, balance_by: str) -> list[float]:
    """Sum the cost of each stage's compute nodes under ``balance_by``."""
    totals = [0.0] * n_stages
    for node in compute_nodes(gm):
        totals[node.meta["fxpipe.stage"]] += node_cost(node, balance_by)
    return totals
