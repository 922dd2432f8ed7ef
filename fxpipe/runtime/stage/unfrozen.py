"""Refuse a step after a parameter frozen at compile is unfrozen where no gradient can reach it.

The compiler decides once which values crossing stages carry a gradient back (each stage's
``grad_inputs``, from the parameters' ``requires_grad`` when it traced): a stage whose outputs
depend on frozen parameters only sends them without one, and the ranks skip those backward
messages. Unfreezing such a parameter afterwards (gradual unfreezing) would leave it without a
gradient under every action schedule, silently::

    stage 0 (frozen at compile) --x--> stage 1        x carries no gradient back
    p.requires_grad_(True) on stage 0               -> p.grad stays None

Such steps are refused instead, naming the parameter and the fixes. Only the parameters frozen
at compile that such a value is computed from are watched (a frozen base weight beside a
trained adapter gets its gradient through the adapter's outputs): a model with none costs
nothing per step.

A model input is watched the same way (:func:`watch_inputs`): one that did not require grad at
compile and that a later stage reads, directly (a skip from the input) or through values
computed from it alone (``xs = x * 2`` read again at the end), has no gradient route back from
that stage, so passing it requiring grad (an adversarial example, a saliency map)
would leave that stage's share out of its ``.grad``; such a step is refused too. The first
stage's share needs no route: the stage hands it to the user's graph itself.

Of the same kind, :func:`refuse_changed_linears`: a linear that zero bubble calls as a function
(to defer its weight gradient) and that got hooks or a parametrization after compile, which
that call would skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.errors import PipelineInputError
from fxpipe.passes.linears import hooked

__all__ = ["refuse_changed_linears", "refuse_input_grads", "refuse_unfrozen", "watch_frozen", "watch_inputs"]


def watch_frozen(plan: Any, gm: torch.fx.GraphModule, stages: Mapping[int, torch.nn.Module]
                 ) -> list[tuple[int, str, torch.nn.Parameter]]:
    """Return ``(stage, name, parameter)`` for each frozen parameter reaching a floating value its stage sends without
    a gradient.

    A frozen parameter reaching only values that carry a gradient back (a base weight beside a
    trained adapter) gets its gradient through them once unfrozen, and is not watched.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    consumers = plan.consumers()
    watched = []
    for j, stage in stages.items():
        dead = [v for v in plan.stages[j].outputs for c in consumers.get(v, ())
                if c != j and v not in plan.stages[c].grad_inputs and _floating(nodes.get(v))]
        if dead:
            reaching = _params_reaching(gm, [nodes[v] for v in dead if v in nodes], set(plan.stages[j].nodes))
            watched += [(j, name, p) for name, p in stage.named_parameters()
                        if not p.requires_grad and name in reaching]
    return watched


def _params_reaching(gm: torch.fx.GraphModule, ends: list[torch.fx.Node], mine: set[str]) -> set[str]:
    """Return the names of the parameters read by the nodes (of ``mine``) that ``ends`` are computed from."""
    found: set[str] = set()
    seen: set[str] = set()
    todo = list(ends)
    while todo:
        node = todo.pop()
        if node.name in seen or node.name not in mine:
            continue
        seen.add(node.name)
        todo += node.all_input_nodes
        if node.op == "get_attr":
            found.add(str(node.target))
        elif node.op == "call_module":
            found.update(f"{node.target}.{name}" for name, _ in gm.get_submodule(str(node.target)).named_parameters())
    return found


def refuse_unfrozen(watched: list[tuple[int, str, torch.nn.Parameter]]) -> None:
    """Raise if a watched parameter requires grad now."""
    for j, name, p in watched:
        if p.requires_grad:
            raise PipelineInputError(
                f"parameter '{name}' (stage {j}) requires grad now but did not when the pipe was compiled: the "
                f"compiler then found that stage {j}'s outputs carry no gradient back, so it would get none. "
                "Set requires_grad before fxpipe.compile: to start frozen, leave the parameter out of the "
                "optimizer (or give its group lr=0) and unfreeze it by adding it; or build a new pipe after "
                "unfreezing (fxpipe.save, fxpipe.compile, fxpipe.load)")


def watch_inputs(plan: Any, gm: torch.fx.GraphModule) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """Return ``(position, name, [(stage, value)])`` per floating model input later readers have no gradient route from.

    A later stage reads the input directly, or a floating value computed from it (and from no
    parameter, or the value would carry a gradient anyway), without that value carrying one back.
    """
    watched = []
    for k, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if not _floating(node):
            continue
        made = _made_from(node)
        later = [(j, v) for j, s in enumerate(plan.stages) if j > 0
                 for v in s.inputs if v in made and v not in s.grad_inputs]
        if later:
            watched.append((k, str(node.target), later))
    return watched


def refuse_input_grads(watched: list[tuple[int, str, list[tuple[int, str]]]], micro_batch: list[Any]) -> None:
    """Raise if a watched model input requires grad in this step (``micro_batch``: one value per input)."""
    for k, name, later in watched:
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(micro_batch[k])[0]):
            stages = sorted({j for j, _ in later})
            values = ", ".join(f"'{v}' (stage {j})" for j, v in later)
            who = f"stages {', '.join(map(str, stages))} read" if len(stages) > 1 else f"stage {stages[0]} reads"
            raise PipelineInputError(
                f"model input '{name}' requires grad now but did not in the example inputs at compile, and "
                f"{who} it or a value computed from it alone ({values}): the compiler routed no gradient back from there, "
                f"so {name}.grad would miss that share. Compile with the input requiring grad "
                f"(example_inputs=({name}.requires_grad_(), ...), or example_kwargs) so that its gradient is routed; "
                "or, in one process, use schedule='gpipe'")


def _made_from(node: torch.fx.Node) -> set[str]:
    """Return the names of ``node`` and the floating values computed from it (a gradient could flow through)."""
    made, todo = {node.name}, [node]
    while todo:
        for user in todo.pop().users:
            if user.name not in made and _floating(user) and user.target not in _DETACHING:
                made.add(user.name)
                todo.append(user)
    return made


_DETACHING = {"detach", torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default}


def _floating(node: torch.fx.Node | None) -> bool:
    """Tell whether a value crossing a boundary holds a tensor a gradient could flow through."""
    spec = None if node is None else node.meta.get("fxpipe.value")
    return spec is None or any(isinstance(t, passes.TensorSpec) and passes.differentiable(t.dtype)
                               for t in tree_flatten(spec)[0])


def refuse_changed_linears(runnables: Mapping[int, torch.fx.GraphModule]) -> None:
    """Raise if a linear zero bubble calls as a function got hooks or a parametrization after compile.

    A stage whose schedule defers weight gradients calls such a module's ``linear`` itself,
    so hooks and parametrizations added to it afterwards would be skipped, silently.
    """
    for j, gm in runnables.items():
        for name, mod in gm.meta.get("fxpipe.replaced_modules", ()):
            added = "a parametrization" if type(mod) is not torch.nn.Linear else "hooks" if hooked(mod) else None
            if added is not None:
                raise PipelineInputError(
                    f"module '{name}' (stage {j}) got {added} after the pipe was compiled; under a schedule with W "
                    "steps its stage calls the linear's function itself (to defer the weight gradient), so they "
                    "would not run. Register hooks and parametrizations before fxpipe.compile (a hooked or "
                    "parametrized linear is left to its module there)")
