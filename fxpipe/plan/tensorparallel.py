"""Tensor parallelism in the plan: the styles of ``tp_plan=`` (or ``"auto"``) resolved against the traced graph.

    tp_plan  {"layers.*.attn.q": ColwiseParallel(), ...}   FQN patterns, as parallelize_module takes
             or "auto": Megatron's pairing derived from the graph (fxpipe.passes.tpauto)
        │ resolve: every key matches a module call of the graph (else: the nearest FQNs)
        │ check:   each style fits its module; tied weights share one placement; t divides each
        │          sharded dimension; the layouts propagate without conflict (fxpipe.passes.tplayout)
        ▼
    TensorParallelPlan   styles per module FQN, a Rule per node, node.meta["fxpipe.tp"] recorded,
                         the collectives per micro-batch; its record lands in ``pipe.plan.tensor_parallel``

Everything here reads the graph only, on every rank alike, so a bad plan is refused on every
rank before anything is built or sent.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from fxpipe.passes.spec import value_bytes
from fxpipe.passes.tpauto import TensorParallelError, auto_roles
from fxpipe.passes.tplayout import Conflict, Rule, propagate, site_input
from fxpipe.passes.tppartial import mixed_params
from fxpipe.passes.tpsites import Site, find_sites
from fxpipe.plan.hfstyles import from_name
from fxpipe.plan.tpcoverage import warn_little_split
from fxpipe.plan.tpstyles import STYLE_OF_ROLE, collectives, rule_of, style_text, weight_placement

__all__ = ["TensorParallelPlan", "plan_tensor_parallel"]

log = logging.getLogger(__name__)


@dataclass
class TensorParallelPlan:
    """A pipeline's tensor parallelism: ``size`` ranks per stage, a style per module FQN, their collectives."""

    size: int
    styles: dict[str, Any]  # site FQN -> ParallelStyle
    sites: dict[str, Site]
    rules: dict[str, Rule]  # node name -> what it reads and gives
    auto: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)  # per styled call: module, node, collectives
    layouts: dict[str, Any] = field(default_factory=dict)  # node name -> its value's layout (None: whole)

    def record(self, micro: int) -> dict[str, Any]:
        """Return the plan as JSON data: styles by module, the modules left whole, collectives per micro-batch."""
        per = max(micro, 1)
        shown = [{**c, "collectives": [[p, k, b // per] for p, k, b in c["collectives"]]} for c in self.calls]
        return {"size": self.size, "auto": self.auto, "micro": per,
                "modules": {fqn: style_text(s) for fqn, s in self.styles.items()},
                "replicated": [s.fqn for s in self.sites.values()
                               if s.kind in ("linear", "embedding") and s.fqn not in self.styles],
                "calls": shown}

    def shares_input(self, fqn: str) -> bool:
        """Tell whether a styled linear may share its input's backward all-reduce (column-wise, whole input)."""
        style, site = self.styles.get(fqn), self.sites[fqn]
        return type(style) is ColwiseParallel and site.kind == "linear" \
            and isinstance(style.input_layouts[0], Replicate) and style.use_local_output

    def sharded_weights(self) -> set[int]:
        """Return the ids of the weights the styles make DTensors."""
        return {id(t) for fqn, style in self.styles.items() for t in (self.sites[fqn].weight, self.sites[fqn].bias)
                if t is not None and weight_placement(style, self.sites[fqn]) is not None}


def plan_tensor_parallel(gm: torch.fx.GraphModule, t: int, tp_plan: Any, record: bool = True) -> TensorParallelPlan:
    """Resolve ``tp_plan`` (a dict of FQN patterns to styles, or ``"auto"``) on ``gm``.

    ``record``: write each node's layout to ``node.meta["fxpipe.tp"]`` (what the build and the
    runtime read); the simulator asks for a plan without recording it.
    """
    sites = find_sites(gm)
    if tp_plan == "auto":
        styles = {fqn: STYLE_OF_ROLE[role]() for fqn, role in auto_roles(gm, t).items()}
    else:
        styles = _resolve(gm, sites, tp_plan)
    rules = {name: rule_of(style, sites[fqn], t) for fqn, style in styles.items() for name in sites[fqn].nodes}
    _check_ties(gm, sites, styles)
    layouts, conflicts = propagate(gm, rules, t, record=record)
    if conflicts:
        raise _refusal(conflicts[0], tp_plan == "auto", t, conflicts)
    _check_crossing(gm, layouts)
    plan = TensorParallelPlan(t, styles, sites, rules, auto=tp_plan == "auto",
                              layouts={n: v for n, v in layouts.items() if isinstance(v, int)})
    if record:
        _check_mixed_use(gm, plan)
    plan.calls = _calls(gm, plan, layouts)
    if record and plan.auto:
        warn_little_split(gm, plan)
    log.info("tensor parallel over %d ranks: %d module(s) styled, %d left whole", t, len(styles),
             len(plan.record(1)["replicated"]))
    return plan


def _check_mixed_use(gm: torch.fx.GraphModule, plan: TensorParallelPlan) -> None:
    """Refuse a weight left whole that is used both beside a shard and on a whole value.

    Each rank computes the first use's gradient over its own shard only, which the runtime sums
    over the group (:mod:`fxpipe.passes.tppartial`); the second use's is whole on every rank and
    would be counted once per rank by that sum.
    """
    styled = plan.sharded_weights()
    for name, (shard_use, whole_use) in mixed_params(gm).items():
        if id(gm.get_parameter(name)) in styled:
            continue
        raise TensorParallelError(
            f"'{name}' is used beside a shard (node '{shard_use}') and on a whole value (node '{whole_use}'): "
            "each rank would compute the first part of its gradient over its own shard only, and fxpipe cannot sum "
            "that part alone; give the two uses separate parameters, or leave the linears that make the shard "
            "out of tp_plan")


def _matches(pattern: str, fqn: str) -> bool:
    """Tell whether a plan key matches an FQN atom by atom (``*`` within an atom, as parallelize_module)."""
    atoms, parts = pattern.split("."), fqn.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _resolve(gm: torch.fx.GraphModule, sites: Mapping[str, Site], tp_plan: Mapping[str, Any]) -> dict[str, Any]:
    """Map every key of a written plan to the sites it names; refuse a key that names none."""
    styles: dict[str, Any] = {}
    absent: list[str] = []  # a Hugging Face plan's keys for modules this model has none of
    for key, style in tp_plan.items():
        named = isinstance(style, str)
        if named:  # a Hugging Face model's own plan names its styles
            style = from_name(style, key)
            if style is None:
                continue
        hits = [fqn for fqn in sites if _matches(key, fqn)]
        if not hits:
            exc = _no_match(gm, sites, key)
            if not (named and getattr(exc, "absent", False)):
                raise exc
            absent.append(key)  # transformers skips them too (Qwen3-MoE's plan keeps the dense MLP's keys)
            continue
        for fqn in hits:
            if fqn in styles and style_text(styles[fqn]) != style_text(style):
                raise TensorParallelError(f"tp_plan gives '{fqn}' two styles: {style_text(styles[fqn])} and "
                                          f"{style_text(style)} (key '{key}'); keep one")
            styles[fqn] = style
    if absent and not styles:
        raise _no_match(gm, sites, absent[0])
    if absent:
        warnings.warn(f"tp_plan: {len(absent)} key(s) of the Hugging Face plan name no module of this model and are "
                      f"skipped, as transformers skips them: {absent}", stacklevel=2)
    return styles


def _no_match(gm: torch.fx.GraphModule, sites: Mapping[str, Site], key: str) -> TensorParallelError:
    """Explain a plan key that names no module call: traced through, or the nearest FQNs."""
    inner = [fqn for fqn in sites if any(_matches(key, ".".join(fqn.split(".")[:k]))
                                         for k in range(1, fqn.count(".") + 1))]
    if inner:
        return TensorParallelError(
            f"tp_plan key '{key}' names a module the trace went through (its forward is inlined in the graph), "
            f"so a style on it would never run; style the modules inside it (such as {inner[:3]}), or keep it "
            "whole with leaf_modules=")
    owners = [n.rsplit(".", 1)[0] for n, _ in gm.named_parameters() if "." in n]  # modules exported graphs flatten
    names = list(dict.fromkeys([*sites, *(n for n, _ in gm.named_modules() if n), *owners]))
    exists = [n for n in names if _matches(key, n) and n not in sites]
    if exists:
        return TensorParallelError(
            f"tp_plan key '{key}' names {exists[:3]}, which the graph holds as no module call, so no style can "
            "apply: an exported graph keeps only nn.Linear and nn.Embedding as module calls (a norm under "
            "SequenceParallel needs tracer='fx', where the norm is a leaf), and layers written otherwise "
            "(transformers' Conv1D, an addmm on a parameter) take no style; leave it out of the plan, where it "
            "stays whole on every rank")
    near = difflib.get_close_matches(key, names, n=5, cutoff=0.4) or [s for s in sites][:5]
    exc = TensorParallelError(f"tp_plan key '{key}' matches no module of the model; the nearest FQNs are {near}")
    exc.absent = True  # type: ignore[attr-defined]
    return exc


def _check_ties(gm: torch.fx.GraphModule, sites: Mapping[str, Site], styles: Mapping[str, Any]) -> None:
    """Refuse a weight shared by sites whose styles place it differently, or read directly as a whole."""
    by_weight: dict[int, list[tuple[str, str | None]]] = {}
    for fqn, site in sites.items():
        if site.weight is not None:
            by_weight.setdefault(id(site.weight), []).append((fqn, weight_placement(styles.get(fqn), site)))
    for holders in by_weight.values():
        placements = {p for _, p in holders}
        if len(placements) > 1:
            shown = ", ".join(f"'{fqn}' ({style_text(styles[fqn]) if fqn in styles else 'not in the plan'})"
                              for fqn, _ in holders)
            raise TensorParallelError(f"a weight tied between {shown} would be placed differently by each; give "
                                      "them styles that shard it alike (an embedding's RowwiseParallel with an "
                                      "output head's ColwiseParallel(output_layouts=Replicate())), or leave all whole")
    sharded = {id(sites[fqn].weight) for fqn, style in styles.items() if weight_placement(style, sites[fqn])}
    nodes_of = {name for site in sites.values() for name in site.nodes}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and id(_fetch(gm, str(node.target))) in sharded:
            readers = [u.name for u in node.users if u.name not in nodes_of]
            if readers:
                raise TensorParallelError(f"'{node.target}' is sharded by the plan but node '{readers[0]}' reads it "
                                          "directly, as a whole tensor; move that use into a module the plan "
                                          "styles alike, or leave the weight's module out of the plan")


def _fetch(gm: torch.fx.GraphModule, target: str) -> Any:
    """Return the attribute a ``get_attr`` target names."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _refusal(c: Conflict, auto: bool, t: int, conflicts: Sequence[Conflict] = ()) -> TensorParallelError:
    """Turn the first conflict of a plan into its refusal (the others of its module bound the sizes offered)."""
    where = f"node '{c.node}'" + (f" in module '{c.module}'" if c.module else "")
    if c.kind == "indivisible" and c.size:
        from fxpipe.passes.tpauto import indivisible
        others = [x.size for x in conflicts if x.kind == "indivisible" and x.size and x.module == c.module]
        return indivisible(f"the heads (or another sharded dim) that node '{c.node}' reshapes", c.module, c.size, t,
                           container=c.module is not None, others=others)
    fix = ("; leave the linears that make this shard out of the plan (that region then runs whole), or pass "
           "tp_plan='auto', which leaves such a region whole" if c.kind == "mixed" and not auto else "")
    if fix and "att" in (c.module or "").lower():
        fix += (f". In attention the usual cause is fewer key/value heads than tensor_parallel={t} (multi-query "
                "attention's one, or grouped-query attention's few): their projections would be cut inside a head")
    return TensorParallelError(f"tp_plan{' (auto)' if auto else ''} cannot run {where}: {c.message}{fix}")


def _check_crossing(gm: torch.fx.GraphModule, layouts: Mapping[str, Any]) -> None:
    """Refuse a DTensor crossing a stage boundary: messages carry each rank's local tensor."""
    for node in gm.graph.nodes:
        stage = node.meta.get("fxpipe.stage")
        if layouts.get(node.name) == "D" and any(u.meta.get("fxpipe.stage", stage) != stage for u in node.users):
            raise TensorParallelError(f"'{node.name}' is a DTensor (a style's use_local_output=False) and crosses "
                                      f"from stage {stage} to a later one; pipeline messages carry local tensors: "
                                      "give that style use_local_output=True, or split elsewhere")


def _calls(gm: torch.fx.GraphModule, plan: TensorParallelPlan, layouts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """List every styled call with the collectives it runs for the example batch.

    Column-wise linears of one stage reading one whole input share one backward all-reduce (the
    build's region node, :mod:`fxpipe.runtime.tpregion`): the first of them counts it.
    """
    nodes = {n.name: n for n in gm.graph.nodes}

    def key(name: str) -> tuple[Any, str]:
        return nodes[name].meta.get("fxpipe.stage"), getattr(site_input(nodes[name]), "name", "")

    readers = Counter(key(name) for fqn in plan.styles if plan.shares_input(fqn) for name in plan.sites[fqn].nodes
                      if layouts.get(key(name)[1]) is None)
    counted: set[tuple[Any, str]] = set()
    out = []
    for fqn, style in plan.styles.items():
        site = plan.sites[fqn]
        params = sum(p.numel() * p.element_size() for p in (site.weight, site.bias) if p is not None)
        for name in site.nodes:
            node = nodes[name]
            x = site_input(node)
            spec = x.meta.get("fxpipe.value") if isinstance(x, torch.fx.Node) else None
            wants = bool(getattr(spec, "requires_grad", False))
            if plan.shares_input(fqn) and readers.get(key(name), 0) > 1:
                wants = wants and key(name) not in counted
                counted.add(key(name))
            found = collectives(style, layouts.get(getattr(x, "name", "")), layouts.get(name),
                                value_bytes(spec), value_bytes(node.meta.get("fxpipe.value")), wants, params)
            out.append({"module": fqn, "node": name, "stage": node.meta.get("fxpipe.stage"),
                        "collectives": [list(c) for c in found]})
    return out
