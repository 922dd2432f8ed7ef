"""Under tensor parallelism, agree on every call before it runs: the same call, state and count on every rank.

Without tensor parallelism a pipeline's own messages refuse a call one rank makes differently
(the first rank's layout, the loss rank's word). With it, each stage's ranks meet in
collectives of their own, over every pipeline of the replica::

    pipelines (one per tp index)     0 ─▶ 2       1 ─▶ 3
    stage groups (collectives)      [0 1]        [2 3]

    rank 3: pipe(x)   ranks 0, 1, 2: pipe.step
      pipeline 1 refuses (rank 1 reads rank 3's word)  ─▶  rank 0 runs on, and meets rank 1
      in the first stage's collectives, which rank 1 left: it waited out timeout=

So every call begins with one all-reduce over every rank of the pipe, of three integers: a
digest of the call (``pipe.step`` or ``pipe(x)``, training mode, autocast, loss reduction,
bounded above and below) and whether this rank refused its own arguments. Only when they
differ are the ranks' calls gathered, to name the one that differs; every rank then raises
the same refusal before anything runs, and the pipe steps on.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import PipelineInputError
from fxpipe.runtime.transport import callstate
from fxpipe.runtime.transport.comm import on_every_rank
from fxpipe.runtime.transport.steplayout import call_name, rebuilt

__all__ = ["agree_on_call"]


def agree_on_call(runtime: Any, stepping: bool, training: bool, refusal: BaseException | None = None) -> None:
    """Refuse, on every rank, a call (``stepping`` or not) that another rank of the pipe makes differently.

    ``refusal`` is this rank's refusal of its own arguments, which every rank raises then.
    Nothing without tensor parallelism (``layout.call_group`` is None).
    """
    group = runtime.layout.call_group
    if group is None:
        return
    state = callstate.state(training, runtime.reduction if stepping else "")
    digest = zlib.crc32(repr((stepping, state)).encode()) & 0x7FFFFFFF
    bounds = torch.tensor([digest, -digest, int(refusal is not None)], dtype=torch.int64,
                          device=runtime.device)  # NCCL: on the GPU
    work = dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group, async_op=True)
    runtime.comm.wait([work], "agreeing with every rank on this call (tensor parallelism)")
    if int(bounds[0]) == -int(bounds[1]) and not int(bounds[2]):
        return
    me = dist.get_rank()
    told = None if refusal is None else (type(refusal).__name__, f"rank {me}: {refusal}")
    calls: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(calls, (me, stepping, state, told), group=group)
    if refusal is not None:
        raise on_every_rank(refusal)
    raise on_every_rank(_refusal(calls))


def _refusal(calls: list[Any]) -> Exception:
    """Return the error naming the ranks whose call differs from most ranks' (or the refusal one made)."""
    for _, _, _, told in calls:
        if told is not None:
            return rebuilt(*told)
    kinds = [(c[1], c[2]) for c in calls]
    usual = max(kinds, key=kinds.count)  # a tie: the lowest rank's
    ref = next(c for c in calls if (c[1], c[2]) == usual)
    odd = [c for c in calls if (c[1], c[2]) != usual]
    ranks = ", ".join(str(c[0]) for c in odd)
    if odd[0][1] != ref[1]:
        return PipelineInputError(
            f"rank {ranks} called {call_name(odd[0][1])} but rank {ref[0]} called {call_name(ref[1])}: every rank "
            "makes the same call, pipe.step(x, target=, loss_fn=) to train and pipe(x) to infer (the other ranks "
            "may pass None as inputs)")
    return PipelineInputError(callstate.mismatch(odd[0][0], odd[0][2], ref[0], ref[2], role="")
                              or f"rank {ranks}'s call differs from rank {ref[0]}'s: make the same call on every rank")
