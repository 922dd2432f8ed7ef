"""Build the runtime of a plan: place parameters, make the stage calls, start the runtime.

    one process   every stage's parameters on its device ─▶ StageCall per stage ─▶ LocalRuntime
    one per rank  this rank's stage on its device, tied tensors synced ─▶ StageCall ─▶ DistributedRuntime

Tensors on ``meta`` are materialized first, each on the device of the stage that owns it (in
the distributed build, only this rank's), and filled from ``weights=`` or by ``init=``
(:mod:`fxpipe.materialize`). A tensor no stage reads belongs to stage 0. After a distributed
build the model keeps only this rank's tensors; the others become ``meta`` again.

A stage whose schedule has weight-gradient steps (``W``) runs a copy of its GraphModule
whose linears defer their weight gradients (:mod:`fxpipe.runtime.wgrad`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from fxpipe.errors import PeerFailure
from fxpipe.materialize import fill, release
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.actionlist import Action
from fxpipe.runtime.batchnorm import defer_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.distributed import DistributedRuntime, tied_groups
from fxpipe.runtime.local import LocalRuntime
from fxpipe.runtime.placement import move_owned, named_tensors, ownership, stage_callable
from fxpipe.runtime.schedule import actions_for, deferring
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stagecall import StageCall
from fxpipe.runtime.wgrad import defer_weight_grads
from fxpipe.weights import open_weights

__all__ = ["Materials", "build_local", "build_distributed"]


@dataclass
class Materials:
    """What fills the model's tensors: ``weights=``, ``init=`` and ``seed=``."""

    weights: Any = None
    init: Callable[[nn.Module], Any] | None = None
    seed: int = 0

    def needed(self, model: nn.Module) -> bool:
        """Tell whether anything is to fill: weights were given or a tensor is on meta."""
        return self.weights is not None or any(t.is_meta for _, t in named_tensors(model))

    def fill(self, model: nn.Module, placement: dict[int, torch.device]) -> None:
        """Open the weights, materialize and fill the placed tensors, close the weights."""
        source = None if self.weights is None else open_weights(self.weights)
        try:
            fill(model, placement, source=source, init=self.init, seed=self.seed)
        finally:
            if source is not None:
                source.close()


def _unread(model: nn.Module, stages: Sequence[torch.fx.GraphModule]) -> set[int]:
    """Return the ids of the model's tensors that no stage reads (they belong to stage 0)."""
    read = {id(t) for st in stages for _, t in named_tensors(st)}
    return {id(t) for _, t in named_tensors(model) if id(t) not in read}


def _runnable(gm: torch.fx.GraphModule, j: int, plan: PipelinePlan,
              custom: list[list[Action]] | None) -> torch.fx.GraphModule:
    """Return the module stage ``j`` runs: its linears defer weight gradients if its schedule has W."""
    defer = deferring(actions_for(plan.schedule, custom, plan.n_stages, plan.chunks))
    return defer_weight_grads(gm) if j in defer else gm


def build_local(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                custom: list[list[Action]] | None, deferred_batch_norm: bool,
                materials: Materials | None = None) -> LocalRuntime:
    """Move every stage's tensors to its device and return the one-process runtime."""
    own = ownership(stages, devices)
    if materials is not None and materials.needed(model):
        placement = {key: devices[j] for key, j in own.owner.items()}
        placement.update({key: devices[0] for key in _unread(model, stages)})
        materials.fill(model, placement)
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
                      deferred_batch_norm: bool, materials: Materials | None = None
                      ) -> tuple[DistributedRuntime, set[int]]:
    """Keep this rank's stage on its device, sync tied tensors, and return this rank's runtime.

    Also return the ids of the tensors this rank keeps: its stage's, and on rank 0 those no
    stage reads; every other tensor of the model is made ``meta`` (freed) on this rank.
    """
    unread = _unread(model, stages) if rank == 0 else set()
    if materials is not None and materials.needed(model):
        mine = {id(t) for _, t in named_tensors(stages[rank])} | unread
        error: BaseException | None = None
        try:
            materials.fill(model, {key: device for key in mine})
        except Exception as exc:  # noqa: BLE001 - every rank hears of it before any raises
            error = exc
        _agree(link, rank, plan.n_stages, error)
    move_owned([model, gm, *stages], ownership(stages[rank:rank + 1], [device]), [device])
    tied = tied_groups(list(stages), rank, timeout)
    runnable = _runnable(stages[rank], rank, plan, custom)
    call = StageCall(rank, runnable, runnable, device, rank == plan.n_stages - 1)
    engine = DistributedRuntime(plan, gm, call, link, CallSignature(gm), tied, custom)
    if deferred_batch_norm:
        engine.deferred = defer_batch_norm({id(m): m for m in stages[rank].modules()}.values())
    keep = {id(t) for _, t in named_tensors(stages[rank])} | unread  # after the move: moved buffers are new
    release(model, keep)
    return engine, keep


def _agree(link: Comm, rank: int, n: int, error: BaseException | None) -> None:
    """Tell every rank whether this one materialized its stage; raise if any failed."""
    mine = None if error is None else f"rank {rank} (stage {rank}) could not materialize its tensors: {error}"
    for r in range(n):
        if r != rank:
            link.send_object(mine, r)
    theirs = [(r, link.recv_object(r, "waiting for the other ranks' weights")) for r in range(n) if r != rank]
    link.flush()
    if error is not None:
        raise error
    failed = [(r, m) for r, m in theirs if m is not None]
    if failed:
        raise PeerFailure(f"rank {rank} stopped because {failed[0][1]}")


