"""``fxpipe plan --gpus N``: choose a whole cluster's layout by simulating it — dp x pp x tp, FSDP2 or DDP,
stages per rank, schedule, chunks and recomputation per stage.

    model ─trace, annotate, retain (once)─▶ tp sizes the automatic TP plan takes (fxpipe.plan.tensorparallel)
          ─▶ every layout (fxpipe.simulate.layouts.shapes)
          ─▶ per layout, from cached stage costs (one cut per stage count; costs per tp x micro-batch rows):
               state bound: parameters, gradients, optimizer state of the fullest rank > budget ─▶ rejected
               time bound: the busiest rank's compute alone (no bubble, no communication)
          ─▶ by increasing time bound: simulate (fxpipe.simulate.simulation.run, the layout's replicas and
             network), recomputation from the least (never, selective, except_last, always, then a policy
             per stage: fxpipe.simulate.fit.choose) until every rank fits
          ─▶ stop once the next layout's bound exceeds the ``keep``-th best simulated step: none after it
             can be faster

Every layout has the same GPUs and global batch, so step time ranks them. Pruning is exact: a
layout is skipped only when it cannot fit (its state alone overflows) or cannot be among the
``keep`` fastest (its compute alone is slower).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe import passes
from fxpipe.errors import SearchSpaceError
from fxpipe.options import AUTO, POLICIES
from fxpipe.plan.pipeline import PipelinePlan, human
from fxpipe.plan.tensorparallel import plan_tensor_parallel
from fxpipe.runtime.schedules.builtin import MULTI_PRODUCERS, PLACEMENTS, PRODUCERS
from fxpipe.runtime.schedules.finals import final_backwards
from fxpipe.simulate.choices import Choice, ClusterSearch
from fxpipe.simulate.devices import DeviceModel, device_model
from fxpipe.simulate.fit import choose
from fxpipe.simulate.layouts import Shape, shapes
from fxpipe.simulate.memsim import OPTIMIZER_STATES
from fxpipe.simulate.network import Layout
from fxpipe.simulate.planner import _cut, prepare
from fxpipe.simulate.simulation import Simulation, run
from fxpipe.simulate.stagecost import StageCost, example_rows, graph_costs
from fxpipe.simulate.tpcost import with_tensor_parallel

__all__ = ["Choice", "ClusterSearch", "cluster_search"]  # the first two from fxpipe.simulate.choices

log = logging.getLogger(__name__)


def _tp_sizes(gm: torch.fx.GraphModule, gpus_per_node: int, gpus: int) -> dict[int, tuple[dict[str, Any], set[str]]]:
    """Return the tp sizes (up to a node) the automatic TP plan takes, with each one's record and shards.

    The automatic plan's roles are derived once, at the smallest size, and checked at each larger
    size as a written plan (one propagation, not the derivation's many); a size they do not divide
    is derived anew.
    """
    out: dict[int, tuple[dict[str, Any], set[str]]] = {}
    written: dict[str, Any] | None = None
    t = 2
    while t <= min(gpus_per_node, gpus):
        if gpus % t == 0:
            tp = None
            for plan in ([written] if written else []) + ["auto"]:
                try:
                    tp = plan_tensor_parallel(gm, t, plan, record=False)
                    break
                except (ValueError, TypeError) as exc:  # a size the model's layers do not divide by
                    log.info("tensor_parallel=%d with %s plan: %s", t, "the automatic" if plan == "auto" else "a", exc)
            if tp is not None and tp.layouts:
                out[t] = (tp.record(1), set(tp.layouts))
                written = written or dict(tp.styles)
        t *= 2
    return out


def _exact(gm: torch.fx.GraphModule, plan: PipelinePlan, model: DeviceModel, tp_plan: tuple[Any, Any], tp: int,
           rows: float, dtype: torch.dtype | None, memo: dict) -> list[StageCost]:
    """Return the stage costs of ``plan``'s cut over ``tp`` ranks (``tp_plan``: its record and shards) at ``rows`` rows."""
    costs = graph_costs(gm, plan, model, rows, dtype, memo=memo)
    record, sharded = tp_plan
    if record is not None:
        link = Layout(tp=tp).tp_link(model)
        costs = with_tensor_parallel(costs, gm, plan, record, link, rows, dtype, None, sharded)[0]
    return costs


def _between(low: list[StageCost], high: list[StageCost], r0: float, r1: float, r: float) -> list[StageCost]:
    """Return stage costs at ``r`` rows, interpolated linearly between those at ``r0`` and ``r1`` rows."""
    w = (r - r0) / (r1 - r0)

    def mix(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: mix(a.get(k, 0.0), b.get(k, 0.0)) for k in set(a) | set(b)}
        return a + (b - a) * w if isinstance(a, float) else a

    return [StageCost(**{f.name: mix(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(StageCost)})
            for x, y in zip(low, high)]


def _state(costs: Sequence[StageCost], ranks: Sequence[int], s: Shape, optimizer: str) -> tuple[float, int]:
    """Return the fullest rank's parameters, gradients and optimizer state (bytes), and that rank."""
    states = OPTIMIZER_STATES[optimizer]
    per: dict[int, float] = {}
    for j, c in enumerate(costs):
        params = c.params * (1 + 1 / s.dp) if s.shard else c.params
        opt = states * c.grads / (s.dp if s.shard else 1)
        per[ranks[j]] = per.get(ranks[j], 0.0) + params + c.grads + opt
    r = max(per, key=lambda k: per[k])
    return per[r], r


def _shared(gm: torch.fx.GraphModule, plan: PipelinePlan) -> list[tuple[int, int]]:
    """Return the pairs of stages of ``plan`` that read one parameter (a tie: embedding and head)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    readers: dict[int, set[int]] = {}
    for j, stage in enumerate(plan.stages):
        for name in stage.nodes:
            node = nodes.get(name)
            if node is None or node.op not in ("get_attr", "call_module"):
                continue
            try:
                params = (list(gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module"
                          else [gm.get_parameter(str(node.target))])
            except AttributeError:  # a buffer or a constant: nothing to reduce
                continue
            for p in params:
                readers.setdefault(id(p), set()).add(j)
    return sorted({(a, b) for stages in readers.values() for a in stages for b in stages if a < b})


def _bound(costs: Sequence[StageCost], ranks: Sequence[int], chunks: int) -> float:
    """Return a lower bound of any schedule's step time: the busiest rank's compute, and with a stage per rank
    the fill and drain around it.

    With one stage per rank, stage ``j`` cannot start before micro-batch 0 has gone forward through
    the stages before it, and the step cannot end before the gradients of its last backward have
    gone back through them (their input-gradient parts; weight gradients may wait)::

        step >= sum(F[i] for i < j) + chunks x (F[j] + B[j]) + sum(B[i] - W[i] for i < j)
    """
    per: dict[int, float] = {}
    for j, c in enumerate(costs):
        per[ranks[j]] = per.get(ranks[j], 0.0) + (c.forward + c.backward) * chunks
    bound = max(per.values())
    if len(set(ranks)) == len(costs):  # a stage per rank
        ahead = behind = 0.0
        for c in costs:
            bound = max(bound, ahead + (c.forward + c.backward) * chunks + behind)
            ahead += c.forward
            behind += c.backward - c.weight
    return bound + costs[-1].loss * chunks


def _overflow(sim: Simulation, budget: float) -> str:
    """Name what overflows the budget on the fullest rank."""
    r, mem = max(sim.devices.items(), key=lambda kv: kv[1].peak)
    return (f"rank {r}: {human(mem.peak, 'B')} > {human(budget, 'B')} (parameters {human(mem.params, 'B')}, "
            f"gradients {human(mem.grads, 'B')}, optimizer {human(mem.optimizer, 'B')}, "
            f"activations {human(mem.activations, 'B')} under {sim.checkpoint})")


def cluster_search(model: nn.Module | torch.fx.GraphModule, args: tuple, *, gpus: int, gpus_per_node: int = 8,
                   device: str | DeviceModel = "h100", memory: float | None = None, batch: int | None = None,
                   kwargs: dict | None = None, dtype: torch.dtype | None = None, optimizer: str = "adam",
                   schedules: Sequence[str] | None = None, checkpoints: Sequence[str] = (*POLICIES, AUTO),
                   tensor_parallel: Sequence[int] | None = None, keep: int = 10, tokens: int = 1,
                   leaf_modules: Sequence[Any] = (), only: Sequence[Shape] | None = None,
                   max_stages: int = 128, exact_sizes: int = 2, tracer: Any = "fx",
                   stages: Sequence[int] | None = None, chunks: Sequence[int] | None = None,
                   export_dims: str = "auto") -> ClusterSearch:
    """Simulate the layouts of ``model`` on ``gpus`` devices (``gpus_per_node`` to a node); return them ranked.

    ``memory`` is each device's budget (default: the device model's); ``batch`` the global rows
    per step (default: the example batch); ``tokens`` the tokens per row, for the per-GPU
    throughput. ``tensor_parallel`` limits the tp sizes tried; ``max_stages`` the stages of a
    pipeline. ``keep`` layouts are kept in full; the others are pruned by the bounds (see the
    module). ``only`` simulates just these layouts (a published configuration), unpruned. Stage
    costs are computed for at most ``exact_sizes`` micro-batch sizes per cut and tp size; the
    others are interpolated linearly between the smallest and the largest (bytes scale with the
    rows exactly; seconds do once the GEMMs are past the efficiency knee, ``DeviceModel.d_half``).
    """
    start = time.perf_counter()
    model_ = device_model(device)
    model_ = model_.replace(gpus_per_node=gpus_per_node)
    gm = model if isinstance(model, torch.fx.GraphModule) and "fxpipe.retains" in next(
        iter(model.graph.nodes)).meta else prepare(model, args, kwargs, leaf_modules, tracer, export_dims)
    base = example_rows(gm) or 1
    batch = batch or base
    budget = memory if memory is not None else model_.memory
    tps = {1: (None, None), **_tp_sizes(gm, gpus_per_node, gpus)}
    if tensor_parallel is not None:
        missing = sorted(set(tensor_parallel) - set(tps))
        if missing:
            raise SearchSpaceError(f"tensor_parallel={missing[0]}: the automatic TP plan cannot split this model over "
                             f"{missing[0]} ranks (its heads or features do not divide, or it exceeds "
                             f"gpus_per_node={gpus_per_node}); sizes that fit: {sorted(tps)}")
        tps = {t: v for t, v in tps.items() if t in tensor_parallel}
    blocks = len(passes.compute_nodes(gm))
    if only is not None:
        tps = {t: v for t, v in tps.items() if t in {s.tp for s in only}}
        missing = sorted({s.tp for s in only} - set(tps))
        if missing:
            raise ValueError(f"tensor_parallel={missing[0]}: the automatic TP plan does not split this model "
                             f"over {missing[0]} ranks")
        space = list(only)
        keep = len(space)
    else:
        space = list(shapes(gpus, gpus_per_node, batch, min(blocks, max_stages), tps=sorted(tps),
                            schedules=schedules, stages=stages, chunk_counts=chunks))
        if not space:
            asked = "".join(f" with {what} in {list(given)}" for what, given in (("stages", stages), ("chunks", chunks),
                                                                                   ("schedules", schedules)) if given)
            tried = [b for d in range(1, 129) for b in (batch + d, batch - d) if b >= 1]  # the nearest, larger first
            near = next((b for b in tried
                         if next(iter(shapes(gpus, gpus_per_node, b, min(blocks, max_stages), tps=sorted(tps),
                                              schedules=schedules, stages=stages, chunk_counts=chunks)), None)),
                        None)
            raise SearchSpaceError(f"no layout of {gpus} GPUs{asked} takes a global batch of {batch} rows on a model "
                                   f"of {blocks} cuttable blocks: a stage count is pp x stages per rank (pp divides "
                                   "the GPUs), chunks divide each replica's rows and are at least pp, and a single "
                                   "stage runs only 1f1b (gradient accumulation)"
                                   + (f"; a global batch of {near} rows has layouts" if near else ""))
    modes = sorted((c for c in checkpoints if c != AUTO), key=lambda c: POLICIES.index(c) if c in POLICIES else 0)
    found = ClusterSearch([], [], gm, model_, gpus, gpus_per_node, batch, budget, tokens, layouts=len(space))
    costs_of: dict[tuple[int, int, float], list[StageCost]] = {}
    memo: dict[Any, Any] = {}
    staged: list[tuple[float, Shape, list[StageCost], list[int]]] = []
    for n in sorted({s.n_stages for s in space}):
        plan = _cut(gm, n, model_)
        found.cuts[n] = plan
        shared = _shared(gm, plan)
        mine = [s for s in space if s.n_stages == n]
        for tp in sorted({s.tp for s in mine}):
            sizes = sorted({batch / s.dp / s.chunks for s in mine if s.tp == tp})
            ends = {r: _exact(gm, plan, model_, tps[tp], tp, r, dtype, memo)
                    for r in (sizes if len(sizes) <= exact_sizes else (sizes[0], sizes[-1]))}
            for r in sizes:
                costs_of[(n, tp, r)] = ends[r] if r in ends else _between(ends[sizes[0]], ends[sizes[-1]], sizes[0],
                                                                         sizes[-1], r)
        for s in mine:
            costs = costs_of[(n, s.tp, batch / s.dp / s.chunks)]
            ranks = PLACEMENTS[s.schedule](n, s.pp) if s.schedule in PLACEMENTS else list(range(n))
            tie = next(((a, b) for a, b in shared if ranks[a] == ranks[b]), None) if s.dp > 1 else None
            if tie is not None:  # fxpipe.compile refuses it: each stage reduces its own gradients over replicas
                found.refused.append(Choice(s, "", None, False, f"a tensor shared by stages {tie[0]} and {tie[1]}, "
                                             f"both on rank {ranks[tie[0]]}, under data parallel"))
                continue
            state, r = _state(costs, ranks, s, optimizer)
            if state > budget:
                found.rejected.append(Choice(s, "", None, False, f"rank {r}: parameters, gradients and optimizer "
                                             f"state alone {human(state, 'B')} > {human(budget, 'B')}"))
                continue
            staged.append((_bound(costs, ranks, s.chunks), s, costs, ranks))
    staged.sort(key=lambda t: t[0])
    kept: list[float] = []
    made: dict[Any, Any] = {}  # action lists by schedule, stages, chunks, ranks and replicas
    for k, (bound, s, costs, ranks) in enumerate(staged):
        if only is None and len(kept) >= keep and bound > kept[keep - 1]:
            found.bounded = len(staged) - k
            break
        cutoff = kept[keep - 1] if only is None and len(kept) >= keep else float("inf")
        choice = _evaluate(s, costs, ranks, model_, budget, modes, AUTO in checkpoints, batch, optimizer, cutoff, made)
        found.simulated += 1
        if choice is None:  # with the least recomputation already slower than the kept ones
            found.bounded += 1
            continue
        (found.ranked if choice.fits else found.rejected).append(choice)
        if choice.fits and choice.sim is not None:
            kept = sorted([*kept, choice.sim.step_time])[:keep]
    found.ranked.sort(key=lambda c: (c.sim.step_time if c.sim else 0.0, c.peak))
    found.rejected.sort(key=lambda c: (c.sim is None, c.peak))
    found.seconds = time.perf_counter() - start
    return found


def _evaluate(s: Shape, costs: list[StageCost], ranks: list[int], model: DeviceModel, budget: float,
              modes: Sequence[str], auto: bool, batch: int, optimizer: str, cutoff: float = float("inf"),
              made: dict | None = None) -> Choice | None:
    """Simulate layout ``s`` with the least recomputation that fits; return the choice (or the leanest tried).

    Recomputation only adds time, so once the least of it gives a step slower than ``cutoff`` (the
    slowest of the kept layouts) no policy can be kept: None. ``made`` caches the action lists.
    """
    made = {} if made is None else made
    n = s.n_stages
    key = (s.schedule, n, s.chunks, s.pp, s.dp > 1)
    if key not in made:
        actions = MULTI_PRODUCERS[s.schedule](n, s.chunks, s.pp) if s.schedule in MULTI_PRODUCERS \
            else PRODUCERS[s.schedule](n, s.chunks)
        made[key] = final_backwards(actions)[0] if s.dp > 1 else actions
    actions = made[key]
    layout = Layout(dp=s.dp, pp=s.pp, tp=s.tp, shard=s.shard)
    rows = batch // s.dp

    def step(policy: str | list[str]) -> Simulation:
        return run(costs, actions, ranks, ranks, model, name=s.schedule, checkpoint=policy, runtime="distributed",
                   batch=rows, optimizer=optimizer, layout=layout)

    def fits(sim: Simulation) -> bool:
        return all(m.peak <= budget for m in sim.devices.values())

    # the leanest mode first: if it overflows, so does every other policy (each stage's leanest is the same)
    lean = step(modes[-1])
    if not fits(lean):
        return Choice(s, modes[-1], lean, False, _overflow(lean, budget))
    first = step(modes[0]) if len(modes) > 1 else lean
    if first.step_time > cutoff:  # recomputation only adds time: nothing here can be kept
        return None
    if fits(first):
        return Choice(s, modes[0], first, True)
    k, sim = next((k, sim) for k, sim in ((k, step(m) if k < len(modes) - 1 else lean)
                                           for k, m in enumerate(modes[1:], 1)) if fits(sim))
    best = Choice(s, modes[k], sim, True)
    if auto and k > 0:  # a policy per stage, from the least recomputation up to the mode that fits every stage
        policies, mixed, ok = choose(costs, actions, ranks, ranks, model, budget, name=s.schedule,
                                     runtime="distributed", batch=rows, optimizer=optimizer,
                                     candidates=list(modes[:k + 1]), layout=layout)
        if ok and len(set(policies)) > 1 and mixed.step_time < sim.step_time:
            best = Choice(s, AUTO, mixed, True)
    return best if best.sim is not None and best.sim.step_time <= cutoff else None
