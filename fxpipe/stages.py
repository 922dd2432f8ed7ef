"""Split a partitioned graph into stage GraphModules and describe them in a :class:`PipelinePlan`.

    GraphModule with node.meta["fxpipe.stage"] ──split──▶ stage GraphModules + skip routes
                                               ──plan───▶ PipelinePlan (stages, skips, costs)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.mutation import copy_mutated_inputs
from fxpipe.plan import PipelinePlan, SkipRoute, StagePlan
from fxpipe.runtime.placement import named_tensors
from fxpipe.saved import graph_signature

__all__ = ["split_stages", "make_plan"]


def split_stages(gm: torch.fx.GraphModule, n_stages: int) -> tuple[list[passes.StageGraph], list[passes.Route]]:
    """Split ``gm`` into ``n_stages`` stage graphs with skip routes; copy inputs that stages change."""
    stage_graphs, routes = passes.split(gm, n_stages)
    copy_mutated_inputs(gm, stage_graphs)
    return stage_graphs, routes


def make_plan(gm: torch.fx.GraphModule, stage_graphs: Sequence[passes.StageGraph],
              routes: Sequence[passes.Route], devices: Sequence[Any], micro: int, chunks: int,
              checkpoint: str, schedule: str, balance_by: str, cut: Any,
              saved_plan: PipelinePlan | None) -> PipelinePlan:
    """Collect the split's stages, routes and costs into a :class:`PipelinePlan`."""
    nodes = {n.name: n for n in gm.graph.nodes}
    per_micro = max(micro, 1)
    profiled = any("fxpipe.time" in n.meta for n in gm.graph.nodes)
    stage_plans = []
    for j, sg in enumerate(stage_graphs):
        tensors = {id(t): t for _, t in named_tensors(sg.module)}
        params = int(sum(t.numel() * t.element_size() for t in tensors.values()))
        held = [nodes[v] for v in sg.nodes]
        saved = sum(n.meta.get("fxpipe.saved_bytes", 0) for n in held)
        received = sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in sg.inputs)
        stage_plans.append(StagePlan(
            index=j, device=str(devices[j]), nodes=sg.nodes, inputs=sg.inputs, outputs=sg.outputs,
            flops=int(sum(n.meta.get("fxpipe.flops", 0) + n.meta.get("fxpipe.flops_bwd", 0) for n in held)),
            params=params,
            activation_bytes=int(sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in sg.outputs) // per_micro),
            time_ms=float(sum(n.meta.get("fxpipe.time", 0.0) for n in held)) if profiled else None,
            saved_bytes=int(saved // per_micro),
            checkpoint_bytes=int(received // per_micro),
            memory=int(cut.memory[j]) if cut is not None else saved_plan.stages[j].memory,
            cost=float(cut.costs[j]) if cut is not None else saved_plan.stages[j].cost,
            grad_inputs=[v for v in sg.inputs if j > 0 and _carries_grad(nodes[v])],
        ))
    skips = [SkipRoute(r.name, r.src, r.dst, int(nodes[r.name].meta.get("fxpipe.bytes", 0) // per_micro))
             for r in routes]
    names, ops, targets = graph_signature(gm)
    return PipelinePlan(stages=stage_plans, skips=skips, chunks=chunks, checkpoint=checkpoint,
                        schedule=schedule, balance_by=balance_by,
                        graph_nodes=names, graph_ops=ops, graph_targets=targets)


def _carries_grad(node: torch.fx.Node) -> bool:
    """Tell whether a value crossing a boundary carries a gradient back to its producer."""
    spec = node.meta.get("fxpipe.value")
    if spec is None:  # not annotated: assume computed floating values do
        return node.op != "placeholder"
    return any(isinstance(t, passes.TensorSpec) and t.requires_grad and t.dtype.is_floating_point
               for t in tree_flatten(spec)[0])
