"""Build the runtime of a plan: place parameters, make the stage calls, start the runtime.

    one process   every stage's parameters on its device ─▶ StageCall per stage ─▶ LocalRuntime
    one per rank  this rank's stage on its device, tied tensors synced ─▶ StageCall ─▶ DistributedRuntime

A stage whose schedule has weight-gradient steps (``W``) runs a copy of its GraphModule
whose linears defer their weight gradients (:mod:`fxpipe.runtime.wgrad`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
from torch import nn

from fxpipe.plan import PipelinePlan
from fxpipe.runtime.actionlist import Action
from fxpipe.runtime.batchnorm import defer_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.distributed import DistributedRuntime, tied_groups
from fxpipe.runtime.local import LocalRuntime
from fxpipe.runtime.placement import move_owned, ownership, stage_callable
from fxpipe.runtime.schedule import actions_for, deferring
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stagecall import StageCall
from fxpipe.runtime.wgrad import defer_weight_grads

__all__ = ["build_local", "build_distributed"]


def _runnable(gm: torch.fx.GraphModule, j: int, plan: PipelinePlan,
              custom: list[list[Action]] | None) -> torch.fx.GraphModule:
    """Return the module stage ``j`` runs: its linears defer weight gradients if its schedule has W."""
    defer = deferring(actions_for(plan.schedule, custom, plan.n_stages, plan.chunks))
    return defer_weight_grads(gm) if j in defer else gm


def build_local(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                custom: list[list[Action]] | None, deferred_batch_norm: bool) -> LocalRuntime:
    """Move every stage's tensors to its device and return the one-process runtime."""
    own = ownership(stages, devices)
    move_owned([model, gm, *stages], own, devices)
    runnables = [_runnable(st, j, plan, custom) for j, st in enumerate(stages)]
    n = plan.n_stages
    calls = [StageCall(j, stage_callable(r, own.foreign[j], devices[j]), r, devices[j], j == n - 1)
             for j, r in enumerate(runnables)]
    engine = LocalRuntime(plan, calls, CallSignature(gm), custom)
    if deferred_batch_norm:
        engine.deferred = defer_batch_norm({id(m): m for st in stages for m in st.modules()}.values())
    return engine


def build_distributed(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                      stages: Sequence[torch.fx.GraphModule], rank: int, device: torch.device,
                      link: Comm, timeout: float, custom: list[list[Action]] | None,
                      deferred_batch_norm: bool) -> DistributedRuntime:
    """Keep this rank's stage on its device, sync tied tensors, and return this rank's runtime."""
    move_owned([model, gm, *stages], ownership(stages[rank:rank + 1], [device]), [device])
    tied = tied_groups(list(stages), rank, timeout)
    runnable = _runnable(stages[rank], rank, plan, custom)
    call = StageCall(rank, runnable, runnable, device, rank == plan.n_stages - 1)
    engine = DistributedRuntime(plan, gm, call, link, CallSignature(gm), tied, custom)
    if deferred_batch_norm:
        engine.deferred = defer_batch_norm({id(m): m for m in stages[rank].modules()}.values())
    return engine


