"""``fxpipe.compile``: the options, then front end, plan, and the runtime's build.

    keywords ─▶ CompileOptions ─▶ check ─▶ where it runs (devices | ranks) ─▶ front end (trace, annotate, cut)
             ─▶ stages + PipelinePlan ─▶ build (local | distributed) ─▶ Pipe
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.errors import CompileError, PlanMismatchError, user_stacklevel
from fxpipe.frontend.compiledmodule import unwrap_compiled
from fxpipe.frontend.quantized import quantized_modules
from fxpipe.materialize.metatensors import released
from fxpipe.options import AUTO, CompileOptions
from fxpipe.passes.structure import as_containers
from fxpipe.pipe import Pipe
from fxpipe.plan.assign import assign_stages
from fxpipe.plan.batches import refuse_nested_or_sparse
from fxpipe.plan.saved import PlanLike, adopt_layout, load_plan
from fxpipe.plan.stages import make_plan
from fxpipe.runtime.build import build
from fxpipe.runtime.observe.blame import add_note
from fxpipe.runtime.target import where
from fxpipe.runtime.transport.mesh import launched_world
from fxpipe.runtime.transport.together import succeeded_together
from fxpipe.simulate.fit import fit
from fxpipe.simulate.measure import retain_anywhere
from fxpipe.unknownargs import refuse_unknown

__all__ = ["compile"]

log = logging.getLogger(__name__)


def _normal(values: Any) -> Any:
    """Return ``values`` with each inference tensor (made under ``torch.inference_mode()``) copied to a normal one.

    Under inference mode every value tracing makes would be an inference tensor, which has no
    version counter (read to find in-place ops) and cannot be saved for the backward the
    annotation records: :func:`compile` runs with it off, on such copies of the example inputs.
    """
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t, values)


def _refuse_sync_batch_norm(model: nn.Module) -> None:
    """Refuse SyncBatchNorm across ranks, which would wait on ranks that never run its stage."""
    synced = [name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        shown = ", ".join(repr(n) for n in synced[:3]) + (", ..." if len(synced) > 3 else "")
        raise CompileError(
            f"{type(model).__name__} holds {len(synced)} SyncBatchNorm module(s) ({shown}): across ranks SyncBatchNorm "
            "all-reduces its statistics over every rank of its process group, and the ranks holding other stages "
            "never join it (on CPU it refuses to run at all). Build the model with plain BatchNorm (without "
            "nn.SyncBatchNorm.convert_sync_batchnorm): each micro-batch is normalized by its own statistics, as in "
            "torchgpipe, and deferred_batch_norm=True tracks the running statistics over every micro-batch of every "
            "replica")


def compile(model: nn.Module, n_stages: int | None = None, *, example_inputs: Any = None,
            example_kwargs: dict[str, Any] | None = None, devices: Sequence[Any] | None = None,
            chunks: int = 1, checkpoint: str | Sequence[str] = "except_last", balance_by: str = "auto",
            split_points: Sequence[str] | None = None, max_memory: float | None = None,
            schedule: str | Sequence[Any] = "gpipe", leaf_modules: Iterable[type | str] = (),
            tracer: str | Callable[[nn.Module], torch.fx.GraphModule] = "fx",
            plan: PlanLike | None = None, runtime: str | None = None, timeout: float = 300.0,
            deferred_batch_norm: bool = False, stages_per_rank: int = 1, data_parallel: int = 1,
            data_parallel_shard: bool = False, tensor_parallel: int = 1, tp_plan: Any = None,
            mesh: Any = None, weights: Any = None,
            init: Callable[[nn.Module], Any] | None = None, seed: int = 0,
            split_spec: dict[str, Any] | None = None, torch_compile: bool | dict[str, Any] = False,
            save: Callable[[torch.fx.Node], bool] | None = None, unbatched: Sequence[str] = (),
            export_dims: str = "auto", **unknown: Any) -> Pipe:
    """Split ``model`` into ``n_stages`` pipeline stages and return a :class:`Pipe` running them.

    ``model`` is an ``nn.Module`` (traced with :func:`fxpipe.trace`) or an already traced
    ``torch.fx.GraphModule``, used as is. ``example_inputs`` (and ``example_kwargs``) give
    shapes for the cost model; nothing real is computed with them. ``devices`` gives one
    device per stage. ``chunks`` is the number of micro-batches: every tensor input is split on dim 0,
    but the inputs named in ``unbatched`` (the forward's parameter names; Flux's ``img_ids``, a
    ``position_ids`` of one row) go whole to every micro-batch. ``checkpoint`` is how each
    stage trades memory for recomputation (docs/guide/memory.md): ``"always"``, ``"except_last"``
    or ``"never"`` recompute whole micro-batches of a stage (all, all but the last, none);
    ``"selective"`` keeps what the expensive nodes (GEMMs, convolutions, attention; or those
    ``save(node)`` returns True for) made and recomputes the other nodes in backward;
    ``"offload"`` (CUDA only) keeps a stage's saved activations in pinned host memory between
    forward and backward; a list gives one of these per stage; ``"auto"`` chooses per stage, with
    ``max_memory``, the policy with the least recomputation whose predicted peak fits, for the
    schedule in use (moving a stage boundary by a block when that fits better), and says which
    stage overflows and what would fit when nothing does. ``balance_by`` picks the cost that stages
    balance (``"flops"``, ``"params"``, ``"memory"``, ``"time"`` measured on ``devices[0]``, or
    ``"auto"``: FLOPs with example inputs, else parameters); ``split_points`` names the
    modules or nodes where stages begin instead. Without them, the model's
    ``torch.distributed.pipelining`` markers say where stages begin: ``pipe_split()`` calls in
    its forward and ``split_spec={fqn: SplitPoint.BEGINNING | SplitPoint.END}``
    (:mod:`fxpipe.frontend.markers`). ``max_memory`` caps every stage's estimated
    peak memory in bytes (parameters, gradients, activations kept for backward).
    ``schedule`` is ``"gpipe"``, ``"1f1b"``, ``"zb"`` (zero bubble: 1F1B whose linears'
    weight gradients fill the pipeline's idle time; see :mod:`fxpipe.runtime.schedules.builtin`),
    ``"interleaved"`` or ``"zbv"`` (several stages per rank, see ``stages_per_rank``), what
    :meth:`Pipe.step` runs, or your own schedule: action lists, one per stage, as lists of
    :class:`~fxpipe.runtime.schedules.actions.Action` or tokens (``"0F3"``), as text (a line per
    stage), or the path of a file of that text; it must cover ``chunks`` micro-batches, and it
    is checked for completeness and deadlock before anything runs (:class:`ScheduleError`). ``tracer`` is
    ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export`` on the example inputs, dim 0
    dynamic, the other dims as free as the model allows) or a callable returning another tracer's GraphModule; see :func:`fxpipe.trace`.
    ``export_dims="batch"`` keeps only dim 0 dynamic under export, the other dims the example's:
    a shorter export where torch.export's reasoning over symbolic image or sequence sizes is slow
    (a Swin backbone's padding and windows), at the cost of refusing other sizes.

    ``plan`` (a :class:`PipelinePlan` or the path of one saved with ``plan.save``) reuses a
    saved stage assignment instead of partitioning; it raises :class:`PlanMismatchError`
    saying what differs if the model's graph no longer matches it. What the plan records of its
    layout (chunks, schedule, each stage's checkpointing, stages per rank, the tracer, and with
    ``runtime="distributed"`` and no ``mesh=`` its replicas, sharding and tensor parallelism: a
    plan ``fxpipe plan --gpus`` wrote, or ``pipe.plan``) fills every one of these arguments left
    at its default; an argument given another value wins. Devices come from the arguments.

    ``deferred_batch_norm=True`` updates batch norm running statistics once per mini-batch,
    from the sums of every micro-batch's inputs, instead of once per micro-batch (a batch norm
    whose inputs no earlier batch norm normalized then gets eager's whole-batch statistics;
    later ones see inputs normalized per micro-batch). Both front ends: fx's batch norm modules
    and an exported graph's ``aten.batch_norm`` calls.

    ``runtime="local"`` (the default) runs every stage in this process (warned of when left out
    under torchrun with several processes); ``runtime="distributed"`` runs the stages on
    ``torch.distributed`` ranks (launch the script with ``torchrun --nproc-per-node
    n_stages // stages_per_rank``); it needs ``example_inputs``
    to size its receive buffers, and ``timeout`` (seconds) bounds every wait for another rank.
    ``data_parallel=d`` (or ``mesh=``, a 2-D ``DeviceMesh`` with dims ``("dp", "pp")``) runs
    ``d`` replicas of the pipeline, each on its own share of the batch, averaging gradients
    over the replicas once per step (DDP; FSDP2 sharding with ``data_parallel_shard=True``);
    world = ``d x n_stages / stages_per_rank``; see :mod:`fxpipe.runtime.dataparallel`.
    ``tensor_parallel=t`` splits each stage's layers over ``t`` ranks with PyTorch's parallel styles
    (DTensor, ``parallelize_module``): ``tp_plan`` is a dict of module FQN patterns to styles
    (``{"layers.*.attn.q": ColwiseParallel(), ...}``, as torchtitan writes them) or ``"auto"`` (the
    default: Megatron's column-then-row pairing derived from the graph, see
    :mod:`fxpipe.passes.tpauto`); sizes the trace baked into reshapes are made local. World =
    ``data_parallel x n_stages / stages_per_rank x t``, or ``mesh=`` a 3-D ``DeviceMesh`` with dims
    ``("dp", "pp", "tp")`` (tp innermost); see :mod:`fxpipe.runtime.tensorparallel`.
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

    ``torch_compile=True`` (inductor) or a dict of ``torch.compile``'s arguments (``backend``,
    ``mode``, ``dynamic``, ``options``, ``fullgraph``) compiles every stage, once per stage, at its
    first call: under every schedule (zero bubble's included: the compiled backward graph is cut
    into ``I`` and ``W``, for the ``inductor`` and ``aot_eager`` backends), in one process and on
    every rank; a new micro-batch size compiles a stage at most once more (dim 0 dynamic); a
    graph break is logged naming the stage and node (``fullgraph=True``: a
    :class:`CompileError`); ``pipe.compile_stats`` says what was compiled and how long it took. See :mod:`fxpipe.runtime.stage.compiled`.

    If compile fails, the model is left unmoved and unmodified. A keyword it does not take (torchgpipe's
    ``balance=``, ``torch.distributed.pipelining``'s ``n_microbatches=``, a typo) raises a ``TypeError``
    naming the argument meant.
    """
    refuse_unknown(compile, unknown)  # num_stages=2 is named before n_stages is missed
    if n_stages is None:
        raise TypeError("fxpipe.compile() is missing n_stages, the number of pipeline stages: its second argument, "
                        "fxpipe.compile(model, 4, example_inputs=...)")
    with torch.inference_mode(False):  # an evaluation script: tracing needs version counters, autograd
        example_inputs, example_kwargs = _normal((example_inputs, example_kwargs))
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxpipe.compile expects an nn.Module or a torch.fx.GraphModule, "
                            f"got {type(model).__name__}")
        model = unwrap_compiled(model, torch_compile not in (None, False))
        if runtime is None:  # left out: one process, which under torchrun is rarely what was meant
            runtime = "local"
            world = launched_world()
            if world is not None and world > 1 and plan is None:
                warnings.warn(
                    f"fxpipe.compile runs every stage in this process (runtime='local', the default), but {world} "
                    "processes were launched (torchrun): each would run the whole pipeline on its own. Pass "
                    "runtime='distributed' to give each rank its stages, or runtime='local' to keep one pipeline per "
                    "process (and silence this)", stacklevel=user_stacklevel())
        if isinstance(model, Pipe):
            raise TypeError("fxpipe.compile got a Pipe, which is compiled already: compile the model it was "
                            "compiled from (in one process the pipe shares its parameters; across ranks build the "
                            "model again and pass weights= a checkpoint fxpipe.save wrote)")
        lazy = next((n for n, t in (*model.named_parameters(), *model.named_buffers())
                     if torch.nn.parameter.is_lazy(t)), None)
        if lazy is not None:
            owner = model.get_submodule(lazy.rpartition(".")[0]) if "." in lazy else model
            raise CompileError(
                f"{type(model).__name__} has lazy modules not yet initialised ('{lazy}' of {type(owner).__name__}): "
                "their shapes come from the first input they see. Run one forward on a batch before fxpipe.compile "
                "(model(x), under torch.no_grad() if you like), or build the modules with their sizes; a lazy "
                "module that forward does not call stays uninitialised after it: delete it or give it its sizes")
        made = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_inference()), None)
        if made is not None:
            raise CompileError(
                f"{type(model).__name__}'s tensors were made under torch.inference_mode() ('{made}'): they have "
                "no version counter and cannot be saved for backward, which tracing needs. Build the model "
                "outside torch.inference_mode() (torch.no_grad() serves evaluation as well), then compile it "
                "under either")
        if released(model):
            raise CompileError(
                f"this {type(model).__name__} (or a submodule of it, or a module holding it) was compiled with "
                "runtime='distributed' on this rank already, which left only this rank's stages' tensors real (the "
                "others are on meta): compiling it again would initialise those anew, and take tensors the first "
                "pipe still runs. Across ranks a tensor belongs to one pipe: compile each model once, with the layout "
                "you want, or build the model again (a copy for the second pipe) and pass weights= a checkpoint "
                "fxpipe.save wrote")
        if plan is not None:  # what the plan records of the layout fills the arguments left at their defaults
            recorded = load_plan(plan)
            if recorded.n_stages != n_stages:  # before the world it lays out, counted from n_stages, is refused
                raise PlanMismatchError(f"the saved plan has {recorded.n_stages} stages but n_stages={n_stages}; pass "
                                        f"n_stages={recorded.n_stages} (every stage, over all ranks), or make a new "
                                        "plan for this n_stages")
            layout = adopt_layout(recorded, {"chunks": chunks, "schedule": schedule, "checkpoint": checkpoint,
                                                    "stages_per_rank": stages_per_rank, "data_parallel": data_parallel,
                                                    "data_parallel_shard": data_parallel_shard,
                                                    "tensor_parallel": tensor_parallel, "tracer": tracer,
                                                    "export_dims": export_dims},
                                  runtime == "distributed", mesh)
            if runtime == "distributed" and mesh is None:
                _refuse_plan_world(plan, layout, stages_per_rank, data_parallel, tensor_parallel, n_stages)
            chunks, schedule, checkpoint = layout["chunks"], layout["schedule"], layout["checkpoint"]
            stages_per_rank, data_parallel = layout["stages_per_rank"], layout["data_parallel"]
            data_parallel_shard, tensor_parallel = layout["data_parallel_shard"], layout["tensor_parallel"]
            tracer, export_dims = layout["tracer"], layout["export_dims"]
        if _hf_checkpointing(model):  # Hugging Face's own recomputation
            warnings.warn(
                f"{type(model).__name__} has gradient checkpointing on (gradient_checkpointing_enable()), which the "
                "trace runs through: its layers become plain calls that keep their activations, saving no memory. "
                "fxpipe recomputes per stage instead, by checkpoint= ('except_last', the default, 'always' or "
                "'selective'); call model.gradient_checkpointing_disable() before compiling to silence this",
                stacklevel=user_stacklevel())
        elif any(getattr(m, "grad_checkpointing", False) is True for m in model.modules()):  # timm's own
            warnings.warn(
                f"{type(model).__name__} has gradient checkpointing on (timm's set_grad_checkpointing()), which the "
                "trace runs through: its blocks become plain calls that keep their activations, saving no memory. "
                "fxpipe recomputes per stage instead, by checkpoint= ('except_last', the default, 'always' or "
                "'selective'); call model.set_grad_checkpointing(False) before compiling to silence this",
                stacklevel=user_stacklevel())
        dynamic = quantized_modules(model, dynamic=True)
        if dynamic and not (isinstance(chunks, int) and chunks == 1):
            warnings.warn(
                f"{', '.join(map(repr, dynamic[:3]))} {'is a' if len(dynamic) == 1 else 'are'} dynamically quantized "
                "module(s) (quantize_dynamic), which pick their inputs' quantization range per call: each "
                "micro-batch quantizes by its own rows' range, so outputs differ from eager's on the whole batch "
                "(as eager on the micro-batches). Use chunks=1 for eager's values", stacklevel=user_stacklevel())
        refuse_nested_or_sparse(example_inputs, "example_inputs")
        refuse_nested_or_sparse(example_kwargs, "example_kwargs")
        if tracer == "export":  # its graph reads a mapping by key: a plain dict, as its calls get (Binding)
            example_inputs, example_kwargs = as_containers((example_inputs, example_kwargs))
        options = CompileOptions(
            n_stages, example_inputs=example_inputs, example_kwargs=example_kwargs, devices=devices, chunks=chunks,
            checkpoint=checkpoint, balance_by=balance_by, split_points=split_points, max_memory=max_memory,
            schedule=schedule, leaf_modules=leaf_modules, tracer=tracer, plan=plan, runtime=runtime, timeout=timeout,
            deferred_batch_norm=deferred_batch_norm, stages_per_rank=stages_per_rank, data_parallel=data_parallel,
            data_parallel_shard=data_parallel_shard, tensor_parallel=tensor_parallel, tp_plan=tp_plan, mesh=mesh,
            weights=weights, init=init, seed=seed, split_spec=split_spec, torch_compile=torch_compile, save=save,
            unbatched=unbatched, export_dims=export_dims)
        if options.distributed:
            _refuse_sync_batch_norm(model)
        target = where(model, options)  # the schedule, the devices, and across ranks this process's place
        saved = None if plan is None else load_plan(plan)
        try:
            front = assign_stages(model, options, saved, target.devices, target.device)
        except Exception as exc:
            _note_packed_inputs(exc, options.args)
            if options.distributed:  # the others hear of it instead of a closed connection
                succeeded_together("tracing and annotating the model", exc)
            raise
        if options.distributed:
            succeeded_together("tracing and annotating the model", None)
        chosen = None
        if options.checkpoint == AUTO:  # the policies, and maybe a boundary moved, for max_memory
            chosen = fit(front, options, target.devices, target.schedule, options.distributed, saved, not front.fixed)
        target.check_graph(model, front.gm, n_stages)
        policies = chosen.policies if chosen is not None else options.checkpoint
        if options.save is None and "selective" in ([policies] if isinstance(policies, str) else list(policies)):
            try:  # what backward keeps, which selective recomputation's swaps read (selectswap)
                retain_anywhere(front.gm)
            except Exception as e:  # noqa: BLE001 -- an optional refinement: without it nothing is swapped
                log.info("selective recomputation keeps the default rule: what backward keeps could not be "
                         "traced (%s: %s)", type(e).__name__, e)
        pipe_plan, stages = make_plan(front, options, target.devices, target.schedule.name, target.schedule.ranks,
                                      saved)
        if chosen is not None:
            for s, policy, peak in zip(pipe_plan.stages, chosen.policies, chosen.peaks):
                s.checkpoint, s.peak = policy, int(peak)
            log.info("checkpoint='auto' for max_memory=%s: %s", options.max_memory, chosen.policies)
        built = build(model, front.gm, pipe_plan, stages, options, target)
        pipe = Pipe(model, front.gm, pipe_plan, stages, built.devices, built.runtime, built.owned)
        pipe.__dict__["_save"] = options.save  # what fxpipe.simulate(pipe) predicts selective recomputation keeps
        log.info("compiled %s into %d stages\n%s", type(model).__name__, n_stages, pipe_plan)
        return pipe


def _refuse_plan_world(plan: PlanLike, layout: dict[str, Any], stages_per_rank: int, data_parallel: int,
                       tensor_parallel: int, n_stages: int) -> None:
    """Refuse a launched world that cannot hold the layout taken from a saved plan, naming the plan as its source.

    Passing ``data_parallel=1`` (a default) cannot undo a plan's replicas, so the fix is another
    launch or another plan, not the argument the generic message suggests.
    """
    spr, dp, tp = layout["stages_per_rank"], layout["data_parallel"], layout["tensor_parallel"]
    world = launched_world()
    if (spr, dp, tp) == (stages_per_rank, data_parallel, tensor_parallel) or world is None or n_stages % spr:
        return
    want = n_stages // spr * dp * tp
    if world == want:
        return
    name = f" {os.fspath(plan)!r}" if isinstance(plan, (str, os.PathLike)) else ""
    parts = [f"{n_stages // spr} pipeline ranks", *([f"{dp} replicas"] if dp > 1 else []),
             *([f"{tp} tensor-parallel ranks"] if tp > 1 else [])]
    raise ValueError(f"the plan{name} lays the model out on {want} processes ({' x '.join(parts)}, {spr} stage(s) per "
                     f"rank) but {world} are running: launch with --nproc-per-node {want}, or make a plan for {world} "
                     f"(fxpipe plan MODEL --gpus {world} --json plan.json); arguments at their defaults take the plan's "
                     "values, so data_parallel=1 cannot undo its replicas")


def _note_packed_inputs(exc: BaseException, args: tuple) -> None:
    """Add a note where a tensor was expected and an example input is a tuple: ``example_inputs=((x,),)``."""
    packed = [k for k, a in enumerate(args) if isinstance(a, (tuple, list))]
    if packed and re.search(r"must be Tensor, not (tuple|list)|'(tuple|list)' object has no attribute", str(exc)):
        add_note(exc, f"fxpipe: example_inputs is the tuple of forward's positional arguments, and its item(s) "
                      f"{packed} are {type(args[packed[0]]).__name__}s, given to forward as they are: for forward(x) "
                      "pass example_inputs=(x,), not ((x,),)")


def _hf_checkpointing(model: nn.Module) -> bool:
    """Tell whether a Hugging Face model (or one inside ``model``: a PEFT wrapper's) has gradient checkpointing on.

    Read from the class that defines the flag: transformers 5 deprecates ``is_gradient_checkpointing``
    for ``is_activation_checkpointing`` and warns at each read of the old one, which a wrapper
    forwarding attributes (PEFT's ``PeftModel``) would otherwise reach.
    """
    for m in model.modules():
        for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(m), flag):
                return getattr(m, flag, False) is True
    return False
