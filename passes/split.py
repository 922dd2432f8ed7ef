"""Split a partitioned GraphModule into one GraphModule per stage, with skip routes.

Reads:  ``node.meta["fxpipe.stage"]`` (from :func:`fxpipe.passes.partition`).
Writes: nothing on ``gm``; returns new stage GraphModules whose nodes keep their meta.

A value made in stage ``i`` and used in stage ``i + 1`` is a *boundary* value. A value used
in a stage ``j > i + 1`` is *stashed* by stage ``i`` and *popped* by stage ``j``: a
:class:`Route` from ``i`` to ``j``. It never appears among the inputs or outputs of the
stages in between::

    stage 0 ──h──▶ stage 1 ──h'──▶ stage 2 ──▶ stage 3
       │ stash "skip"                            ▲ pop "skip"
       └─────────────────────────────────────────┘

``get_attr`` nodes (parameters, buffers, constants) are copied into every stage that reads
them rather than routed: a parameter is state, not a per-micro-batch value.

Each stage GraphModule takes its inputs positionally (boundary values first, then pops, in
graph order) and returns a tuple of its outputs; the last stage returns the model's output.
Submodules and parameters are shared with ``gm``, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from fxpipe.passes.gcpause import gc_paused

__all__ = ["Route", "StageGraph", "split"]


@dataclass
class Route:
    """A value stashed by stage ``src`` and popped by stage ``dst`` (``dst > src + 1``)."""

    name: str
    src: int
    dst: int


@dataclass
class StageGraph:
    """One stage: its GraphModule and the names of the values it takes and gives."""

    module: torch.fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    nodes: list[str] = field(default_factory=list)


@gc_paused
def split(gm: torch.fx.GraphModule, n_stages: int) -> tuple[list[StageGraph], list[Route]]:
    """Build one GraphModule per stage from ``fxpipe.stage`` annotations; return stages and routes."""
    nodes = list(gm.graph.nodes)
    stage = {n: n.meta["fxpipe.stage"] for n in nodes}
    order = {n: k for k, n in enumerate(nodes)}

    # consumers[v] = the stages (other than v's own) that read value v
    consumers: dict[torch.fx.Node, set[int]] = {}
    for user in nodes:
        for v in user.all_input_nodes:
            if v.op == "get_attr":
                continue
            if stage[user] < stage[v]:
                raise ValueError(f"node {user.name!r} in stage {stage[user]} reads {v.name!r} from the "
                                 f"later stage {stage[v]}; stages must follow the graph's order")
            if stage[user] > stage[v]:
                consumers.setdefault(v, set()).add(stage[user])

    routes = [Route(v.name, stage[v], dst) for v in sorted(consumers, key=order.get)
              for dst in sorted(consumers[v]) if dst > stage[v] + 1]

    # bucket once: each stage's own nodes, and the values each stage receives (in graph order)
    own_of: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    for n in nodes:
        if n.op != "get_attr":
            own_of[stage[n]].append(n)
    received: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    for v in sorted(consumers, key=order.get):
        for d in consumers[v]:
            received[d].append(v)

    stages = []
    for j in range(n_stages):
        own = own_of[j]
        outputs = [v for v in own if any(d > j for d in consumers.get(v, ()))]
        boundary = [v for v in received[j] if stage[v] == j - 1]
        pops = [v for v in received[j] if stage[v] < j - 1]
        inputs = boundary + pops
        if j == 0:
            inputs = [n for n in own if n.op == "placeholder"]
        module = _build_stage(gm, j, own, inputs, outputs, last=(j == n_stages - 1))
        attrs = {a for n in own for a in n.all_input_nodes if a.op == "get_attr"}
        held = sorted(set(own) | attrs, key=order.get)
        stages.append(StageGraph(module, [v.name for v in inputs], [v.name for v in outputs],
                                 [n.name for n in held]))
    return stages, routes


def _build_stage(gm: torch.fx.GraphModule, j: int, own: list[torch.fx.Node],
                 inputs: list[torch.fx.Node], outputs: list[torch.fx.Node], last: bool) -> torch.fx.GraphModule:
    """Copy stage ``j``'s nodes into a new GraphModule reading ``inputs`` and returning ``outputs``."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for v in inputs:
        if j == 0:
            env[v] = graph.node_copy(v)
        else:
            env[v] = graph.placeholder(v.name)
            env[v].meta = dict(v.meta)

    def lookup(a: torch.fx.Node) -> torch.fx.Node:
        if a not in env:
            assert a.op == "get_attr", f"{a.name} is neither an input nor a parameter of stage {j}"
            env[a] = graph.node_copy(a)
        return env[a]

    output_node = None
    for node in own:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output_node = node
            continue
        env[node] = graph.node_copy(node, lookup)
    if last:
        assert output_node is not None
        graph.output(torch.fx.node.map_arg(output_node.args[0], lookup))
    else:
        graph.output(tuple(env[v] for v in outputs))
    module = torch.fx.GraphModule(gm, graph, class_name=f"Stage{j}")
    return module
