"""Reuse a saved plan: check that the model's graph still matches it, then apply its stages.

A plan records every node of the traced graph by name, op and target. Reusing it writes the
saved stage of each compute node into ``node.meta["fxpipe.stage"]`` (the partition pass's
output), so the split and the plan that follow are the same code as for a fresh partition.
A graph that computes the same values in another order (a forward iterating a set of strings,
whose order follows the process's hash seed) takes the plan's node names first, matched by
what each node computes (``plan.graph_keys``, :func:`fxpipe.passes.structure`). A graph that
no longer matches (nodes added, removed or renamed, an op or target changed, a different
number of stages) is refused with :class:`~fxpipe.errors.PlanMismatchError`.
"""

from __future__ import annotations

import difflib
import logging
import os
import warnings
from typing import Any, Union, cast

import torch.fx
from torch.fx.node import _get_qualified_name

from fxpipe import passes
from fxpipe.errors import PlanMismatchError
from fxpipe.plan.pipeline import PipelinePlan

__all__ = ["LAYOUT_DEFAULTS", "PlanLike", "adopt_layout", "apply_plan", "differences", "front_end", "front_end_layout",
           "graph_signature", "load_plan"]

log = logging.getLogger(__name__)

PlanLike = Union[str, "os.PathLike[str]", PipelinePlan]

_SHOWN = 6  # differences listed per kind before "and N more"

# fxpipe.compile's defaults for what a plan's layout records; an argument left at its default takes the plan's
LAYOUT_DEFAULTS: dict[str, Any] = {"chunks": 1, "schedule": "gpipe", "checkpoint": "except_last", "stages_per_rank": 1,
                                   "data_parallel": 1, "data_parallel_shard": False, "tensor_parallel": 1,
                                   "tracer": "fx", "export_dims": "auto"}
_REPLICAS = ("data_parallel", "data_parallel_shard", "tensor_parallel")  # only across ranks, without mesh=


def adopt_layout(plan: PipelinePlan, given: dict[str, Any], distributed: bool, mesh: Any = None) -> dict[str, Any]:
    """Return ``given`` (compile's layout arguments) with those left at their defaults taken from ``plan``.

    A plan records its chunks, schedule, policies per stage and layout (``plan.layout``: stages
    per rank, replicas, sharding, tensor parallelism, and the front end whose node names it
    holds; older plans record none and change nothing).
    Replicas and tensor parallelism are taken only across ranks and without ``mesh=``; an
    argument passed with another value than its default wins.
    """
    if plan.layout is None:
        return dict(given)
    policies = plan.policies()
    recorded: dict[str, Any] = {"chunks": plan.chunks, "checkpoint": policies[0] if len(set(policies)) == 1
                                else policies, **{k: plan.layout[k] for k in LAYOUT_DEFAULTS if k in plan.layout}}
    if plan.schedule != "custom":
        recorded["schedule"] = plan.schedule
    elif given.get("schedule", "gpipe") == "gpipe":
        warnings.warn("the plan was compiled with your own schedule, whose actions a plan does not record: this pipe "
                      "runs 'gpipe', schedule='s default; pass your schedule's text as schedule= to run it", stacklevel=3)
    out = dict(given)
    dropped = [f"{k}={recorded[k]!r}" for k in _REPLICAS if k in recorded and recorded[k] != LAYOUT_DEFAULTS[k]]
    if dropped and not distributed:
        warnings.warn(f"the plan records {', '.join(dropped)}, which run across ranks: this pipe runs in one process "
                      "without them (under torchrun, pass runtime='distributed' to take them)", stacklevel=3)
    for key, default in LAYOUT_DEFAULTS.items():
        if key not in recorded or (key in _REPLICAS and (not distributed or mesh is not None)):
            continue
        value = given.get(key, default)
        if type(value) is type(default) and value == default:
            out[key] = recorded[key]
    return out


def front_end(gm: torch.fx.GraphModule) -> str:
    """Name the front end whose node names ``gm`` has, as a plan records it: ``"export"`` or ``"fx"``."""
    return "export" if gm.meta.get("fxpipe.tracer") == "export" else "fx"


def front_end_layout(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Return what a plan records of the front end: the tracer, and ``export_dims`` where not the default."""
    static = gm.meta.get("fxpipe.export_dims") == "batch"  # its graph's node names differ from "auto"'s
    return {"tracer": front_end(gm), **({"export_dims": "batch"} if static else {})}


def load_plan(plan: PlanLike) -> PipelinePlan:
    """Return ``plan`` itself, or the plan saved at the path ``plan``."""
    if isinstance(plan, PipelinePlan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return PipelinePlan.load(os.fspath(plan))
    raise TypeError(f"plan= takes a PipelinePlan or the path of a saved plan, got {type(plan).__name__}")


def target_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """Name a node's target stably: the function's qualified name, a module path and class."""
    target = node.target
    if node.op == "call_module":
        try:
            return f"{target} ({type(gm.get_submodule(cast(str, target))).__name__})"
        except AttributeError:
            return str(target)
    if isinstance(target, str):
        return target
    try:
        return _get_qualified_name(target)  # torch.fx's own name: torch.relu, operator.add
    except Exception:  # noqa: BLE001 - any callable fx accepted; fall back to its plain name
        name, module = getattr(target, "__name__", None), getattr(target, "__module__", None)
        return str(target) if name is None else f"{module}.{name}" if module else name


def graph_signature(gm: torch.fx.GraphModule) -> tuple[list[str], list[str], list[str]]:
    """Return the graph's node names, ops and target names, in graph order."""
    nodes = list(gm.graph.nodes)
    return [n.name for n in nodes], [n.op for n in nodes], [target_name(n, gm) for n in nodes]


def differences(plan: PipelinePlan, gm: torch.fx.GraphModule) -> list[str]:
    """List how ``gm``'s graph differs from the graph ``plan`` was made from (empty if none)."""
    names, ops, targets = graph_signature(gm)
    have = len(plan.graph_ops) == len(plan.graph_nodes) == len(plan.graph_targets) > 0
    # Align on (op, target) when the plan records them, so an inserted node does not make
    # every later node with a shifted name look changed; older plans align on names.
    old = list(zip(plan.graph_ops, plan.graph_targets)) if have else list(plan.graph_nodes)
    new = list(zip(ops, targets)) if have else names
    found: dict[str, list[str]] = {"removed": [], "added": [], "renamed": [], "changed": []}

    def describe(k: int, in_plan: bool) -> str:
        if in_plan:
            return plan.graph_nodes[k] + (f" ({plan.graph_ops[k]} {plan.graph_targets[k]})" if have else "")
        return names[k] + (f" ({ops[k]} {targets[k]})" if have else "")

    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            found["renamed"] += [f"{plan.graph_nodes[i]} -> {names[j]}"
                                 for i, j in zip(range(i1, i2), range(j1, j2)) if plan.graph_nodes[i] != names[j]]
        elif tag == "replace" and have and i2 - i1 == j2 - j1:
            for i, j in zip(range(i1, i2), range(j1, j2)):
                if ops[j] == plan.graph_ops[i] == "placeholder":  # an input's target is its name
                    found["renamed"].append(f"{plan.graph_nodes[i]} -> {names[j]}")
                else:
                    found["changed"].append(f"{plan.graph_nodes[i]}: {plan.graph_ops[i]} "
                                            f"{plan.graph_targets[i]} -> {names[j]}: {ops[j]} {targets[j]}")
        else:
            found["removed"] += [describe(i, True) for i in range(i1, i2)]
            found["added"] += [describe(j, False) for j in range(j1, j2)]
    lines = []
    for kind, items in found.items():
        if items:
            more = f", and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
            lines.append(f"{kind} ({len(items)}): " + "; ".join(items[:_SHOWN]) + more)
    return lines


def apply_plan(gm: torch.fx.GraphModule, plan: PipelinePlan, n_stages: int) -> None:
    """Write ``plan``'s stage of every node into ``gm``'s ``fxpipe.stage`` meta, after checking it fits.

    Reads:  the graph's nodes (names, ops, targets, and what they compute).
    Writes: ``node.meta["fxpipe.stage"]``, as :func:`fxpipe.passes.partition` does; a graph
            traced in another order is rebuilt in the plan's order and names first.
    Raises :class:`PlanMismatchError` saying what differs.
    """
    fix = ("make a new plan: call fxpipe.compile without plan= (or run `fxpipe inspect MODEL "
           "--stages N --json plan.json`) and save pipe.plan")
    if plan.n_stages != n_stages:
        raise PlanMismatchError(f"the saved plan has {plan.n_stages} stages but n_stages={n_stages}; "
                                f"pass n_stages={plan.n_stages}, or {fix}")
    if not plan.graph_nodes:
        raise PlanMismatchError(f"the saved plan records no graph nodes, so it cannot be checked "
                                f"against the model; {fix}")
    diffs = differences(plan, gm)
    if diffs and len(plan.graph_keys) == len(plan.graph_nodes) and \
            passes.rename_like(gm, list(zip(plan.graph_nodes, plan.graph_keys))):
        # the same values traced in another order (a forward iterating a set of strings): take the plan's names
        log.info("the model traced its nodes in another order than the saved plan's graph; it takes the plan's names")
        diffs = differences(plan, gm)
    if diffs:
        fixed = [f"{str(n.target)[:-2]} (to {n.meta['fxpipe.fixed']!r})" for n in gm.graph.nodes
                 if n.op == "placeholder" and "fxpipe.fixed" in n.meta and str(n.target)[:-2] in plan.graph_nodes]
        ops = dict(zip(plan.graph_nodes, plan.graph_ops))
        taken = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder" and "fxpipe.fixed" not in n.meta
                 and ops.get(f"{n.target}_1") == "placeholder" and str(n.target) not in ops]
        why = (f"\nThe plan's graph takes as inputs what this trace fixed to its example's value: "
               f"{', '.join(fixed)} (tracer='fx' fixes a None, flag or string example input); compile with example "
               "inputs like the plan's." if fixed else
               f"\nThe plan's graph fixed {', '.join(taken)} to its example's value (tracer='fx' fixes a None, flag or "
               "string example input), which this trace takes as input(s); compile with example inputs like the "
               "plan's." if taken else "")
        raise PlanMismatchError("the model's graph no longer matches the saved plan:\n  "
                                + "\n  ".join(diffs) + why + f"\nTo pipeline the model as it is now, {fix}.")
    stage_of: dict[str, int] = {}
    for stage in plan.stages:
        for name in stage.nodes:
            stage_of.setdefault(name, stage.index)
    try:
        passes.assign_by_name(gm, stage_of, n_stages)
    except ValueError as exc:
        raise PlanMismatchError(f"the saved plan does not assign every node: {exc}; {fix}") from None
