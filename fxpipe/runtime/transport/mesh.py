"""Where a process sits in a distributed pipeline: the ``(dp, pp, tp)`` grid of ranks and its groups.

    global rank = (replica * pp + pipeline rank) * tp + tp index          tp innermost: neighbours

    dp=2, pp=2, tp=2 (8 ranks)     pipeline messages: between equal tp indices of one replica
      replica 0   stage ranks  [0 1] ─▶ [2 3]        (0 ─▶ 2, 1 ─▶ 3: a pipeline per (replica, tp index))
      replica 1                [4 5] ─▶ [6 7]        TP collectives: inside [0 1], [2 3], ...
                                                     gradient sync (dp): between 0 and 4, 1 and 5, ...

Without tensor parallelism the grid is ``(dp, pp)`` as before (a ``DeviceMesh`` with dims
``("dp", "pp")`` when there are replicas); with it, a 3-D ``DeviceMesh`` with dims ``("dp", "pp",
"tp")``, made here or given as ``mesh=``. A world that cannot hold the layout is refused naming it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxpipe.runtime.transport.together import together

__all__ = ["Layout", "check_launched_world", "check_world", "init_distributed", "join_default_group", "launched_world",
           "setup_distributed"]

log = logging.getLogger(__name__)


@dataclass
class Layout:
    """Where this process sits: its place in a pipeline, its replica and tp index, the groups it talks over.

    Stages talk point to point inside their pipeline (``pp_group``: the ranks of one replica and
    one tp index); gradients are reduced over the ranks holding the same stages and tp index
    (``dp_group``); a stage's TP collectives run over ``tp_group`` (``tp_mesh`` for DTensors).
    """

    rank: int  # pipeline rank: which stages this process holds
    replica: int  # which data-parallel replica
    pp: int  # ranks per pipeline
    dp: int  # replicas
    device: torch.device
    pp_group: Any
    global_ranks: list[int]  # pipeline rank -> global rank, in this pipeline
    mesh: DeviceMesh | None = None  # ("dp", "pp") with replicas, ("dp", "pp", "tp") with tensor parallelism
    dp_group: Any = None
    tp: int = 1  # ranks each stage is split over
    tp_index: int = 0
    tp_group: Any = None
    tp_mesh: DeviceMesh | None = None
    call_group: Any = None  # every rank, with tensor parallelism: each call's agreement (samecall)

    def pipelines(self) -> list[list[int]]:
        """Return every pipeline's global ranks (replica-major, then tp index), the same on every rank."""
        if self.mesh is None:
            return [list(self.global_ranks)]
        grid = self.mesh.mesh.tolist()
        if self.mesh.ndim == 2:
            return grid
        return [[grid[d][p][k] for p in range(self.pp)] for d in range(self.dp) for k in range(self.tp)]

    @property
    def row(self) -> int:
        """Return the index of this process's pipeline in :meth:`pipelines`."""
        return self.replica * self.tp + self.tp_index


def setup_distributed(n_stages: int, timeout: float, stages_per_rank: int = 1, data_parallel: int = 1,
                      mesh: DeviceMesh | None = None, tensor_parallel: int = 1) -> Layout:
    """Join (or start) the default process group; return where this process sits (:class:`Layout`)."""
    pp = n_stages // stages_per_rank
    if not dist.is_available():
        raise ValueError("runtime='distributed' needs torch.distributed, which this PyTorch build lacks")
    if mesh is not None:
        data_parallel, tensor_parallel = _check_mesh(mesh, pp, n_stages, stages_per_rank, tensor_parallel)
    join_default_group(timeout, pp * data_parallel * tensor_parallel)
    world, me = dist.get_world_size(), dist.get_rank()
    check_world(world, n_stages, stages_per_rank, data_parallel, tensor_parallel)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    made = mesh is None  # a mesh fxpipe makes gets timeout= on its groups; a user's keeps its own
    if mesh is None and tensor_parallel > 1:
        mesh = init_device_mesh(device.type, (data_parallel, pp, tensor_parallel), mesh_dim_names=("dp", "pp", "tp"))
    elif mesh is None and data_parallel > 1:
        mesh = init_device_mesh(device.type, (data_parallel, pp), mesh_dim_names=("dp", "pp"))
    layout = Layout(rank=0, replica=0, pp=pp, dp=data_parallel, device=device, pp_group=None,
                    global_ranks=list(range(pp)), mesh=mesh, tp=tensor_parallel)
    rows = layout.pipelines()
    layout.global_ranks = next(row for row in rows if me in row)
    layout.rank = layout.global_ranks.index(me)
    k = rows.index(layout.global_ranks)
    layout.replica, layout.tp_index = divmod(k, tensor_parallel)
    groups = [dist.new_group(row, timeout=timedelta(seconds=timeout), backend=backend) for row in rows]
    layout.pp_group = groups[k]
    if mesh is not None:
        layout.dp_group = mesh.get_group("dp")
        if made:
            bound_waits(layout.dp_group, timeout)
    if tensor_parallel > 1:
        assert mesh is not None
        layout.tp_mesh = mesh["tp"]
        layout.tp_group = mesh.get_group("tp")
        if made:
            bound_waits(layout.tp_group, timeout)
        layout.call_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout), backend=backend)
    return layout


def join_default_group(timeout: float, want: Any = None) -> None:
    """Join the default process group from torchrun's environment, unless joined; refuse without one.

    ``want``: the processes the layout needs, named in the refusal's launch line.
    """
    if not dist.is_available():
        raise ValueError("runtime='distributed' needs torch.distributed, which this PyTorch build lacks")
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"runtime='distributed' needs a process group: launch with "
                         f"`torchrun --nproc-per-node {want if isinstance(want, int) else 'N'} script.py` "
                         f"(missing {missing}) or call fxpipe.init_distributed() first")
    init_distributed(timeout)


def bound_waits(group: Any, timeout: float) -> None:
    """Give a device mesh's group ``timeout=`` seconds per collective (DDP's and FSDP's reductions wait on it).

    ``init_device_mesh`` makes its groups with torch's default timeout (30 minutes on gloo, 10 on
    NCCL): a replica whose peer failed would wait that long in its gradient reduction.
    """
    try:
        if hasattr(dist, "set_timeout"):  # torch >= 2.14 (where _set_pg_timeout warns it is deprecated)
            dist.set_timeout(timedelta(seconds=timeout), group)
        else:
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timedelta(seconds=timeout), group)
    except Exception as exc:  # noqa: BLE001 - a torch without it: the mesh keeps torch's default timeout
        log.info("the device mesh's groups keep torch's default timeout: %s: %s", type(exc).__name__, exc)


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
    with together("fxpipe.compile (joining the process group)",
                  int(os.environ.get("RANK", "0"))):
        _join(backend, wait)


def _join(backend: str, wait: timedelta) -> None:
    """Initialize the default process group, each restart round under a store prefix of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=wait)
        round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"fxpipe/round{round_}/default_pg", store),
                                rank=rank, world_size=world, timeout=wait)
    else:  # rank 0 hosts a new store each time the job starts
        dist.init_process_group(backend, timeout=wait)


def _check_mesh(mesh: DeviceMesh, pp: int, n_stages: int, stages_per_rank: int, tp: int) -> tuple[int, int]:
    """Refuse a ``mesh=`` that does not fit the stages (or ``tensor_parallel=``); return its dp and tp sizes."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp", "pp"), ("dp", "pp", "tp")):
        raise ValueError(f"mesh= has dims {mesh.mesh_dim_names}; give a DeviceMesh with dims ('dp', 'pp'), or "
                         "('dp', 'pp', 'tp') with tensor parallelism (tp innermost), e.g. "
                         "init_device_mesh('cuda', (2, 4, 8), mesh_dim_names=('dp', 'pp', 'tp'))")
    if mesh.size(1) != pp:
        raise ValueError(f"mesh= has {mesh.size(1)} ranks along 'pp' but {n_stages} stages x "
                         f"{stages_per_rank} per rank need {pp}")
    along = mesh.size(2) if len(names) == 3 else 1
    if tp not in (1, along):
        raise ValueError(f"mesh= has {along} ranks along 'tp' but tensor_parallel={tp}; pass one of them")
    return mesh.size(0), along


def check_world(world: int | None, n_stages: int, stages_per_rank: int = 1, data_parallel: int = 1,
                tensor_parallel: int = 1) -> None:
    """Refuse a world of ``world`` processes that cannot hold the layout (None: not known yet)."""
    pp = n_stages // stages_per_rank
    want = pp * data_parallel * tensor_parallel
    if world is None or world == want:
        return
    per = "one stage runs per rank" if stages_per_rank == 1 else f"{stages_per_rank} stages run per rank"
    if data_parallel == 1 and tensor_parallel == 1:
        several = (f", or keep n_stages={n_stages} with stages_per_rank={n_stages // world} ({n_stages // world} "
                   "stages on each rank: interleaved, zbv, or a schedule of your own whose lines hold several stages)"
                   if stages_per_rank == 1 and n_stages % world == 0 and n_stages > world else "")
        raise ValueError(f"n_stages={n_stages} but {world} ranks are running; {per}, so launch with "
                         f"--nproc-per-node {want} (or compile with n_stages={world * stages_per_rank}{several})")
    if tensor_parallel == 1:
        other = (f"pass data_parallel={world // pp}" if world % pp == 0 else
                 f"launch a multiple of {pp} processes")
        raise ValueError(f"world {world} cannot hold {pp} pipeline ranks x {data_parallel} replicas ({per}); "
                         f"launch {want} processes, or {other}")
    fits = [t for t in range(1, world // pp + 1) if world % (pp * t) == 0]
    if world % (pp * tensor_parallel) == 0:
        other = f"pass data_parallel={world // (pp * tensor_parallel)}"
    elif fits:  # tensor_parallel=3 on 4 ranks: the sizes that do fit
        other = (f"pass a tensor_parallel that {world} ranks hold with {pp} pipeline ranks ("
                 f"{', '.join(map(str, fits))}; data_parallel= the ranks left over)")
    else:
        other = f"compile with n_stages that {world} ranks hold"
    raise ValueError(f"world {world} cannot hold {pp} pipeline ranks x {data_parallel} replicas x "
                     f"{tensor_parallel} tensor-parallel ranks ({per}); launch {want} processes (or a multiple of "
                     f"{pp * tensor_parallel} with data_parallel=), or {other}")


def check_launched_world(n_stages: int, stages_per_rank: Any, data_parallel: Any, mesh: Any,
                         tensor_parallel: Any = 1) -> None:
    """Refuse early a launched world that cannot hold the layout, before the schedule's own needs.

    A wrong process count is the first thing to fix; arguments that are themselves wrong
    (checked later, each with its own message) and a layout given by ``mesh=`` are left alone.
    """
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
               for v in (stages_per_rank, data_parallel, tensor_parallel))
    if mesh is not None or not ints or n_stages % stages_per_rank:
        return
    check_world(launched_world(), n_stages, stages_per_rank, data_parallel, tensor_parallel)


def launched_world() -> int | None:
    """Return the number of processes launched (the process group's, or torchrun's WORLD_SIZE); None if unknown."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    size = os.environ.get("WORLD_SIZE", "")
    return int(size) if size.isdigit() else None
