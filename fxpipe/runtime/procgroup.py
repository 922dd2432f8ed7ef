"""The process groups of a distributed pipeline: join them, agree on the plan, tie shared tensors.

Every rank traces and plans the whole model; :func:`agree_on_stages` makes them all use rank
0's cut. Parameters read by stages on several ranks (tied embeddings) live on each of those
ranks; :func:`tied_groups` makes them equal at the start and gives the group their
gradients are summed over after each step, like DeepSpeed's tied layers.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx

from fxpipe import passes
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.placement import named_tensors

__all__ = ["setup_distributed", "agree_on_stages", "tied_groups"]

log = logging.getLogger(__name__)


def setup_distributed(n_stages: int, timeout: float, stages_per_rank: int = 1) -> tuple[int, torch.device, Any]:
    """Join (or start) the default process group; return this rank, its device, fxpipe's group."""
    want = n_stages // stages_per_rank
    if not dist.is_available():
        raise ValueError("runtime='distributed' needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"runtime='distributed' needs a process group: launch with "
                             f"`torchrun --nproc-per-node {want} script.py` (missing {missing}) "
                             "or call torch.distributed.init_process_group first")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != want:
        per = "one stage runs per rank" if stages_per_rank == 1 else f"{stages_per_rank} stages run per rank"
        raise ValueError(f"n_stages={n_stages} but {world} ranks are running; {per}, so launch with "
                         f"--nproc-per-node {want} (or compile with n_stages={world * stages_per_rank})")
    backend = dist.get_backend()
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout), backend=backend)
    return rank, device, group


def agree_on_stages(gm: torch.fx.GraphModule, n_stages: int, comm: Comm, world: int) -> None:
    """Make every rank use rank 0's stage assignment (measured costs may differ between ranks)."""
    mine = {n.name: n.meta["fxpipe.stage"] for n in passes.compute_nodes(gm)}
    if comm.rank == 0:
        for r in range(1, world):
            comm.send_object(mine, r)
        comm.flush()
        return
    theirs = comm.recv_object(0, "waiting for rank 0's stage assignment")
    if theirs != mine:
        log.info("rank %d adopts rank 0's stage assignment", comm.rank)
        passes.assign_by_name(gm, theirs, n_stages)


def tied_groups(stages: Sequence[torch.fx.GraphModule], rank_of: Sequence[int], rank: int,
                timeout: float) -> list[tuple[Any, list]]:
    """Create a group per set of ranks sharing tensors; return this rank's (group, tensors) pairs.

    ``rank_of`` gives each stage's rank. Every rank calls this with the same stages, so groups
    are created in the same order. The shared tensors are made equal to those of the lowest
    rank that holds them. Stages on one rank share a tensor as one object: nothing to sum.
    """
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for j, gm in enumerate(stages):
        for _, t in named_tensors(gm):
            if rank_of[j] not in holders.setdefault(id(t), []):
                holders[id(t)].append(rank_of[j])
                tensors[id(t)] = t
    by_ranks: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for key, ranks in holders.items():
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(sorted(ranks)), []).append(tensors[key])
    mine = []
    for ranks in sorted(by_ranks):
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout))
        if rank in ranks:
            for t in by_ranks[ranks]:
                dist.broadcast(t.data, src=ranks[0], group=group)
            mine.append((group, [t for t in by_ranks[ranks] if isinstance(t, torch.nn.Parameter)]))
    return mine
