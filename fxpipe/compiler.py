"""``fxpipe.compile``: trace, annotate, partition, split, plan, place, and build the runtime."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx
from torch import nn
from torch._subclasses import fake_tensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.runtime.batchnorm import defer_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.distributed import DistributedRuntime, agree_on_stages, setup_distributed, tied_groups
from fxpipe.tools.blame import blamed
from fxpipe.runtime.local import LocalRuntime
from fxpipe.runtime.microbatch import batch_size, micro_sizes
from fxpipe.markers import resolve_split_points
from fxpipe.mutation import copy_mutated_inputs
from fxpipe.pipe import Pipe
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.placement import move_owned, named_tensors, ownership, resolve_devices, stage_callable
from fxpipe.plan import PipelinePlan, SkipRoute, StagePlan
from fxpipe.saved import PlanLike, apply_plan, graph_signature, load_plan
from fxpipe.tracing import check_tracer, trace
from fxpipe.runtime.wgrad import defer_weight_grads

__all__ = ["compile"]

log = logging.getLogger(__name__)

CHECKPOINT_MODES = ("always", "except_last", "never")
_DATA_DEPENDENT = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   GuardOnDataDependentSymNode)
SCHEDULES = ("gpipe", "1f1b", "zb")
BALANCE_BY = ("auto", "flops", "params", "memory", "time")



def compile(model: nn.Module, n_stages: int, *, example_inputs: Any = None,
            example_kwargs: dict[str, Any] | None = None, devices: Sequence[Any] | None = None,
            chunks: int = 1, checkpoint: str = "except_last", balance_by: str = "auto",
            split_points: Sequence[str] | None = None, max_memory: float | None = None,
            schedule: str = "gpipe", leaf_modules: Iterable[type | str] = (),
            tracer: str | Callable[[nn.Module], torch.fx.GraphModule] = "fx",
            plan: PlanLike | None = None, runtime: str = "local", timeout: float = 300.0,
            deferred_batch_norm: bool = False, split_spec: dict[str, Any] | None = None) -> Pipe:
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
    (:mod:`fxpipe.markers`). ``max_memory`` caps every stage's estimated
    peak memory in bytes (parameters, gradients, activations kept for backward).
    ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"zb"`` (zero bubble: 1F1B whose linears'
    weight gradients fill the pipeline's idle time; see :mod:`fxpipe.runtime.schedule`), what
    :meth:`Pipe.step` runs. ``tracer`` is
    ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export`` on the example inputs, dim 0
    dynamic) or a callable returning another tracer's GraphModule; see :func:`fxpipe.trace`.

    ``plan`` (a :class:`PipelinePlan` or the path of one saved with ``plan.save``) reuses a
    saved stage assignment instead of partitioning; it raises :class:`PlanMismatchError`
    saying what differs if the model's graph no longer matches it. Devices, chunks and
    checkpointing still come from the arguments.

    ``deferred_batch_norm=True`` updates batch norm running statistics once per mini-batch,
    as eager training on the whole batch would, instead of once per micro-batch.

    ``runtime="distributed"`` runs one stage per ``torch.distributed`` rank (launch the script
    with ``torchrun --nproc-per-node n_stages``); it needs ``example_inputs`` to size its
    receive buffers, and ``timeout`` (seconds) bounds every wait for another rank.

    If compile fails, the model is left unmoved and unmodified.
    """
    _check_args(model, n_stages, chunks, checkpoint, balance_by, schedule, split_points, max_memory)
    check_tracer(tracer)
    saved = None if plan is None else load_plan(plan)
    if saved is not None and split_points is not None:
        raise ValueError("pass either plan= (a saved stage assignment) or split_points=, not both")
    if runtime not in ("local", "distributed"):
        raise ValueError(f"runtime={runtime!r}; use 'local' (one process) or 'distributed' (one stage per rank)")
    has_inputs = example_inputs is not None or bool(example_kwargs)
    if runtime == "distributed":
        if not has_inputs:
            raise ValueError("runtime='distributed' needs example_inputs= (the same on every rank) to "
                             "size the buffers it receives into")
        rank, device, group = setup_distributed(n_stages, timeout)
        link = Comm(rank, timeout, group, device)  # messages to the other ranks
        # every rank plans with the same devices, so every rank makes the same plan
        devices = [torch.device(device.type, j) for j in range(n_stages)]
    else:
        devices = resolve_devices(devices, n_stages)
    args = example_inputs if isinstance(example_inputs, tuple) else (
        () if example_inputs is None else (example_inputs,))
    if tracer == "fx" and isinstance(model, torch.fx.GraphModule):
        gm = model
    else:
        if tracer == "export":
            batch_size([args, example_kwargs or {}], ["example_inputs", "example_kwargs"])
        gm = trace(model, leaf_modules=leaf_modules, tracer=tracer, example_inputs=args,
                   example_kwargs=example_kwargs)

    split_points = resolve_split_points(gm, n_stages, split_points, split_spec, saved is not None)
    if has_inputs:
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        batch = batch_size(passes.bind_placeholders(gm, args, example_kwargs or {}), names)
        micro = len(micro_sizes(batch, chunks))
        _annotate(gm, args, example_kwargs or {})
    else:
        passes.annotate_params(gm)
        micro = chunks
    if saved is not None:
        balance_by = saved.balance_by
    elif balance_by == "auto":
        balance_by = "flops" if has_inputs else "params"
    if saved is None and balance_by in ("flops", "memory", "time") and not has_inputs:
        raise ValueError(f"balance_by={balance_by!r} needs example_inputs= to know the shapes; "
                         "pass example inputs or use balance_by='params'")
    if max_memory is not None and not has_inputs:
        raise ValueError("max_memory= needs example_inputs= to know the activation sizes; pass "
                         "example inputs")
    if saved is None and balance_by == "time":
        if devices[0].type == "meta":
            raise ValueError("balance_by='time' measures kernels and cannot run on the meta device; "
                             "give real devices or use balance_by='flops'")
        passes.profile(gm, args, example_kwargs or {}, device=devices[0] if runtime == "local" else device)

    comm = passes.comm_weights(devices, balance_by)
    memory = dict(max_memory=max_memory, checkpoint=checkpoint, micro_batches=micro)
    cut = None
    if saved is not None:
        apply_plan(gm, saved, n_stages)
    elif split_points is not None:
        if len(split_points) + 1 != n_stages:
            raise ValueError(f"{len(split_points)} split points make {len(split_points) + 1} stages "
                             f"but n_stages={n_stages}; give n_stages - 1 split points")
        cut = passes.partition_at(gm, split_points, balance_by=balance_by, comm=comm, **memory)
    else:
        cut = passes.partition(gm, n_stages, balance_by=balance_by, comm=comm, **memory)
    if runtime == "distributed":
        agree_on_stages(gm, n_stages, link)  # a measured cost may differ by rank: rank 0's cut wins
    stage_graphs, routes = passes.split(gm, n_stages)
    copy_mutated_inputs(gm, stage_graphs)

    plan = _make_plan(gm, stage_graphs, routes, devices, micro, chunks, checkpoint, schedule,
                      balance_by, cut, saved)  # from here on, the plan made, not the one passed in
    stages = [s.module for s in stage_graphs]
    if runtime == "distributed":
        for s in plan.stages:
            s.device = str(device) if s.index == rank else f"rank {s.index}"
        devices = [device if j == rank else torch.device("meta") for j in range(n_stages)]
        move_owned([model, gm, *stages], ownership(stages[rank:rank + 1], [device]), [device])
        tied = tied_groups(stages, rank, timeout)
        runnable = _runnable(stages[rank], schedule)
        fn = blamed(runnable, runnable, rank, device)
        engine: Any = DistributedRuntime(plan, gm, fn, rank, device, link, CallSignature(gm), tied)
    else:
        own = ownership(stages, devices)
        move_owned([model, gm, *stages], own, devices)
        runnables = [_runnable(gm_j, schedule) for gm_j in stages]
        fns = [blamed(stage_callable(r, own.foreign[j], devices[j]), r, j, devices[j])
               for j, r in enumerate(runnables)]
        engine = LocalRuntime(plan, fns, devices, CallSignature(gm))
    if deferred_batch_norm:
        held = stages[rank:rank + 1] if runtime == "distributed" else stages
        engine.deferred = defer_batch_norm({id(m): m for st in held for m in st.modules()}.values())
    pipe = Pipe(model, gm, plan, stages, devices, engine)
    log.info("compiled %s into %d stages\n%s", type(model).__name__, n_stages, plan)
    return pipe


def _runnable(gm: torch.fx.GraphModule, schedule: str) -> torch.fx.GraphModule:
    """Return the stage module the runtime calls: with linears that defer weight gradients for zb."""
    return defer_weight_grads(gm) if schedule == "zb" else gm


def _check_args(model, n_stages, chunks, checkpoint, balance_by, schedule, split_points, max_memory) -> None:
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
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}")
    if split_points is not None and (isinstance(split_points, str)
                                     or not all(isinstance(p, str) for p in split_points)):
        raise TypeError(f"split_points must be a list of module or node names, got {split_points!r}")
    if max_memory is not None:
        if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
            raise TypeError(f"max_memory must be a number of bytes per device, got {max_memory!r}")
        if not max_memory > 0:
            raise ValueError(f"max_memory={max_memory!r}; use a positive number of bytes per device")


def _annotate(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Annotate on fake tensors; for data-dependent ops, on real kernels with buffer copies."""
    try:
        passes.annotate(gm, args, kwargs)
    except _DATA_DEPENDENT as exc:
        log.warning("fake tensors cannot follow a data-dependent op (%s); annotating with real "
                    "kernels on copies of the buffers", type(exc).__name__)
        passes.annotate(gm, args, kwargs, real=True)


def _make_plan(gm, stage_graphs, routes, devices, micro, chunks, checkpoint, schedule, balance_by,
               cut, saved_plan) -> PipelinePlan:
    """Collect the split's stages, routes and costs into a :class:`PipelinePlan`."""
    nodes = {n.name: n for n in gm.graph.nodes}
    per_micro = max(micro, 1)
    profiled = any("fxpipe.time" in n.meta for n in gm.graph.nodes)
    stage_plans = []
    for j, sg in enumerate(stage_graphs):
        tensors = {id(t): t for _, t in named_tensors(sg.module)}
        params = int(sum(t.numel() * t.element_size() for t in tensors.values()))
        held = [nodes[v] for v in sg.nodes]
        saved = sum(n.meta.get("fxpipe.saved_bytes", 0) for n in held)
        received = sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in sg.inputs)
        stage_plans.append(StagePlan(
            index=j, device=str(devices[j]), nodes=sg.nodes, inputs=sg.inputs, outputs=sg.outputs,
            flops=int(sum(n.meta.get("fxpipe.flops", 0) + n.meta.get("fxpipe.flops_bwd", 0) for n in held)),
            params=params,
            activation_bytes=int(sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in sg.outputs) // per_micro),
            time_ms=float(sum(n.meta.get("fxpipe.time", 0.0) for n in held)) if profiled else None,
            saved_bytes=int(saved // per_micro),
            checkpoint_bytes=int(received // per_micro),
            memory=int(cut.memory[j]) if cut is not None else saved_plan.stages[j].memory,
            cost=float(cut.costs[j]) if cut is not None else saved_plan.stages[j].cost,
            grad_inputs=[v for v in sg.inputs if j > 0 and _carries_grad(nodes[v])],
        ))
    skips = [SkipRoute(r.name, r.src, r.dst, int(nodes[r.name].meta.get("fxpipe.bytes", 0) // per_micro))
             for r in routes]
    names, ops, targets = graph_signature(gm)
    return PipelinePlan(stages=stage_plans, skips=skips, chunks=chunks, checkpoint=checkpoint,
                        schedule=schedule, balance_by=balance_by,
                        graph_nodes=names, graph_ops=ops, graph_targets=targets)


def _carries_grad(node: torch.fx.Node) -> bool:
    """Tell whether a value crossing a boundary carries a gradient back to its producer."""
    spec = node.meta.get("fxpipe.value")
    if spec is None:  # not annotated: assume computed floating values do
        return node.op != "placeholder"
    return any(isinstance(t, passes.TensorSpec) and t.requires_grad and t.dtype.is_floating_point
               for t in tree_flatten(spec)[0])
