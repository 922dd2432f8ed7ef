"""Build the runtime of a plan: place parameters, make the stage calls, start the runtime.

    one process   every stage's parameters on its device ─▶ StageCall per stage ─▶ LocalRuntime
    across ranks  this rank's stages on its device, tied tensors synced ─▶ StageCalls ─▶ DistributedRuntime

A stage whose schedule has weight-gradient steps (``W``) runs a copy of its GraphModule
whose linears defer their weight gradients (:mod:`fxpipe.runtime.wgrad`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
from torch import nn

from fxpipe.plan import PipelinePlan
from fxpipe.runtime.batchnorm import defer_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.distributed import DistributedRuntime
from fxpipe.runtime.local import LocalRuntime
from fxpipe.runtime.placement import move_owned, ownership, stage_callable
from fxpipe.runtime.dataparallel import GradSync
from fxpipe.runtime.procgroup import Layout, tied_groups
from fxpipe.runtime.schedule import Schedule
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stagecall import StageCall
from fxpipe.runtime.wgrad import defer_weight_grads

__all__ = ["build_local", "build_distributed"]


def _runnable(gm: torch.fx.GraphModule, j: int, defer: set[int]) -> torch.fx.GraphModule:
    """Return the module stage ``j`` runs: its linears defer weight gradients if its schedule has W."""
    return defer_weight_grads(gm) if j in defer else gm


def build_local(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                schedule: Schedule, deferred_batch_norm: bool) -> LocalRuntime:
    """Move every stage's tensors to its device and return the one-process runtime."""
    own = ownership(stages, devices)
    move_owned([model, gm, *stages], own, devices)
    defer = schedule.deferring(plan.chunks)
    runnables = [_runnable(st, j, defer) for j, st in enumerate(stages)]
    n = plan.n_stages
    calls = [StageCall(j, stage_callable(r, own.foreign[j], devices[j]), r, devices[j], j == n - 1)
             for j, r in enumerate(runnables)]
    engine = LocalRuntime(plan, calls, CallSignature(gm), schedule)
    if deferred_batch_norm:
        engine.deferred = defer_batch_norm({id(m): m for st in stages for m in st.modules()}.values())
    return engine


def build_distributed(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                      stages: Sequence[torch.fx.GraphModule], layout: Layout, link: Comm, timeout: float,
                      schedule: Schedule, deferred_batch_norm: bool, shard: bool = False) -> DistributedRuntime:
    """Keep this rank's stages on its device, sync tied tensors, wrap them for data parallel; return the runtime."""
    device, mine = layout.device, schedule.stages_of(layout.rank)
    held = [stages[j] for j in mine]
    move_owned([model, gm, *stages], ownership(held, [device] * len(held)), [device] * len(held))
    tied = tied_groups(stages, schedule.ranks, layout, timeout)
    if layout.dp > 1:
        _refuse_shared_on_one_rank(held, mine)
    defer = schedule.deferring(plan.chunks)
    n = plan.n_stages
    calls = [StageCall(j, r, r, device, j == n - 1) for j in mine for r in [_runnable(stages[j], j, defer)]]
    engine = DistributedRuntime(plan, gm, layout, calls, link, CallSignature(gm), tied, schedule)
    if layout.dp > 1:  # after the tied tensors are equal: DDP and FSDP2 start from these
        engine.grad_sync = GradSync({c.index: c.fn for c in calls}, layout, shard,
                                    share_with=[model, gm, *stages, *(c.fn for c in calls)])
        swapped = engine.grad_sync.swapped  # tied parameters FSDP2 sharded: sum the shards' gradients
        engine.tied = [(g, [swapped.get(id(p), p) for p in ps], first) for g, ps, first in tied]
    if deferred_batch_norm:
        engine.deferred = defer_batch_norm({id(m): m for st in held for m in st.modules()}.values())
    return engine


def _refuse_shared_on_one_rank(held: Sequence[torch.fx.GraphModule], mine: Sequence[int]) -> None:
    """Refuse a tensor shared by two stages of one rank under data parallel (each stage reduces its own)."""
    seen: dict[int, int] = {}
    for j, st in zip(mine, held):
        for name, p in st.named_parameters():
            if seen.setdefault(id(p), j) != j:
                raise ValueError(f"parameter '{name}' is used by stages {seen[id(p)]} and {j}, which run on one "
                                 "rank; with data_parallel > 1 each stage reduces its own gradients, so a tensor "
                                 "cannot be shared between two stages of a rank: untie it, or place those stages "
                                 "on different ranks (another schedule or split)")
