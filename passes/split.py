"""Split a partitioned GraphModule into one GraphModule per stage, with skip routes.

Reads:  ``node.meta["fxpipe.stage"]`` (from :func:`fxpipe.passes.partition`).
Writes: nothing on ``gm``; returns new stage GraphModules whose nodes keep their meta, a
        :class:`StagePlan` per stage (its nodes, inputs and outputs; the plan adds devices and
        costs) and the :class:`SkipRoute` of every value that skips stages.

A value made in stage ``i`` and used in stage ``i + 1`` is a *boundary* value. A value used
in a stage ``j > i + 1`` is *stashed* by stage ``i`` and *popped* by stage ``j``: a
:class:`SkipRoute` from ``i`` to ``j``. It never appears among the inputs or outputs of the
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

__all__ = ["SkipRoute", "StagePlan", "split"]


@dataclass
class StagePlan:
    """One stage: where it runs, which nodes it holds, what it takes and gives, what it costs.

    ``flops`` counts forward and backward over the whole mini-batch; ``params`` the bytes of
    the parameters and buffers it holds; ``activation_bytes`` the bytes it sends on per
    micro-batch; ``saved_bytes`` the activations it keeps per micro-batch for backward without
    checkpointing, ``checkpoint_bytes`` with it (its inputs); ``memory`` the partitioner's
    estimate of the peak for the plan's checkpoint mode and chunks (parameters and gradients,
    kept activations, kept inputs bounded by the bytes crossing the stage's first cut);
    ``time_ms`` the measured forward + backward milliseconds when profiled; ``cost`` what the
    partitioner balanced (its ``balance_by`` unit, communication included); ``checkpoint`` its
    recomputation policy and ``peak`` its predicted peak memory under it (parameters, gradients
    and activations along the schedule, from :mod:`fxpipe.simulate`), when predicted. A ``frozen``
    stage (no value in it needs a gradient on the example inputs) runs no backward: the runtime
    never recomputes it, so it keeps nothing whatever its policy.
    """

    index: int
    device: str
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    flops: int = 0
    params: int = 0
    activation_bytes: int = 0
    time_ms: float | None = None
    grad_inputs: list[str] = field(default_factory=list)  # inputs whose gradient flows back
    saved_bytes: int = 0
    checkpoint_bytes: int = 0
    memory: int = 0
    cost: float = 0.0
    rank: int | None = None  # the rank (in one process, the schedule's lane) it runs on; None: its index
    checkpoint: str = ""  # its recomputation policy ("" in older plans: the plan's checkpoint)
    peak: int = 0  # its predicted peak memory in bytes under that policy along the schedule (0: not predicted)
    # inputs among grad_inputs, and attributes or modules it reads, that may get no gradient at a step
    # (they do not reach every output a loss could read: passes.maybe_without_grad)
    maybe_no_grad: list[str] = field(default_factory=list)
    maybe_unused: list[str] = field(default_factory=list)
    frozen: bool = False  # nothing in it needs a gradient (a frozen encoder): never recomputed, keeps nothing

    @property
    def on_rank(self) -> int:
        """Return the rank this stage runs on."""
        return self.index if self.rank is None else self.rank


@dataclass
class SkipRoute:
    """A value stashed by stage ``src`` and popped by stage ``dst``, skipping the stages between."""

    name: str
    src: int
    dst: int
    bytes: int = 0



@gc_paused
def split(gm: torch.fx.GraphModule, n_stages: int
          ) -> tuple[list[torch.fx.GraphModule], list[StagePlan], list[SkipRoute]]:
    """Build one GraphModule per stage from ``fxpipe.stage`` annotations; return them, their plans, the routes."""
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

    routes = [SkipRoute(v.name, stage[v], dst) for v in sorted(consumers, key=order.__getitem__)
              for dst in sorted(consumers[v]) if dst > stage[v] + 1]

    # bucket once: each stage's own nodes, and the values each stage receives (in graph order)
    own_of: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    for n in nodes:
        if n.op != "get_attr":
            own_of[stage[n]].append(n)
    received: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    for v in sorted(consumers, key=order.__getitem__):
        for d in consumers[v]:
            received[d].append(v)

    modules, stages = [], []
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
        held = sorted(set(own) | attrs, key=order.__getitem__)
        modules.append(module)
        stages.append(StagePlan(index=j, device="", nodes=[n.name for n in held],
                                inputs=[v.name for v in inputs], outputs=[v.name for v in outputs]))
    return modules, stages, routes


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
