"""The process groups of a distributed pipeline: join them, agree on the plan, tie shared tensors.

Every rank traces and plans the whole model; :func:`agree_on_stages` makes them all use rank
0's cut. Parameters read by stages on several ranks (tied embeddings) live on each of those
ranks; :func:`tied_groups` makes them equal at the start and gives the group their
gradients are summed over after each step, like DeepSpeed's tied layers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxpipe import passes
from fxpipe.runtime.placement import named_tensors

__all__ = ["Layout", "Ties", "agree_on_stages", "check_launched_world", "check_world", "init_distributed",
           "reopen_pipeline", "setup_distributed", "tied_groups"]

log = logging.getLogger(__name__)


@dataclass
class Layout:
    """Where this process sits: its place in a pipeline, its replica, the groups it talks over.

    Ranks form a ``(dp, pp)`` grid (a :class:`~torch.distributed.device_mesh.DeviceMesh` with
    dims ``("dp", "pp")``): global rank ``replica * pp + rank`` runs pipeline rank ``rank`` of
    replica ``replica``. Stages talk point to point inside their pipeline (``pp_group``);
    gradients are reduced over the ranks holding the same stages (``dp_group``).
    """

    rank: int  # pipeline rank: which stages this process holds
    replica: int  # which data-parallel replica
    pp: int  # ranks per pipeline
    dp: int  # replicas
    device: torch.device
    pp_group: Any
    global_ranks: list[int]  # pipeline rank -> global rank, in this replica
    mesh: DeviceMesh | None = None  # ("dp", "pp"), when there are replicas
    dp_group: Any = None


def setup_distributed(n_stages: int, timeout: float, stages_per_rank: int = 1, data_parallel: int = 1,
                      mesh: DeviceMesh | None = None) -> Layout:
    """Join (or start) the default process group; return where this process sits (:class:`Layout`)."""
    pp = n_stages // stages_per_rank
    if not dist.is_available():
        raise ValueError("runtime='distributed' needs torch.distributed, which this PyTorch build lacks")
    if mesh is not None:
        if tuple(mesh.mesh_dim_names or ()) != ("dp", "pp"):
            raise ValueError(f"mesh= has dims {mesh.mesh_dim_names}; give a 2-D DeviceMesh with dims "
                             "('dp', 'pp'), e.g. init_device_mesh('cuda', (2, 4), mesh_dim_names=('dp', 'pp'))")
        if mesh.size(1) != pp:
            raise ValueError(f"mesh= has {mesh.size(1)} ranks along 'pp' but {n_stages} stages x "
                             f"{stages_per_rank} per rank need {pp}")
        data_parallel = mesh.size(0)
    want = pp * data_parallel
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"runtime='distributed' needs a process group: launch with "
                             f"`torchrun --nproc-per-node {want} script.py` (missing {missing}) "
                             "or call fxpipe.init_distributed() first")
        init_distributed(timeout)
    world, me = dist.get_world_size(), dist.get_rank()
    check_world(world, n_stages, stages_per_rank, data_parallel)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if data_parallel > 1 and mesh is None:
        mesh = init_device_mesh(device.type, (data_parallel, pp), mesh_dim_names=("dp", "pp"))
    grid = mesh.mesh.tolist() if mesh is not None else [list(range(pp))]
    replica = next(d for d, row in enumerate(grid) if me in row)
    groups = [dist.new_group(row, timeout=timedelta(seconds=timeout), backend=backend) for row in grid]
    return Layout(rank=grid[replica].index(me), replica=replica, pp=pp, dp=len(grid), device=device,
                  pp_group=groups[replica], global_ranks=grid[replica], mesh=mesh,
                  dp_group=mesh.get_group("dp") if mesh is not None else None)


def init_distributed(timeout: float = 300.0) -> None:
    """Join the job's default process group from torchrun's environment, safely across restarts.

    NCCL when this process has a GPU of its own (``LOCAL_RANK``), else gloo. Under torchrun the
    agent hosts one store for every restart round, and ``torch.distributed.init_process_group``
    keys the ranks' addresses in it the same way each round: a restarted rank can read the
    address of a process of the previous round and fail or hang connecting to it. Here each
    round's keys live under a prefix of its own (``TORCHELASTIC_RESTART_COUNT``).
    """
    if dist.is_initialized():
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() and local < torch.cuda.device_count() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    elif torch.cuda.is_available():
        log.warning("local rank %d has no GPU of its own (%d visible): running on CPU with gloo",
                    local, torch.cuda.device_count())
    wait = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=wait)
        round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"fxpipe/round{round_}/default_pg", store),
                                rank=rank, world_size=world, timeout=wait)
    else:  # rank 0 hosts a new store each time the job starts
        dist.init_process_group(backend, timeout=wait)


def check_world(world: int | None, n_stages: int, stages_per_rank: int = 1, data_parallel: int = 1) -> None:
    """Refuse a world of ``world`` processes that cannot hold the layout (None: not known yet)."""
    pp = n_stages // stages_per_rank
    want = pp * data_parallel
    if world is None or world == want:
        return
    per = "one stage runs per rank" if stages_per_rank == 1 else f"{stages_per_rank} stages run per rank"
    if data_parallel == 1:
        raise ValueError(f"n_stages={n_stages} but {world} ranks are running; {per}, so launch with "
                         f"--nproc-per-node {want} (or compile with n_stages={world * stages_per_rank})")
    raise ValueError(f"world {world} cannot hold {pp} pipeline ranks x {data_parallel} replicas ({per}); "
                     f"launch {want} processes, or pass data_parallel={world // pp if world % pp == 0 else '?'}")


def check_launched_world(n_stages: int, stages_per_rank: Any, data_parallel: Any, mesh: Any) -> None:
    """Refuse early a launched world that cannot hold the layout, before the schedule's own needs.

    A wrong process count is the first thing to fix; arguments that are themselves wrong
    (checked later, each with its own message) and a layout given by ``mesh=`` are left alone.
    """
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (stages_per_rank, data_parallel))
    if mesh is not None or not ints or n_stages % stages_per_rank:
        return
    if dist.is_available() and dist.is_initialized():
        world: int | None = dist.get_world_size()
    else:
        size = os.environ.get("WORLD_SIZE", "")
        world = int(size) if size.isdigit() else None
    check_world(world, n_stages, stages_per_rank, data_parallel)


def agree_on_stages(gm: torch.fx.GraphModule, n_stages: int) -> None:
    """Make every process use global rank 0's stage assignment (measured costs may differ by rank)."""
    mine = {n.name: n.meta["fxpipe.stage"] for n in passes.compute_nodes(gm)}
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    if box[0] != mine:
        log.info("rank %d adopts rank 0's stage assignment", dist.get_rank())
        passes.assign_by_name(gm, box[0], n_stages)


def tied_groups(stages: Sequence[torch.fx.GraphModule], rank_of: Sequence[int], layout: Layout,
                timeout: float) -> Ties:
    """Create a group per set of ranks sharing tensors; return this rank's ties (:class:`Ties`).

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
    for key, holding in holders.items():
        if len(holding) > 1:
            by_ranks.setdefault(tuple(sorted(holding)), []).append(tensors[key])
    ties = Ties(timeout=timeout)
    rows = layout.mesh.mesh.tolist() if layout.mesh is not None else [layout.global_ranks]
    for ranks in sorted(by_ranks):
        for row in rows:  # every process creates every replica's group, in the same order
            members = [row[r] for r in ranks]
            ties.members.append(members)
            group = dist.new_group(members, timeout=timedelta(seconds=timeout))
            if row is rows[layout.replica] and layout.rank in ranks:
                for t in by_ranks[ranks]:
                    dist.broadcast(t.data, src=members[0], group=group)
                ties.index.append(len(ties.members) - 1)
                ties.mine.append((group, [t for t in by_ranks[ranks] if isinstance(t, torch.nn.Parameter)],
                                  layout.rank == ranks[0]))
    return ties


@dataclass
class Ties:
    """This rank's tied tensors: per tie its (group, parameters, first) in ``mine``.

    ``first`` tells whether this rank is the tie's lowest, which counts the parameters once
    (in a gradient norm). ``members`` lists every tie group the processes created, in order,
    and ``index`` which of them each of ``mine`` is, so that :meth:`reopen` can create them
    anew the same way on every rank after a failed step.
    """

    timeout: float
    mine: list[tuple[Any, list, bool]] = field(default_factory=list)
    members: list[list[int]] = field(default_factory=list)
    index: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Drop this rank's tie groups, so that a peer waiting in a tie's reduction fails at once."""
        for group, _, _ in self.mine:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - closing after a failure: nothing more to do
                log.debug("closing a tie group: %s", exc)
        self.mine = [(None, params, first) for _, params, first in self.mine]

    def reopen(self) -> None:
        """Create every tie group anew (every rank, the same order) after a failed step."""
        groups = [dist.new_group(m, timeout=timedelta(seconds=self.timeout)) for m in self.members]
        self.mine = [(groups[k], params, first) for k, (_, params, first) in zip(self.index, self.mine)]


def reopen_pipeline(layout: Layout, timeout: float) -> Any:
    """Create this pipeline's group anew (every rank of the world, in the same order) and return it."""
    rows = layout.mesh.mesh.tolist() if layout.mesh is not None else [layout.global_ranks]
    backend = dist.get_backend()
    groups = [dist.new_group(row, timeout=timedelta(seconds=timeout), backend=backend) for row in rows]
    layout.pp_group = groups[layout.replica]
    return layout.pp_group
