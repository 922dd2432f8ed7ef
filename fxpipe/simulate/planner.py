"""Choose a pipeline configuration by simulating every candidate: stages, chunks, schedule, checkpointing.

    model ─trace, annotate, retain (once)─▶ per stage count: the FLOP-balanced cut
          ─▶ per micro-batch size: stage costs (device model, or measured here)
          ─▶ per schedule x checkpoint mode: one simulated step (fxpipe.simulate.simulation.run);
             and "auto": a policy per stage, the least recomputation that fits the budget
             (fxpipe.simulate.fit.choose), when that mixes modes
          ─▶ ranked by throughput; over the memory budget: rejected

Stage counts are the divisors of the number of ranks; each stage gets a rank, the rest idle
(data-parallel replicas of the pipeline, which would use them, are not searched yet; that
search goes here). Chunks are powers of two up to the mini-batch (at most 64).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe import passes
from fxpipe.errors import SearchSpaceError
from fxpipe.frontend.tracing import trace
from fxpipe.options import AUTO, POLICIES, SINGLE_STAGE_SCHEDULES, CompileOptions, cut_mode
from fxpipe.passes.retain import retain
from fxpipe.plan.assign import Assignment, annotate_graph
from fxpipe.plan.batches import micro_sizes
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.plan.stages import make_plan
from fxpipe.runtime.schedules.builtin import PRODUCERS
from fxpipe.simulate.devices import DeviceModel, device_model
from fxpipe.simulate.eventsim import placement_map
from fxpipe.simulate.fit import choose
from fxpipe.simulate.measure import measure_nodes
from fxpipe.simulate.simulation import Simulation, run
from fxpipe.simulate.stagecost import example_rows, graph_costs

__all__ = ["CHECKPOINTS", "Candidate", "Search", "search"]

log = logging.getLogger(__name__)

CHECKPOINTS = (*POLICIES, AUTO)  # searched from the least recomputation; "auto": a policy per stage


@dataclass
class Candidate:
    """One configuration and its simulated step."""

    stages: int
    chunks: int
    schedule: str
    checkpoint: str  # a mode, or "auto": the policies per stage
    sim: Simulation
    fits: bool  # every device's peak memory within the budget

    @property
    def policies(self) -> list[str]:
        """Return each stage's policy."""
        return list(self.sim.policies)

    @property
    def setting(self) -> str | list[str]:
        """Return what ``fxpipe.compile(checkpoint=...)`` takes for this candidate."""
        return self.checkpoint if self.checkpoint != AUTO else self.policies

    @property
    def peaks(self) -> list[float]:
        """Return each device's predicted peak memory in bytes."""
        return [m.peak for _, m in sorted(self.sim.devices.items())]


@dataclass
class Search:
    """The candidates ranked by predicted throughput (those over the budget after), and how to rebuild one."""

    ranked: list[Candidate]
    rejected: list[Candidate]
    gm: torch.fx.GraphModule
    device: DeviceModel
    batch: int
    memory: float

    @property
    def best(self) -> Candidate | None:
        """Return the fastest configuration that fits, or None."""
        return self.ranked[0] if self.ranked else None

    def plan(self, c: Candidate) -> PipelinePlan:
        """Return the :class:`PipelinePlan` of candidate ``c``, ready to save for ``fxpipe.compile(plan=...)``."""
        micro = len(micro_sizes(example_rows(self.gm) or c.chunks, c.chunks))
        plan = _cut(self.gm, c.stages, self.device, micro, c.chunks, c.setting)
        plan.schedule = c.schedule
        for s, policy, result in zip(plan.stages, c.policies, c.sim.stages):
            s.checkpoint, s.peak = policy, int(result.memory.peak)
        return plan


def _devices(device: DeviceModel, n: int) -> list[str]:
    """Return the device names a plan of ``n`` ranks records."""
    kind = "cpu" if device.name == "cpu" else "cuda"
    return [f"{kind}:{j}" for j in range(n)]


def _cut(gm: torch.fx.GraphModule, n: int, device: DeviceModel, micro: int = 1, chunks: int = 1,
         checkpoint: str | list[str] = "except_last") -> PipelinePlan:
    """Cut ``gm`` into ``n`` FLOP-balanced stages (communication weighed) and return their plan."""
    devices = _devices(device, n)
    comm = passes.comm_weights(devices, "flops")
    if device.name != "cpu":  # a crossing byte at this device model's FLOP rate over its link, not passes' PCIe
        comm = [device.peak_flops["float32"] / device.link_bandwidth for _ in comm]
    cut = passes.partition(gm, n, balance_by="flops", comm=comm, checkpoint=cut_mode(checkpoint),
                           micro_batches=micro)
    options = CompileOptions(n, chunks=chunks, checkpoint=checkpoint, balance_by="flops")
    return make_plan(Assignment(gm, cut, micro, "flops"), options, devices, "gpipe", list(range(n)), None)[0]


def prepare(model: nn.Module, args: tuple, kwargs: dict | None = None,
            leaf_modules: Sequence[Any] = (), tracer: Any = "fx", export_dims: str = "auto") -> torch.fx.GraphModule:
    """Trace ``model`` (with ``tracer``, as fxpipe.compile's) and annotate its graph with FLOPs, bytes and what backward keeps."""
    gm = trace(model, leaf_modules=leaf_modules, tracer=tracer, example_inputs=args, example_kwargs=kwargs or {},
               export_dims=export_dims)
    annotate_graph(gm, args, kwargs or {})
    return retain(gm)


def search(model: nn.Module | torch.fx.GraphModule, args: tuple, *, ranks: int,
           device: str | DeviceModel = "cpu", memory: float | None = None, batch: int | None = None,
           kwargs: dict | None = None, stages: Sequence[int] | None = None, chunks: Sequence[int] | None = None,
           schedules: Sequence[str] = SINGLE_STAGE_SCHEDULES, checkpoints: Sequence[str] = CHECKPOINTS,
           optimizer: str = "adam", dtype: torch.dtype | None = None, measure: bool = False,
           leaf_modules: Sequence[Any] = (), tracer: Any = "fx", export_dims: str = "auto") -> Search:
    """Simulate every configuration of ``model`` on ``ranks`` devices; return them ranked.

    ``memory`` is the budget per device in bytes (default: the device model's memory);
    ``batch`` the mini-batch in rows (default: the example batch). ``checkpoints`` are the
    modes tried for every stage alike, and ``"auto"``: each stage's least recomputation that fits. ``measure=True`` times
    every node on this machine for each micro-batch size instead of using FLOP rates.
    """
    model_ = device_model(device)
    gm = model if isinstance(model, torch.fx.GraphModule) and "fxpipe.retains" in next(
        iter(model.graph.nodes)).meta else prepare(model, args, kwargs, leaf_modules, tracer, export_dims)
    base = example_rows(gm) or 1
    batch = batch or base
    budget = memory if memory is not None else model_.memory
    stage_counts = list(stages) if stages else [d for d in range(1, ranks + 1) if ranks % d == 0]
    chunk_counts = list(chunks) if chunks else [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= batch]
    blocks = len(passes.compute_nodes(gm))
    _check_space(stage_counts, chunk_counts, ranks, blocks, batch)
    measured: dict[int, dict[str, tuple[float, float]]] = {}
    ranked: list[Candidate] = []
    rejected: list[Candidate] = []
    for n in stage_counts:
        if n > blocks:
            continue
        plan = _cut(gm, n, model_)
        rank_of = placement_map(None, n, None)
        for m in chunk_counts:
            rows = batch / m
            if measure and round(rows) not in measured:
                measured[round(rows)] = measure_nodes(gm, max(round(rows), 1), args)
            costs = graph_costs(gm, plan, model_, rows, dtype, measured.get(round(rows)))
            for schedule in schedules:
                actions = PRODUCERS[schedule](n, m)
                for ckpt in checkpoints:
                    if m == 1 and ckpt == "except_last" and "never" in checkpoints:
                        continue  # the same step: the one micro-batch is the last
                    if ckpt == AUTO:
                        policies = choose(costs, actions, rank_of, rank_of, model_, budget, name=schedule,
                                          runtime="distributed", batch=batch, optimizer=optimizer)[0]
                        if len(set(policies)) == 1 and policies[0] in checkpoints:
                            continue  # one mode for every stage: searched as that mode
                    sim = run(costs, actions, rank_of, rank_of, model_, name=schedule,
                              checkpoint=policies if ckpt == AUTO else ckpt,
                              runtime="distributed", batch=batch, optimizer=optimizer)
                    fits = all(mem.peak <= budget for mem in sim.devices.values())
                    (ranked if fits else rejected).append(Candidate(n, m, schedule, ckpt, sim, fits))
    order = {p: k for k, p in enumerate(POLICIES)}
    key = lambda c: (-c.sim.throughput, max(c.peaks), c.stages, sum(order.get(p, 4) for p in c.policies))
    ranked.sort(key=key)
    rejected.sort(key=key)
    return Search(ranked, rejected, gm, model_, batch, budget)


def _check_space(stage_counts: list[int], chunk_counts: list[int], ranks: int, blocks: int, batch: int) -> None:
    """Refuse stage and chunk counts that leave nothing to simulate, naming what would be searched."""
    over = [n for n in stage_counts if n > ranks]
    if over:
        raise SearchSpaceError(f"stages={over[0]} on {ranks} ranks: this search places one stage per rank; give "
                               f"stage counts up to {ranks}, or search several stages per rank with the cluster "
                               "search (fxpipe.simulate.cluster_search, fxpipe plan --gpus)")
    if not any(n <= blocks for n in stage_counts):
        raise SearchSpaceError(f"stages={stage_counts}: the model has {blocks} cuttable blocks, so at most {blocks} "
                               "stages; give fewer stages, or list fewer leaf modules so the model cuts finer")
    big = [m for m in chunk_counts if m > batch]
    if big:
        raise SearchSpaceError(f"chunks={big[0]} with a global batch of {batch} rows: a micro-batch holds at least "
                               f"one row; give chunks up to {batch}, or a larger global batch")
