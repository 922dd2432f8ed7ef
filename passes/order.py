"""Topological orders of a graph's compute nodes for the partitioner to cut, built with networkx.

Reads:  the graph.
Writes: nothing.

A contiguous cut of any topological order gives stages that depend only on earlier stages,
and the bytes crossing a cut depend on the order: a value made early and read late crosses
every cut between. Besides the traced order (the program's own) the partitioner tries

    depth-first   a post-order DFS from the output over the inputs: each value is made just
                  before the first consumer that needs it, chains stay together
    just-in-time  Kahn's algorithm preferring the ready node whose value is needed soonest
                  in the traced order, so values nobody needs yet wait

and keeps the order whose best cut costs least (:func:`fxpipe.passes.partition`).

Reordering is only safe for pure code. A graph with an in-place op (``x.add_``, ``y[i] = v``,
``aten.fill_``: whatever :func:`fxpipe.passes.mutates.is_mutating` reports) is cut in its
traced order only, since a reader of the changed value need not depend on the in-place node;
so is a graph with an exported ``torch.vmap``, whose ends no value ties to its body
(:mod:`fxpipe.passes.nesting`).
Random ops (dropout), impure nodes and calls of modules from outside ``torch.nn`` keep their
relative order (chained by extra edges), so the same random numbers are drawn in the same
sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import torch.fx
from fxpipe.passes.cost import COMPUTE_OPS
from fxpipe.passes.mutates import is_mutating
from fxpipe.passes.nesting import is_nesting

__all__ = ["candidate_orders", "draws_random", "is_topological"]

_RANDOM = ("dropout", "rand", "bernoulli", "normal", "multinomial", "poisson", "exponential_",
           "uniform_", "cauchy_", "geometric_", "log_normal_")


def _effectful(gm: torch.fx.GraphModule, node: torch.fx.Node, modules: dict) -> bool:
    """Tell whether a node's order relative to other effectful nodes must be kept."""
    if node.op == "call_module":
        kind = type(modules[node.target])
        return not kind.__module__.startswith("torch.nn") or "dropout" in kind.__name__.lower()
    if node.is_impure():
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return any(r in str(name).lower() for r in _RANDOM)


def draws_random(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Tell whether a node draws random numbers (a dropout module or function, ``rand``, ``bernoulli``...)."""
    if node.op == "call_module":
        return "dropout" in type(gm.get_submodule(str(node.target))).__name__.lower()
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return any(r in str(name).lower() for r in _RANDOM)


def _graph(gm: torch.fx.GraphModule, compute: Sequence[torch.fx.Node]) -> nx.DiGraph:
    """Build the dependency DiGraph of the compute nodes, effect-chain edges included."""
    edges: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    previous, modules = None, dict(gm.named_modules())
    for node in compute:
        edges.extend((a, node) for a in node.all_input_nodes if a.op in COMPUTE_OPS)
        if _effectful(gm, node, modules):
            if previous is not None:
                edges.append((previous, node))
            previous = node
    g = nx.DiGraph()
    g.add_nodes_from(compute)
    g.add_edges_from(edges)
    return g


def candidate_orders(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """Return the orders to try: the traced one first, then reorderings when the graph is pure."""
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    if len(compute) < 3 or any(is_mutating(n) or is_nesting(n) for n in compute):
        return [compute]
    g = _graph(gm, compute)
    traced = {node: i for i, node in enumerate(compute)}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")

    # depth-first: roots are what the output reads (in argument order), then the rest, last first
    reverse = nx.DiGraph()
    roots = [a for a in output.all_input_nodes if a in traced] + compute[::-1]
    reverse.add_nodes_from(dict.fromkeys(roots))
    reverse.add_edges_from((v, u) for u, v in g.edges)  # inputs in traced order
    depth_first = list(nx.dfs_postorder_nodes(reverse))

    # just-in-time: among ready nodes, the one whose first consumer comes soonest
    first_use = {node: min((traced.get(u, len(compute)) for u in node.users), default=len(compute))
                 for node in compute}
    jit = list(nx.lexicographical_topological_sort(g, key=lambda n: (first_use[n], traced[n])))

    orders = [compute]
    for order in (depth_first, jit):
        if order != compute and order not in orders and is_topological(order):
            orders.append(order)
    return orders


def is_topological(order: Sequence[torch.fx.Node]) -> bool:
    """Tell whether every compute input of every node comes earlier in ``order``."""
    pos = {node: i for i, node in enumerate(order)}
    return all(pos.get(a, -1) < i for i, node in enumerate(order)
               for a in node.all_input_nodes if a in pos)
