"""``fxpipe.compile``: check the arguments, then front end, plan, and the runtime's build.

    model ─▶ front end (trace, annotate, cut) ─▶ stages + PipelinePlan ─▶ build (local | distributed) ─▶ Pipe
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe.frontend.tracing import check_tracer
from fxpipe.materialize.fill import check_init
from fxpipe.materialize.fillplan import tensor_table
from fxpipe.materialize.metatensors import refuse_meta_constants
from fxpipe.materialize.weights import check_weights
from fxpipe.passes.failure import PropagationError
from fxpipe.pipe import Pipe
from fxpipe.plan.assign import front_end
from fxpipe.plan.saved import PlanLike, load_plan
from fxpipe.plan.stages import make_plan, split_stages
from fxpipe.runtime.build import Materials, build_distributed, build_local
from fxpipe.runtime.placement import resolve_devices
from fxpipe.runtime.schedules.builtin import NAMES, resolve
from fxpipe.runtime.stage.recompute import CHECKPOINT_MODES
from fxpipe.runtime.transport.comm import Comm
from fxpipe.runtime.transport.procgroup import agree_on_stages, check_launched_world, setup_distributed

__all__ = ["BALANCE_BY", "CHECKPOINT_MODES", "SCHEDULES", "compile"]

log = logging.getLogger(__name__)

SCHEDULES = NAMES
BALANCE_BY = ("auto", "flops", "params", "memory", "time")


def compile(model: nn.Module, n_stages: int, *, example_inputs: Any = None,
            example_kwargs: dict[str, Any] | None = None, devices: Sequence[Any] | None = None,
            chunks: int = 1, checkpoint: str = "except_last", balance_by: str = "auto",
            split_points: Sequence[str] | None = None, max_memory: float | None = None,
            schedule: str | Sequence[Any] = "gpipe", leaf_modules: Iterable[type | str] = (),
            tracer: str | Callable[[nn.Module], torch.fx.GraphModule] = "fx",
            plan: PlanLike | None = None, runtime: str = "local", timeout: float = 300.0,
            deferred_batch_norm: bool = False, stages_per_rank: int = 1, data_parallel: int = 1,
            data_parallel_shard: bool = False, mesh: Any = None, weights: Any = None,
            init: Callable[[nn.Module], Any] | None = None, seed: int = 0,
            split_spec: dict[str, Any] | None = None) -> Pipe:
    """Split ``model`` into ``n_stages`` pipeline stages and return a :class:`Pipe` running them.

    ``model`` is an ``nn.Module`` (traced with :func:`fxpipe.trace`) or an already traced
    ``torch.fx.GraphModule``, used as is. ``example_inputs`` (and ``example_kwargs``) give
    shapes for the cost model; nothing real is computed with them. ``devices`` gives one
    device per stage. ``chunks`` is the number of micro-batches; ``checkpoint`` is
    ``"always"``, ``"except_last"`` or ``"never"``; ``balance_by`` picks the cost that stages
    balance (``"flops"``, ``"params"``, ``"memory"``, ``"time"`` measured on ``devices[0]``, or
    ``"auto"``: FLOPs with example inputs, else parameters); ``split_points`` names the
    modules or nodes where stages begin instead. Without them, the model's
    ``torch.distributed.pipelining`` markers say where stages begin: ``pipe_split()`` calls in
    its forward and ``split_spec={fqn: SplitPoint.BEGINNING | SplitPoint.END}``
    (:mod:`fxpipe.frontend.markers`). ``max_memory`` caps every stage's estimated
    peak memory in bytes (parameters, gradients, activations kept for backward).
    ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"zb"`` (zero bubble: 1F1B whose linears'
    weight gradients fill the pipeline's idle time; see :mod:`fxpipe.runtime.schedules.builtin`), what
    :meth:`Pipe.step` runs, or your own schedule: action lists, one per stage, as lists of
    :class:`~fxpipe.runtime.schedules.actions.Action` or tokens (``"0F3"``), as text (a line per
    stage), or the path of a file of that text; it must cover ``chunks`` micro-batches, and it
    is checked for completeness and deadlock before anything runs (:class:`ScheduleError`). ``tracer`` is
    ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export`` on the example inputs, dim 0
    dynamic) or a callable returning another tracer's GraphModule; see :func:`fxpipe.trace`.

    ``plan`` (a :class:`PipelinePlan` or the path of one saved with ``plan.save``) reuses a
    saved stage assignment instead of partitioning; it raises :class:`PlanMismatchError`
    saying what differs if the model's graph no longer matches it. Devices, chunks and
    checkpointing still come from the arguments.

    ``deferred_batch_norm=True`` updates batch norm running statistics once per mini-batch,
    as eager training on the whole batch would, instead of once per micro-batch.

    ``runtime="distributed"`` runs the stages on ``torch.distributed`` ranks (launch the script
    with ``torchrun --nproc-per-node n_stages // stages_per_rank``); it needs ``example_inputs``
    to size its receive buffers, and ``timeout`` (seconds) bounds every wait for another rank.
    ``data_parallel=d`` (or ``mesh=``, a 2-D ``DeviceMesh`` with dims ``("dp", "pp")``) runs
    ``d`` replicas of the pipeline, each on its own share of the batch, averaging gradients
    over the replicas once per step (DDP; FSDP2 sharding with ``data_parallel_shard=True``);
    world = ``d x n_stages / stages_per_rank``; see :mod:`fxpipe.runtime.dataparallel`.
    ``stages_per_rank=v`` places ``v`` stages on each rank for ``schedule="interleaved"``
    (stage ``s`` on rank ``s mod world``) or ``"zbv"`` (``v=2``; rank ``r`` holds stages ``r``
    and ``2 world - 1 - r``); in one process the ranks are lanes of the schedule, each stage
    on its own device from ``devices`` (two may share one).

    A model built on the ``meta`` device (``with torch.device("meta"): model = ...``) is traced
    and planned without allocating any of its tensors; each stage then allocates only the
    tensors it owns, on its device (in the distributed runtime, only this rank's stage), and
    fills them from ``weights`` (a state dict, a ``torch.save`` or safetensors file, a Hugging
    Face shard directory, or a checkpoint saved by :func:`fxpipe.save`; only the owned FQNs
    are read) or by ``init(module)`` (default: each module's ``reset_parameters()``), seeded
    per module FQN from ``seed`` so the weights do not depend on the split (see
    :func:`fxpipe.materialize`). A model built under :func:`fxpipe.deferred_init` needs no
    ``init``: each stage replays what the model's ``__init__`` computed for its own tensors.
    ``weights`` also overwrites tensors that are already real.

    If compile fails, the model is left unmoved and unmodified.
    """
    _check_args(model, n_stages, chunks, checkpoint, balance_by, split_points, max_memory)
    check_tracer(tracer)
    check_init(init, seed)
    if balance_by == "time" and any(info.tensor.is_meta for info in tensor_table(model).values()):
        raise ValueError("balance_by='time' measures the model's kernels, which a model on meta cannot "
                         "run; use balance_by='flops'")
    if runtime == "distributed":  # too few or many processes first: the schedule's needs depend on the world
        check_launched_world(n_stages, stages_per_rank, data_parallel, mesh)
    sched = resolve(schedule, n_stages, chunks, stages_per_rank)
    saved = None if plan is None else load_plan(plan)
    if saved is not None and split_points is not None:
        raise ValueError("pass either plan= (a saved stage assignment) or split_points=, not both")
    if runtime not in ("local", "distributed"):
        raise ValueError(f"runtime={runtime!r}; use 'local' (one process) or 'distributed' (one stage per rank)")
    has_inputs = example_inputs is not None or bool(example_kwargs)
    if (data_parallel != 1 or mesh is not None or data_parallel_shard) and runtime != "distributed":
        raise ValueError("data_parallel=, mesh= and data_parallel_shard= replicate the pipeline over processes; "
                         "use runtime='distributed' (launched with torchrun)")
    if not isinstance(data_parallel, int) or isinstance(data_parallel, bool) or data_parallel < 1:
        raise ValueError(f"data_parallel={data_parallel!r}; use an integer of at least 1 (the replicas)")
    if runtime == "distributed":
        if not has_inputs:
            raise ValueError("runtime='distributed' needs example_inputs= (the same on every rank) to "
                             "size the buffers it receives into")
        layout = setup_distributed(n_stages, timeout, stages_per_rank, data_parallel, mesh)
        rank, device = layout.rank, layout.device
        link = Comm(rank, timeout, layout.pp_group, device, layout.global_ranks)  # messages inside the pipeline
        # every rank plans with the same devices, so every rank makes the same plan
        devices = [torch.device(device.type, r) for r in sched.ranks]
    else:
        if devices is None and sched.world < n_stages:  # a device per rank, its stages on it
            per_rank = resolve_devices(None, sched.world)
            devices = [per_rank[r] for r in sched.ranks]
        devices = resolve_devices(devices, n_stages)
        device = devices[0]
    args = example_inputs if isinstance(example_inputs, tuple) else (
        () if example_inputs is None else (example_inputs,))
    materials = Materials(check_weights(weights), init, seed)

    try:
        front = front_end(model, n_stages, args=args, kwargs=example_kwargs, has_inputs=has_inputs,
                          chunks=chunks, checkpoint=checkpoint, balance_by=balance_by,
                          split_points=split_points, split_spec=split_spec, max_memory=max_memory,
                          leaf_modules=leaf_modules, tracer=tracer, saved=saved, devices=devices,
                          profile_device=device)
    except PropagationError as exc:
        if not isinstance(example_inputs, list):
            raise
        raise PropagationError(f"example_inputs is a list, so the model got it as its one input; to give "
                               f"several inputs pass a tuple, example_inputs=tuple(...)\n{exc}",
                               exc.node, exc.module) from None
    gm = front.gm
    refuse_meta_constants(model, gm)
    if runtime == "distributed":
        agree_on_stages(gm, n_stages)  # a measured cost may differ by rank: rank 0's cut wins
    stages, stage_plans, routes = split_stages(gm, n_stages)
    plan = make_plan(gm, stages, stage_plans, routes, devices, front.micro, chunks, checkpoint, sched.name,
                     front.balance_by, front.cut, saved)  # from here on, the plan made, not the one passed in
    for s in plan.stages:
        s.rank = sched.ranks[s.index]
    engine: Any
    owned = None
    if runtime == "distributed":
        for s in plan.stages:
            s.device = f"rank {s.on_rank} ({device.type})"  # the same on every rank
        devices = [device if r == rank else torch.device("meta") for r in sched.ranks]
        engine, keep = build_distributed(model, gm, plan, stages, layout, link, timeout, sched,
                                         deferred_batch_norm, shard=data_parallel_shard, materials=materials)
        owned = {n for key, info in tensor_table(model).items() if key in keep for n in info.names}
    else:
        engine = build_local(model, gm, plan, stages, devices, sched, deferred_batch_norm, materials)
    pipe = Pipe(model, gm, plan, stages, devices, engine, owned)
    log.info("compiled %s into %d stages\n%s", type(model).__name__, n_stages, plan)
    return pipe


def _check_args(model, n_stages, chunks, checkpoint, balance_by, split_points, max_memory) -> None:
    """Reject bad arguments before anything is traced or moved."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.compile expects an nn.Module or a torch.fx.GraphModule, "
                        f"got {type(model).__name__}")
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise ValueError(f"n_stages={n_stages!r}; use an integer of at least 1")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}; use an integer of at least 1 (the number of micro-batches)")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={checkpoint!r}; use one of {', '.join(map(repr, CHECKPOINT_MODES))}")
    if balance_by not in BALANCE_BY:
        raise ValueError(f"balance_by={balance_by!r}; use one of {', '.join(map(repr, BALANCE_BY))}")
    if split_points is not None and (isinstance(split_points, str)
                                     or not all(isinstance(p, str) for p in split_points)):
        raise TypeError(f"split_points must be a list of module or node names, got {split_points!r}")
    if max_memory is not None:
        if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
            raise TypeError(f"max_memory must be a number of bytes per device, got {max_memory!r}")
        if not max_memory > 0:
            raise ValueError(f"max_memory={max_memory!r}; use a positive number of bytes per device")
