"""``checkpoint="auto"``: each stage's recomputation policy, and the cut, chosen to fit a memory budget.

    the balanced cut, and each with one boundary moved to the next narrow cut (fxpipe.passes.shift)
      ─▶ per cut: stage costs ─▶ every stage "never" ─▶ the step simulated on the schedule in use,
         memory walked along its timeline (fxpipe.simulate.simulation.run)
         ─▶ a device over the budget: its stage holding the most activations takes the next policy
            in order of recomputation (never, selective, except_last, always): the first that fits
            the device, else the one that lowers it most ─▶ simulate again, until every device fits
    ─▶ of the cuts that fit, the fastest predicted step (the balanced cut unless 1% slower)
    ─▶ none fits: which stage overflows and by how much under its leanest policy, and what would:
       more micro-batches, more stages

Under data parallel the step is simulated in its layout (:func:`fxpipe.simulate.reading.layout_of`),
so memory is the planner's: FSDP2 (``data_parallel_shard=True``) holds each stage's gathered
parameters and full gradients for the step beside their 1/dp shards
(:func:`fxpipe.simulate.dpcost.sharded_memory`), as the runtime runs it
(``reshard_after_forward=False``); sharding saves optimizer state, not a step's peak.

1F1B's first stage holds ``n_stages`` micro-batches at once and its last stage one, so the first
gets more recomputation. Step times come from a nominal device model (the same on every rank, so
that every rank chooses alike); the memory walk follows the schedule's order, not the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe import passes
from fxpipe.errors import MemoryBudgetError
from fxpipe.options import POLICIES, CompileOptions
from fxpipe.passes.retain import retain
from fxpipe.passes.shift import neighbours, recut
from fxpipe.plan.assign import Assignment
from fxpipe.plan.pipeline import PipelinePlan, human
from fxpipe.plan.stages import make_plan
from fxpipe.runtime.schedules.actions import Action
from fxpipe.runtime.schedules.builtin import PRODUCERS, Schedule
from fxpipe.simulate.devices import DeviceModel, device_model
from fxpipe.simulate.network import Layout
from fxpipe.simulate.reading import layout_of
from fxpipe.simulate.simulation import Simulation, run
from fxpipe.simulate.stagecost import StageCost, example_rows, graph_costs
from fxpipe.simulate.tpcost import with_tensor_parallel

__all__ = ["Fit", "choose", "fit"]

_BETTER = 0.01  # a moved cut must predict a step this much faster than the balanced one


@dataclass
class Fit:
    """A choice for one cut: each stage's policy, the predicted step, whether every device fits."""

    policies: list[str]
    sim: Simulation
    fits: bool
    cut: Any  # the partition it was made for (None: a saved plan's stages)

    @property
    def peaks(self) -> list[float]:
        """Return each stage's predicted peak memory in bytes."""
        return [s.memory.peak for s in self.sim.stages]


def choose(costs: list[StageCost], actions: list[list[Action]], rank_of: list[int], device_of: list[int],
           model: DeviceModel, budget: float, *, name: str, runtime: str, batch: int,
           optimizer: str = "none", candidates: Sequence[str] = POLICIES,
           layout: Any = None) -> tuple[list[str], Simulation, bool]:
    """Return each stage's policy with the least recomputation that fits ``budget``, the simulated step, and
    whether every device fits (else the leanest policies tried).

    ``candidates`` are the policies to choose from, least recomputation first; ``layout`` the
    replicas and network (:class:`fxpipe.simulate.network.Layout`) the step runs in.
    """
    n = len(costs)

    def step(policies: list[str]) -> Simulation:
        return run(costs, actions, rank_of, device_of, model, name=name, checkpoint=policies, runtime=runtime,
                   batch=batch, optimizer=optimizer, layout=layout)

    policies = [candidates[0]] * n
    sim, done = step(policies), set()
    while True:
        over = [d for d, mem in sorted(sim.devices.items()) if mem.peak > budget]
        if not over:
            return policies, sim, True
        room = [j for d in over for j in range(n) if device_of[j] == d and j not in done]
        if not room:
            return policies, sim, False
        j = max(room, key=lambda k: sim.stages[k].memory.activations)
        d = device_of[j]
        best = (policies, sim)
        for p in candidates[candidates.index(policies[j]) + 1:]:
            trial = policies[:j] + [p] + policies[j + 1:]
            tried = step(trial)
            if tried.devices[d].peak < best[1].devices[d].peak:
                best = (trial, tried)
            if tried.devices[d].peak <= budget:
                break
        if best[1].devices[d].peak > budget or best[0][j] == candidates[-1]:
            done.add(j)  # the leanest this stage gets
        policies, sim = best


def _setting(options: CompileOptions, devices: Sequence[torch.device], schedule: Schedule, distributed: bool,
             m: int) -> tuple[list[list[Action]], list[int], list[int], str]:
    """Return the actions per rank, each stage's rank and device, and the runtime, as the pipe will run them."""
    actions = schedule.actions(m)
    if not distributed and schedule.name == "gpipe":  # one process: autograd's backward, last micro-batch first
        actions = [[a for a in row if a.kind == "F"] + [a for a in reversed(row) if a.kind != "F"] for row in actions]
    names = [str(d) for d in devices]
    local = {d: k for k, d in enumerate(dict.fromkeys(names))}
    device_of = list(schedule.ranks) if distributed else [local[d] for d in names]
    return actions, list(schedule.ranks), device_of, "distributed" if distributed else "local"


def _costs(gm: Any, plan: PipelinePlan, options: CompileOptions, model: DeviceModel, rows: float) -> list[StageCost]:
    """Return the stage costs of ``plan``: the sharded work, weights and activations divided over tensor-parallel ranks."""
    costs = graph_costs(gm, plan, model, rows, save=options.save)
    if plan.tensor_parallel:
        costs = with_tensor_parallel(costs, gm, plan, plan.tensor_parallel, model, rows)[0]
    return costs


def _layout(plan: PipelinePlan, options: CompileOptions, runtime: str) -> Layout | None:
    """Return the replicas ``plan`` runs in (None without data parallel): what their state costs is the planner's."""
    if runtime != "distributed" or options.data_parallel <= 1:
        return None
    return layout_of(plan, plan.tensor_parallel, options.data_parallel, options.data_parallel_shard)


def candidates(options: CompileOptions) -> tuple[str, ...]:
    """Return the policies ``"auto"`` chooses from: compiled stages recompute whole stages only."""
    return tuple(p for p in POLICIES if p != "selective") if options.compiled is not None else POLICIES


def fit(front: Assignment, options: CompileOptions, devices: Sequence[torch.device], schedule: Schedule,
        distributed: bool, saved: PipelinePlan | None = None, movable: bool = True) -> Fit:
    """Choose the policies (and, if ``movable``, the cut) for ``options.max_memory``; write the cut to the graph.

    Raises :class:`MemoryBudgetError` naming the stage that overflows when nothing fits.
    """
    gm, budget, m = front.gm, float(options.max_memory or 0.0), front.micro
    if not options.has_inputs:
        raise ValueError("checkpoint='auto' predicts each stage's memory from the activation sizes; pass "
                         "example_inputs=")
    if any("fxpipe.retains" not in n.meta for n in gm.graph.nodes):
        retain(gm)
    model = device_model("h100")
    batch = example_rows(gm) or m
    actions, rank_of, device_of, runtime = _setting(options, devices, schedule, distributed, m)
    comm = passes.comm_weights(devices, front.balance_by)
    cuts = [None] if front.cut is None else [front.cut.starts] + (neighbours(gm, front.cut) if movable else [])
    tried = []
    for starts in cuts:
        cut = front.cut if starts is None or starts == front.cut.starts else recut(
            gm, front.cut, starts, balance_by=front.balance_by, comm=comm, micro_batches=m)
        plan = make_plan(Assignment(gm, cut, m, front.balance_by), options, devices, schedule.name, rank_of, saved)[0]
        policies, sim, fits = choose(_costs(gm, plan, options, model, batch / m), actions, rank_of, device_of, model,
                                     budget, name=schedule.name, runtime=runtime, batch=batch,
                                     candidates=candidates(options), layout=_layout(plan, options, runtime))
        tried.append(Fit(policies, sim, fits, cut))
    fitting = [f for f in tried if f.fits]
    if not fitting:
        if front.cut is not None:  # the balanced cut again, for the hints
            passes.assign_stages(gm, front.cut.starts, front.cut.order)
        raise MemoryBudgetError(_refusal(tried[0], front, options, devices, schedule, distributed, model, batch))
    best = min(fitting, key=lambda f: f.sim.step_time)
    if tried[0].fits and tried[0].sim.step_time <= best.sim.step_time * (1 + _BETTER):
        best = tried[0]
    if best.cut is not None:
        passes.assign_stages(gm, best.cut.starts, best.cut.order)
        front.cut = best.cut
    return best


def _refusal(f: Fit, front: Assignment, options: CompileOptions, devices: Sequence[torch.device],
             schedule: Schedule, distributed: bool, model: DeviceModel, batch: int) -> str:
    """Say which stage overflows the budget, by how much, and what would fit."""
    budget, n, m = float(options.max_memory or 0.0), options.n_stages, front.micro
    device_of = _setting(options, devices, schedule, distributed, m)[2]
    lines = [(f"checkpoint='auto': no policy per stage fits max_memory={human(budget, 'B')} per device "
              f"({n} stages, {m} micro-batches, schedule {schedule.name!r}, predicted on the example batch)")]
    for d, mem in sorted(f.sim.devices.items()):
        if mem.peak > budget:
            mine = [j for j in range(n) if device_of[j] == d]
            what = ", ".join(f"stage {j} under {f.policies[j]!r}" for j in mine)
            lines.append(f"  {what}: predicted peak {human(mem.peak, 'B')}, over by {human(mem.peak - budget, 'B')} "
                         f"(parameters and gradients {human(mem.params + mem.grads, 'B')}, activations "
                         f"{human(mem.activations, 'B')})")
    hints = []
    more = _more_chunks(front, options, devices, schedule, distributed, model, batch)
    if more:
        hints.append(more)
    more = _more_stages(front, options, model, batch, schedule, distributed)
    if more:
        hints.append(more)
    fitting = [h for h in hints if "(fits:" in h]
    if fitting:
        lines.append("what would fit: " + "; ".join(fitting) + "; or raise max_memory")
    others = [h for h in hints if h not in fitting]
    if others:
        lines.append(("also tried" if fitting else "nothing tried fits") + ": " + "; ".join(others)
                     + ("" if fitting else "; raise max_memory"))
    if not hints:
        lines.append("what would fit: raise max_memory")
    return "\n".join(lines)


def _more_chunks(front: Assignment, options: CompileOptions, devices: Sequence[torch.device], schedule: Schedule,
                 distributed: bool, model: DeviceModel, batch: int) -> str | None:
    """Tell whether twice the micro-batches would fit on the same cut (each holds half the rows)."""
    m = front.micro * 2
    if m > batch or schedule.custom is not None:
        return None
    actions, rank_of, device_of, runtime = _setting(options, devices, schedule, distributed, m)
    plan = make_plan(front, dataclasses.replace(options, chunks=m), devices, schedule.name, rank_of, None)[0] \
        if front.cut is not None else None
    if plan is None:
        return None
    _, sim, fits = choose(_costs(front.gm, plan, options, model, batch / m), actions, rank_of, device_of,
                          model, float(options.max_memory or 0.0), name=schedule.name, runtime=runtime,
                          batch=batch, layout=_layout(plan, options, runtime))
    peak = max(mem.peak for mem in sim.devices.values())
    return f"chunks={m} ({'fits' if fits else 'still over'}: largest predicted peak {human(peak, 'B')})"


def _more_stages(front: Assignment, options: CompileOptions, model: DeviceModel, batch: int,
                 schedule: Schedule, distributed: bool) -> str | None:
    """Tell whether one more stage (a rank each, balanced by FLOPs) would fit; for a local pipe, across ranks."""
    n, m, gm = options.n_stages + 1, front.micro, front.gm
    if schedule.name not in PRODUCERS or n > len(passes.compute_nodes(gm)):
        return None
    cut = passes.partition(gm, n, balance_by="flops")
    more = dataclasses.replace(options, n_stages=n, checkpoint="never", max_memory=None)
    ranks = list(range(n))
    plan = make_plan(Assignment(gm, cut, m, "flops"), more, [torch.device("cpu")] * n, schedule.name, ranks, None)[0]
    _, sim, fits = choose(_costs(gm, plan, options, model, batch / m), PRODUCERS[schedule.name](n, m), ranks,
                                 ranks, model, float(options.max_memory or 0.0), name=schedule.name,
                                 runtime="distributed", batch=batch, layout=_layout(plan, more, "distributed"))
    peak = max(mem.peak for mem in sim.devices.values())
    world = n * options.dp * options.tp
    needs = (f", {world} ranks at data_parallel={options.dp}"
             + (f", tensor_parallel={options.tp}" if options.tp > 1 else "") if options.dp * options.tp > 1 else "")
    # a local pipe's stages share its devices' memory: more of them fit only on ranks of their own
    where = f"n_stages={n}, a rank each{needs}" if distributed else \
        f"{n} stages on {n * options.dp * options.tp} ranks (runtime='distributed'{needs})"
    return f"{where} ({'fits' if fits else 'still over'}: largest predicted peak {human(peak, 'B')})"
