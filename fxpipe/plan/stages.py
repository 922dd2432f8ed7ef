"""Split a partitioned graph into stage GraphModules and describe them in a :class:`PipelinePlan`.

    GraphModule with node.meta["fxpipe.stage"] ──split──▶ stage GraphModules + skip routes
                                               ──plan───▶ PipelinePlan (stages, skips, costs)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.options import CompileOptions
from fxpipe.plan.assign import Assignment
from fxpipe.plan.mutation import copy_mutated_inputs, route_buffer_reads
from fxpipe.plan.pipeline import PipelinePlan, SkipRoute, StagePlan
from fxpipe.plan.saved import front_end_layout, graph_signature
from fxpipe.plan.tensorparallel import plan_tensor_parallel

__all__ = ["example_rows", "make_plan", "named_tensors", "split_stages", "user_leaf"]


def named_tensors(module: nn.Module):
    """Yield (name, tensor) for every parameter and buffer of ``module``, shared ones under each name."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def split_stages(gm: torch.fx.GraphModule, n_stages: int
                 ) -> tuple[list[torch.fx.GraphModule], list[StagePlan], list[SkipRoute]]:
    """Split ``gm`` into ``n_stages`` stage modules, their plans and the skip routes; copy inputs stages change.

    Buffers an earlier stage writes reach later stages' reads as values (:func:`route_buffer_reads`),
    which adds nodes to ``gm``: a plan records the graph's signature before the split.
    """
    route_buffer_reads(gm)
    modules, stages, routes = passes.split(gm, n_stages)
    copy_mutated_inputs(gm, modules)
    return modules, stages, routes


def make_plan(front: Assignment, options: CompileOptions, devices: Sequence[Any], schedule: str,
              ranks: Sequence[int], saved_plan: PipelinePlan | None) -> tuple[PipelinePlan, list[torch.fx.GraphModule]]:
    """Split the assigned graph into stage modules; return them and the :class:`PipelinePlan` describing them.

    The plan records each stage's device and rank (``ranks``: the schedule's placement), costs,
    boundary values and skip routes, with the options' chunks and checkpointing (a mode per stage;
    ``"per stage"`` as the plan's for a list) and ``schedule``'s name; with tensor parallelism, the
    styles of the modules and their collectives (recorded on the graph's nodes before the split, so
    the stages carry them).
    """
    tp_plan = "auto" if options.tp_plan is None else options.tp_plan  # an empty dict is refused by the options
    tp = plan_tensor_parallel(front.gm, options.tp, tp_plan) if options.tp > 1 else None
    front.gm.meta["fxpipe.tp_plan"] = tp  # the build styles each rank's stages from it
    signature = graph_signature(front.gm), [key for _, key in passes.structure(front.gm)]
    modules, stages, routes = split_stages(front.gm, options.n_stages)
    checkpoint = options.checkpoint if isinstance(options.checkpoint, str) else "per stage"
    plan = _describe(front.gm, modules, stages, routes, devices, front.micro, options.chunks, checkpoint,
                     schedule, front.balance_by, front.cut, saved_plan, signature)
    policies = options.policies()
    plan.tensor_parallel = None if tp is None else tp.record(front.micro)
    plan.layout = {**options.layout(), **front_end_layout(front.gm)}
    for s in plan.stages:
        s.rank = ranks[s.index]
        s.checkpoint = policies[s.index] if policies is not None else ""  # "auto": chosen after the plan
    return plan, modules


def _describe(gm: torch.fx.GraphModule, modules: Sequence[torch.fx.GraphModule], stages: Sequence[StagePlan],
              routes: Sequence[SkipRoute], devices: Sequence[Any], micro: int, chunks: int,
              checkpoint: str, schedule: str, balance_by: str, cut: Any,
              saved_plan: PipelinePlan | None, signature: tuple) -> PipelinePlan:
    """Fill in the split's stages and routes with devices and costs; return the :class:`PipelinePlan`."""
    nodes = {n.name: n for n in gm.graph.nodes}
    per_micro = max(micro, 1)
    profiled = any("fxpipe.time" in n.meta for n in gm.graph.nodes)
    ghostly = passes.maybe_without_grad(gm)
    params = dict(gm.named_parameters(remove_duplicate=False))
    for j, (module, s) in enumerate(zip(modules, stages)):
        tensors = {id(t): t for _, t in named_tensors(module)}
        held = [nodes[v] for v in s.nodes]
        s.device = str(devices[j])
        s.flops = int(sum(n.meta.get("fxpipe.flops", 0) + n.meta.get("fxpipe.flops_bwd", 0) for n in held))
        s.params = int(sum(t.numel() * t.element_size() for t in tensors.values()))
        s.activation_bytes = int(sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in s.outputs) // per_micro)
        s.time_ms = float(sum(n.meta.get("fxpipe.time", 0.0) for n in held)) if profiled else None
        s.saved_bytes = int(sum(n.meta.get("fxpipe.saved_bytes", 0) for n in held) // per_micro)
        s.checkpoint_bytes = int(sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in s.inputs) // per_micro)
        s.frozen = _frozen(held)
        if s.frozen:  # no backward: the runtime neither keeps nor recomputes anything of it
            s.saved_bytes = s.checkpoint_bytes = 0
        if cut is not None:
            s.memory, s.cost = int(cut.memory[j]), float(cut.costs[j])
        else:
            assert saved_plan is not None  # without a cut, the stages come from a saved plan
            s.memory, s.cost = saved_plan.stages[j].memory, saved_plan.stages[j].cost
        s.grad_inputs = [v for v in s.inputs if j > 0 and _carries_grad(nodes[v])]
        s.maybe_no_grad = [v for v in s.grad_inputs if v in ghostly]
        s.maybe_unused = _maybe_unused(gm, held, ghostly, params)
    for r in routes:
        r.bytes = int(nodes[r.name].meta.get("fxpipe.bytes", 0) // per_micro)
    (names, ops, targets), keys = signature  # of the graph as traced, which a saved plan is matched against
    return PipelinePlan(stages=list(stages), skips=list(routes), chunks=chunks, checkpoint=checkpoint,
                        schedule=schedule, balance_by=balance_by, example_rows=example_rows(gm),
                        graph_nodes=names, graph_ops=ops, graph_targets=targets,
                        graph_keys=keys)


def example_rows(gm: torch.fx.GraphModule) -> int | None:
    """Return the dim-0 size of the first batched placeholder the annotations were made for."""
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        for leaf in tree_flatten(n.meta.get("fxpipe.value"))[0]:
            if isinstance(leaf, passes.TensorSpec) and leaf.shape:
                return int(leaf.shape[0])
    return None


def _frozen(held: Sequence[torch.fx.Node]) -> bool:
    """Tell whether no value ``held`` computes needs a gradient (False where a value is not annotated)."""
    computed = [n for n in held if n.op in ("call_function", "call_method", "call_module")
                and (n.users or n.meta.get("fxpipe.value") is not None)]  # not export's _guards_fn, read by none
    specs = [n.meta.get("fxpipe.value") for n in computed]
    if not computed or any(spec is None for spec in specs):
        return False
    return not any(isinstance(t, passes.TensorSpec) and t.requires_grad for spec in specs for t in tree_flatten(spec)[0])


def _maybe_unused(gm: torch.fx.GraphModule, held: Sequence[torch.fx.Node], ghostly: set[str],
                  params: dict[str, nn.Parameter]) -> list[str]:
    """Return the attributes and modules with trainable parameters that ``held`` reads and that may get no gradient."""
    read = {a for n in held for a in (n, *n.all_input_nodes) if a.op in ("get_attr", "call_module")}
    found = set()
    for a in read:
        target = str(a.target)
        if a.op == "call_module" and user_leaf(gm.get_submodule(target)):
            pass  # a leaf of the user's: its code may skip parameters by the data (experts given no tokens)
        elif a.name not in ghostly:
            continue
        if a.op == "call_module":
            held_params = list(gm.get_submodule(target).parameters())
        else:
            held_params = [params[target]] if target in params else []
        if any(p.requires_grad for p in held_params):
            found.add(target)
    return sorted(found)


def user_leaf(module: nn.Module) -> bool:
    """Tell whether ``module`` is a leaf whose code torch does not define, holding parameters (whose use may vary).

    Its own (``register_parameter`` per expert) count as its submodules' do: its code may skip either.
    """
    return not type(module).__module__.startswith("torch.") and any(True for _ in module.parameters())


def _carries_grad(node: torch.fx.Node) -> bool:
    """Tell whether a value crossing a boundary carries a gradient back to its producer."""
    spec = node.meta.get("fxpipe.value")
    if spec is None:  # not annotated: assume computed floating values do
        return node.op != "placeholder"
    return any(isinstance(t, passes.TensorSpec) and t.requires_grad and passes.differentiable(t.dtype)
               for t in tree_flatten(spec)[0])
