"""``fxpipe.compile``: trace, annotate, partition, split, plan, place, and build the runtime."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx
from torch import nn
from torch._subclasses import fake_tensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import passes
from fxpipe.blame import blamed
from fxpipe.local import LocalRuntime
from fxpipe.microbatch import batch_size, micro_sizes
from fxpipe.mutation import copy_mutated_inputs
from fxpipe.pipe import Pipe
from fxpipe.placement import move_owned, ownership, resolve_devices, stage_callable
from fxpipe.plan import PipelinePlan, SkipRoute, StagePlan
from fxpipe.tracing import check_tracer, trace

__all__ = ["compile"]

log = logging.getLogger(__name__)

CHECKPOINT_MODES = ("always", "except_last", "never")
_DATA_DEPENDENT = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   GuardOnDataDependentSymNode)
SCHEDULES = ("gpipe", "1f1b")
BALANCE_BY = ("auto", "flops", "params", "memory", "time")



def compile(model: nn.Module, n_stages: int, *, example_inputs: Any = None,
            example_kwargs: dict[str, Any] | None = None, devices: Sequence[Any] | None = None,
            chunks: int = 1, checkpoint: str = "except_last", balance_by: str = "auto",
            split_points: Sequence[str] | None = None, schedule: str = "gpipe",
            leaf_modules: Iterable[type | str] = (),
            tracer: str | Callable[[nn.Module], torch.fx.GraphModule] = "fx") -> Pipe:
    """Split ``model`` into ``n_stages`` pipeline stages and return a :class:`Pipe` running them.

    ``model`` is an ``nn.Module`` (traced with :func:`fxpipe.trace`) or an already traced
    ``torch.fx.GraphModule``, used as is. ``example_inputs`` (and ``example_kwargs``) give
    shapes for the cost model; nothing real is computed with them. ``devices`` gives one
    device per stage. ``chunks`` is the number of micro-batches; ``checkpoint`` is
    ``"always"``, ``"except_last"`` or ``"never"``; ``balance_by`` picks the cost that stages
    balance; ``split_points`` names the modules or nodes where stages begin instead.
    ``tracer`` is ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export`` on the example
    inputs, dim 0 dynamic) or a callable returning another tracer's GraphModule; see
    :func:`fxpipe.trace`.

    If compile fails, the model is left unmoved and unmodified.
    """
    _check_args(model, n_stages, chunks, checkpoint, balance_by, schedule, split_points)
    check_tracer(tracer)
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

    if example_inputs is not None or example_kwargs:
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        batch = batch_size(passes.bind_placeholders(gm, args, example_kwargs or {}), names)
        micro = len(micro_sizes(batch, chunks))
        _annotate(gm, args, example_kwargs or {})
    else:
        passes.annotate_params(gm)
        micro = chunks
    if balance_by == "auto":
        balance_by = "flops" if example_inputs is not None or example_kwargs else "params"
    if balance_by in ("flops", "memory") and example_inputs is None and not example_kwargs:
        raise ValueError(f"balance_by={balance_by!r} needs example_inputs= to know the shapes; "
                         "pass example inputs or use balance_by='params'")

    if split_points is not None:
        if len(split_points) + 1 != n_stages:
            raise ValueError(f"{len(split_points)} split points make {len(split_points) + 1} stages "
                             f"but n_stages={n_stages}; give n_stages - 1 split points")
        passes.partition_at(gm, split_points)
    else:
        passes.partition(gm, n_stages, balance_by=balance_by)
    stage_graphs, routes = passes.split(gm, n_stages)
    copy_mutated_inputs(gm, stage_graphs)

    plan = _make_plan(gm, stage_graphs, routes, devices, micro, chunks, checkpoint, schedule, balance_by)
    stages = [s.module for s in stage_graphs]
    own = ownership(stages, devices)
    move_owned([model, gm, *stages], own, devices)
    fns = [blamed(stage_callable(gm_j, own.foreign[j], devices[j]), gm_j, j, devices[j])
           for j, gm_j in enumerate(stages)]
    runtime = LocalRuntime(plan, fns, devices)
    pipe = Pipe(model, gm, plan, stages, devices, runtime)
    log.info("compiled %s into %d stages\n%s", type(model).__name__, n_stages, plan)
    return pipe


def _check_args(model, n_stages, chunks, checkpoint, balance_by, schedule, split_points) -> None:
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
    if schedule != "gpipe":
        raise ValueError(f"schedule={schedule!r} is not available in the single-process runtime yet; "
                         "use schedule='gpipe'")
    if split_points is not None and (isinstance(split_points, str)
                                     or not all(isinstance(p, str) for p in split_points)):
        raise TypeError(f"split_points must be a list of module or node names, got {split_points!r}")


def _annotate(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Annotate on fake tensors; for data-dependent ops, on real kernels with buffer copies."""
    try:
        passes.annotate(gm, args, kwargs)
    except _DATA_DEPENDENT as exc:
        log.warning("fake tensors cannot follow a data-dependent op (%s); annotating with real "
                    "kernels on copies of the buffers", type(exc).__name__)
        passes.annotate(gm, args, kwargs, real=True)


def _make_plan(gm, stage_graphs, routes, devices, micro, chunks, checkpoint, schedule, balance_by) -> PipelinePlan:
    """Collect the split's stages, routes and costs into a :class:`PipelinePlan`."""
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_plans = []
    for j, sg in enumerate(stage_graphs):
        tensors = {id(t): t for _, t in sg.module.named_parameters(remove_duplicate=False)}
        tensors.update({id(t): t for _, t in sg.module.named_buffers(remove_duplicate=False)})
        stage_plans.append(StagePlan(
            index=j, device=str(devices[j]), nodes=sg.nodes, inputs=sg.inputs, outputs=sg.outputs,
            flops=int(sum(nodes[v].meta.get("fxpipe.flops", 0) for v in sg.nodes)),
            params=int(sum(t.numel() * t.element_size() for t in tensors.values())),
            activation_bytes=int(sum(nodes[v].meta.get("fxpipe.bytes", 0) for v in sg.outputs) // max(micro, 1)),
        ))
    skips = [SkipRoute(r.name, r.src, r.dst, int(nodes[r.name].meta.get("fxpipe.bytes", 0) // max(micro, 1)))
             for r in routes]
    return PipelinePlan(stages=stage_plans, skips=skips, chunks=chunks, checkpoint=checkpoint,
                        schedule=schedule, balance_by=balance_by,
                        graph_nodes=[n.name for n in gm.graph.nodes])
