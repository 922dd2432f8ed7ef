"""Build the runtime of a plan: place parameters, make the stage calls, start the runtime.

    one process   every stage's parameters on its device ─▶ StageCall per stage ─▶ LocalRuntime
    across ranks  this rank's stages on its device, tied tensors synced ─▶ StageCalls ─▶ DistributedRuntime

Tensors on ``meta`` are materialized first, each on the device of the stage that owns it (in
the distributed build, only this rank's), and filled from ``weights=`` or by ``init=``
(:mod:`fxpipe.materialize`). A tensor no stage reads belongs to stage 0. After a distributed
build the model keeps only this rank's tensors; the others become ``meta`` again.

A stage whose schedule has weight-gradient steps (``W``) runs a copy of its GraphModule
whose linears defer their weight gradients (:mod:`fxpipe.runtime.stage.wgrad`). A stage whose
policy is ``"selective"`` runs a copy that tells the stage call where each value is made
(:func:`fxpipe.runtime.stage.marks.instrument`); under ``"selective"`` and ``"offload"`` the
stage call gets the saver that places its saved tensors (:mod:`fxpipe.runtime.stage.selective`,
:mod:`fxpipe.runtime.stage.offload`). With ``torch_compile=`` every stage's callable is compiled
instead (:class:`~fxpipe.runtime.stage.compiled.CompiledStage`; the compiled backward splits I
and W itself): compiling is lazy, so it happens at a stage's first call, after materialization
and after data parallel wrapped the stage module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten

from fxpipe.errors import CompileError, PeerFailure, PipelineInputError
from fxpipe.frontend.quantized import quantized_modules
from fxpipe.materialize.fill import fill
from fxpipe.materialize.fillplan import tensor_table
from fxpipe.materialize.metatensors import release
from fxpipe.materialize.weights import open_weights
from fxpipe.options import SPLIT_BACKENDS, CompileOptions, TorchCompile
from fxpipe.passes.selective import selective_plan
from fxpipe.passes.spec import TensorSpec, map_leaves
from fxpipe.plan.batches import micro_sizes
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.binding import Binding
from fxpipe.runtime.dataparallel import GradSync, views_sent_only
from fxpipe.runtime.distributed import DistributedRuntime
from fxpipe.runtime.dpparams import check_embeddings, check_layouts
from fxpipe.runtime.local import LocalRuntime
from fxpipe.runtime.placement import move_owned, named_tensors, ownership, stage_callable, warn_shared_storage
from fxpipe.runtime.replicanorms import norms_of, written_of
from fxpipe.runtime.schedules.builtin import Schedule
from fxpipe.runtime.stage.batchnorm import defer_batch_norm
from fxpipe.runtime.stage.compiled import CompiledStage
from fxpipe.runtime.stage.exportedbn import ExportedBatchNorm, defer_exported, defer_traced, share_counters
from fxpipe.runtime.stage.keepstate import written_buffers
from fxpipe.runtime.stage.marks import instrument
from fxpipe.runtime.stage.normcalls import called_more_than_once, per_call, warn_spread
from fxpipe.runtime.stage.offload import Offload
from fxpipe.runtime.stage.selective import Program, foreign_wrap
from fxpipe.runtime.stage.stagecall import StageCall
from fxpipe.runtime.stage.unfrozen import watch_frozen, watch_inputs
from fxpipe.runtime.stage.wgrad import defer_weight_grads
from fxpipe.runtime.target import Target
from fxpipe.runtime.tensorparallel import shard_stages
from fxpipe.runtime.transport.comm import Comm
from fxpipe.runtime.transport.procgroup import Layout, tied_groups

__all__ = ["Built", "Materials", "build", "build_distributed", "build_local", "check_policies", "stage_call"]

log = logging.getLogger(__name__)


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
        with self.filling(model) as fill_some:
            fill_some(placement)

    @contextmanager
    def filling(self, model: nn.Module) -> Iterator[Callable[[Mapping[int, torch.device]], None]]:
        """Open the weights once; yield a function filling the placed tensors it is given, as often as asked."""
        source = None if self.weights is None else open_weights(self.weights)
        try:
            yield lambda placement: fill(model, placement, source=source, init=self.init, seed=self.seed)
        finally:
            if source is not None:
                source.close()


@dataclass
class Built:
    """A started runtime, the device of each stage as this process sees it, the FQNs it holds (None: all)."""

    runtime: Any
    devices: list[torch.device]
    owned: set[str] | None


def build(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan, stages: Sequence[torch.fx.GraphModule],
          options: CompileOptions, target: Target) -> Built:
    """Start ``plan``'s runtime where ``target`` says: every stage in this process, or this rank's."""
    materials = Materials(target.weights, options.init, options.seed)
    check_policies(plan, [target.layout.device] * plan.n_stages if target.layout is not None else target.devices,
                   compiled=options.compiled is not None)
    if target.layout is None:
        local = build_local(model, gm, plan, stages, target.devices, target.schedule, options.deferred_batch_norm,
                            materials, options.compiled, save=options.save)
        return Built(local, target.devices, None)
    layout = target.layout
    assert target.link is not None
    for s in plan.stages:
        s.device = f"{_ranks_of(layout, s.on_rank)} ({layout.device.type})"  # the same on every rank
    devices = [layout.device if r == layout.rank else torch.device("meta") for r in target.schedule.ranks]
    engine, keep = build_distributed(model, gm, plan, stages, layout, target.link, options.timeout, target.schedule,
                                     options.deferred_batch_norm, shard=options.data_parallel_shard, materials=materials,
                                     compiled=options.compiled, save=options.save)
    owned = {n for key, info in tensor_table(model).items() if key in keep for n in info.names}
    return Built(engine, devices, owned)


def _ranks_of(layout: Any, on_rank: int) -> str:
    """Name the global ranks that run pipeline rank ``on_rank`` (its tensor-parallel group, every replica's)."""
    ranks = sorted(row[on_rank] for row in layout.pipelines())
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks))}" if len(ranks) <= 4 else \
        f"pipeline rank {on_rank} ({len(ranks)} ranks)"


def _unread(model: nn.Module, stages: Sequence[torch.fx.GraphModule]) -> set[int]:
    """Return the ids of the model's tensors that no stage reads (they belong to stage 0)."""
    read = {id(t) for st in stages for _, t in named_tensors(st)}
    return {id(t) for _, t in named_tensors(model) if id(t) not in read}


def _defer_exported(stages: Sequence[torch.fx.GraphModule],
                    compiled: TorchCompile | None) -> list[ExportedBatchNorm]:
    """Make the stages' batch norm calls (exported; fx through a subclass's forward) defer their updates.

    Run before any stage is wrapped.
    """
    exported = [record for st in stages for record in defer_exported(st)]
    if exported and compiled is not None:
        raise CompileError("deferred_batch_norm=True in an exported graph cannot run in compiled stages "
                           "(torch_compile=): use tracer='fx', whose batch norm modules defer inside "
                           "compiled stages too, or leave out torch_compile=")
    traced = [record for st in stages for record in defer_traced(st)]
    if traced and compiled is not None:
        raise CompileError(f"deferred_batch_norm=True cannot defer {traced[0].fqn} (a batch norm subclass with its "
                           "own forward, which fx traced through) in compiled stages (torch_compile=): leave out "
                           "torch_compile= or deferred_batch_norm=")
    share_counters(exported + traced)
    return exported + traced


def _modules_to_defer(stages: Mapping[int, torch.fx.GraphModule], records: Sequence[ExportedBatchNorm],
                      compiled: TorchCompile | None) -> list:
    """Defer the stages' batch norm modules, once each, but those whose calls a record defers already.

    A module called more than once gets an update per call (:mod:`~fxpipe.runtime.stage.normcalls`).
    """
    covered = {id(r.running_mean) for r in records}
    modules = [m for m in {id(m): m for st in stages.values() for m in st.modules()}.values()
               if id(getattr(m, "running_mean", None)) not in covered]
    own = next((m for m in modules if isinstance(m, _BatchNorm) and m.track_running_stats
                and type(m).forward is not _BatchNorm.forward), None)
    if own is not None and compiled is not None:
        raise CompileError(f"deferred_batch_norm=True cannot defer {type(own).__name__} (a batch norm subclass with "
                           "its own forward, kept whole) in compiled stages (torch_compile=): leave out "
                           "torch_compile= or deferred_batch_norm=")
    deferred = per_call(defer_batch_norm(modules), stages)
    twice = called_more_than_once(deferred)
    if twice and compiled is not None:
        names = {id(m): n for st in stages.values() for n, m in st.named_modules()}
        raise CompileError(f"deferred_batch_norm=True cannot tell the calls of batch norm '{names.get(id(twice[0]))}' "
                           "apart in compiled stages (torch_compile=): it is called more than once per forward, and "
                           "each call updates the running statistics. Leave out torch_compile= or deferred_batch_norm=")
    return deferred


def _runnable(gm: torch.fx.GraphModule, j: int, defer: set[int], policy: str,
              compiled: TorchCompile | None) -> torch.fx.GraphModule:
    """Return the module stage ``j`` runs: its linears defer weight gradients if its schedule has W,
    and it marks where values are made under selective recomputation.

    A compiled stage runs its own module: its compiled backward splits I and W.
    """
    runnable = defer_weight_grads(gm) if j in defer and compiled is None else gm
    runnable = instrument(runnable) if policy == "selective" else runnable
    if runnable is not gm:
        _follow_mode(runnable, gm)
    return runnable


def _follow_mode(copy: torch.fx.GraphModule, stage: torch.fx.GraphModule) -> None:
    """Make ``copy`` report ``stage``'s mode, which ``pipe.train()``/``pipe.eval()`` set.

    A graph whose model reads ``self.training`` reads its module's ``training`` when it runs
    (:mod:`fxpipe.passes.modes`); the copy a stage runs is not among the pipe's modules.
    GraphModule gives every instance a class of its own, so the property is the copy's alone.
    """
    type(copy).training = property(lambda _: stage.training, lambda _, mode: None)  # type: ignore[assignment]


def _stage_fn(fn: Callable, gm: torch.fx.GraphModule, j: int, defer: set[int],
              compiled: TorchCompile | None, policy: str) -> Callable:
    """Return what stage ``j``'s call runs: ``fn``, or ``fn`` under torch.compile.

    A stage that never recomputes runs one graph (its forward with grad), which starts static;
    one that recomputes runs two (the no-grad forward and the recomputation), which start with
    dim 0 dynamic so that a new micro-batch size does not compile both again.
    """
    if compiled is None:
        return fn
    if j in defer and not compiled.splits_backward:
        raise CompileError(f"stage {j}'s schedule has W steps, which split its backward into I and W: fxpipe does "
                           f"that for compiled stages with the backends {', '.join(map(repr, SPLIT_BACKENDS))}, not "
                           f"{compiled.name!r}; use one of them, or a schedule without W")
    return CompiledStage(fn, gm, j, compiled, defer=j in defer, static_first=policy in ("never", "offload"))


def check_policies(plan: PipelinePlan, devices: Sequence[torch.device], compiled: bool = False) -> None:
    """Refuse ``"offload"`` for a stage whose device is not a CUDA device (before anything moves)."""
    for j, policy in enumerate(plan.policies()):
        if policy == "offload" and torch.device(devices[j]).type != "cuda":
            others = "'except_last' or 'always'" if compiled else "'selective', 'except_last' or 'always'"
            raise ValueError(f"checkpoint='offload' moves stage {j}'s saved activations to pinned host memory on "
                             f"a side stream, which needs a CUDA device, but stage {j} runs on "
                             f"{torch.device(devices[j])}; use {others} there to save its activation memory")


def stage_call(j: int, stage: torch.fx.GraphModule, runnable: torch.fx.GraphModule, policy: str,
               foreign: Sequence[str], device: torch.device, last: bool, defer: set[int],
               compiled: TorchCompile | None = None, save: Callable[[torch.fx.Node], bool] | None = None) -> StageCall:
    """Return stage ``j``'s call: its runnable module on ``device``, with the saver of its policy.

    ``stage`` is the stage's own GraphModule (what ``save=`` judges), ``runnable`` the copy it
    runs (:func:`_runnable`); under ``torch_compile=`` the call runs it compiled.
    """
    fn = _stage_fn(stage_callable(runnable, list(foreign), device), runnable, j, defer, compiled, policy)
    call = StageCall(j, fn, runnable, device, last)
    if policy == "selective":
        call.saver = Program(runnable, selective_plan(stage, save=save), device, j,
                             foreign_wrap(runnable, foreign, device))
    elif policy == "offload":
        call.saver = Offload(runnable, device, j)
    return call


def build_local(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                schedule: Schedule, deferred_batch_norm: bool,
                materials: Materials | None = None, compiled: TorchCompile | None = None,
                save: Callable[[torch.fx.Node], bool] | None = None) -> LocalRuntime:
    """Move every stage's tensors to its device and return the one-process runtime."""
    own = ownership(stages, devices)
    if materials is not None and materials.needed(model):
        placement = {key: devices[j] for key, j in own.owner.items()}
        placement.update({key: devices[0] for key in _unread(model, stages)})
        materials.fill(model, placement)
    move_owned([model, gm, *stages], own, devices)
    defer = schedule.deferring(plan.chunks)
    policies = plan.policies()
    exported = _defer_exported(stages, compiled) if deferred_batch_norm else []
    runnables = [_runnable(st, j, defer, policies[j], compiled) for j, st in enumerate(stages)]
    n = plan.n_stages
    calls = [stage_call(j, stages[j], r, policies[j], own.foreign[j], devices[j], j == n - 1, defer, compiled, save)
             for j, r in enumerate(runnables)]
    if any(torch.device(d).type == "cpu" for d in devices):  # a CPU stage draws on another thread: stage/rng.py
        for call in calls:
            call.replay_cpu = torch.device(call.device).type != "cuda"
            if isinstance(call.saver, Program):
                call.saver.replay_cpu = call.replay_cpu
    engine = LocalRuntime(plan, calls, Binding(gm, fixed=schedule.custom is not None), schedule)
    warn_spread(stages, deferred_batch_norm)
    engine.unfrozen = watch_frozen(plan, gm, dict(enumerate(stages)))
    engine.routeless = watch_inputs(plan, gm)
    if deferred_batch_norm:
        engine.deferred = _modules_to_defer(dict(enumerate(stages)), exported, compiled) + exported
    return engine


def build_distributed(model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                      stages: Sequence[torch.fx.GraphModule], layout: Layout, link: Comm, timeout: float,
                      schedule: Schedule, deferred_batch_norm: bool, shard: bool = False,
                      materials: Materials | None = None, compiled: TorchCompile | None = None,
                      save: Callable[[torch.fx.Node], bool] | None = None) -> tuple[DistributedRuntime, set[int]]:
    """Keep this rank's stages on its device, sync tied tensors, wrap them for data parallel.

    Return the runtime and the ids of the tensors this rank keeps: its stages', and on the
    first rank those no stage reads; every other tensor of the model is made ``meta`` (freed)
    on this rank.
    """
    device, mine = layout.device, schedule.stages_of(layout.rank)
    held = [stages[j] for j in mine]
    _refuse_quantized(model)  # every rank alike, before any waits on another
    warn_shared_storage(stages, schedule.ranks)  # before the moves, which part what shared storage
    if layout.dp > 1:  # every rank asks it of every rank's stages, so all refuse alike
        for r in sorted(set(schedule.ranks)):
            _refuse_shared_on_one_rank([stages[j] for j in schedule.stages_of(r)], schedule.stages_of(r))
        if shard:
            _refuse_sharded_writes(stages)
    unread = _unread(model, stages) if layout.rank == 0 else set()
    tp = gm.meta.get("fxpipe.tp_plan") if layout.tp > 1 else None
    if materials is not None and materials.needed(model):
        error: BaseException | None = None
        try:
            with materials.filling(model) as fill_some:
                if tp is not None:  # module by module, each sharded once filled
                    shard_stages(model, gm, stages, mine, tp, layout, lambda ids: fill_some(dict.fromkeys(ids, device)))
                fill_some({id(t): device for st in held for _, t in named_tensors(st) if not hasattr(t, "to_local")}
                          | {key: device for key in unread})
        except Exception as exc:  # noqa: BLE001 - every rank hears of it before any raises
            error = exc
        _agree(link, layout, mine, error)
    elif tp is not None:
        shard_stages(model, gm, stages, mine, tp, layout, None)
    move_owned([model, gm, *stages], ownership(held, [device] * len(held)), [device] * len(held))
    tied = tied_groups(stages, schedule.ranks, layout, timeout)
    defer = schedule.deferring(plan.chunks)
    n = plan.n_stages
    policies = plan.policies()
    exported = _defer_exported(held, compiled) if deferred_batch_norm else []
    runnable = {j: _runnable(stages[j], j, defer, policies[j], compiled) for j in mine}
    calls = [stage_call(j, stages[j], r, policies[j], [], device, j == n - 1, defer, compiled, save)
             for j, r in runnable.items()]
    engine = DistributedRuntime(plan, gm, layout, calls, link, Binding(gm, fixed=schedule.custom is not None), tied,
                                schedule)
    _refuse_sizes_from_values(engine, gm, plan)  # every rank alike, before any waits on another
    _refuse_remote_generators(gm, plan)
    warn_spread(stages, deferred_batch_norm, [s.on_rank for s in plan.stages])
    if layout.dp > 1:  # every rank looks at every stage, so each refuses what one of them cannot reduce
        for j, st in enumerate(stages):
            check_embeddings(j, st, shard)
            check_layouts(j, st, shard)
    if layout.dp > 1:  # after the tied tensors are equal: DDP, FSDP2 (or TP's own all-reduce) start from these
        engine.grad_sync = GradSync(runnable, layout, shard, share_with=[model, gm, *stages, *runnable.values()],
                                    after_step=[j for j in runnable if plan.stages[j].maybe_unused])
        for call in calls:
            if shard and not call.last:
                call.around = views_sent_only
        swapped = engine.grad_sync.swapped  # tied parameters FSDP2 sharded: sum the shards' gradients
        tied.mine = [(g, [swapped.get(id(p), p) for p in ps], first) for g, ps, first in tied.mine]
    if deferred_batch_norm:
        engine.deferred = _modules_to_defer({j: stages[j] for j in mine}, exported, compiled) + exported
    if layout.dp > 1:
        engine.norms, engine.written = norms_of(held), written_of(held)
    engine.unfrozen = watch_frozen(plan, gm, {j: stages[j] for j in mine})  # after FSDP2 swapped the parameters
    engine.routeless = watch_inputs(plan, gm)
    keep = {id(t) for st in held for _, t in named_tensors(st)} | unread  # after the move: moved buffers are new
    release(model, keep, also=[gm, *stages])
    return engine, keep


def _agree(link: Comm, layout: Layout, mine: Sequence[int], error: BaseException | None) -> None:
    """Tell every rank of the pipeline whether this one materialized its stages; raise if any failed."""
    rank = layout.rank
    message = None if error is None else \
        f"rank {rank} (stages {', '.join(map(str, mine))}) could not materialize its tensors: {error}"
    for r in range(layout.pp):
        if r != rank:
            link.send_object(message, r)
    theirs = [(r, link.recv_object(r, "waiting for the other ranks' weights")) for r in range(layout.pp) if r != rank]
    link.flush()
    if error is not None:
        raise error
    failed = [(r, m) for r, m in theirs if m is not None]
    if failed:
        raise PeerFailure(f"rank {rank} stopped because {failed[0][1]}")


def _refuse_shared_on_one_rank(held: Sequence[torch.fx.GraphModule], mine: Sequence[int]) -> None:
    """Refuse a tensor shared by two stages of one rank under data parallel (each stage reduces its own)."""
    seen: dict[int, int] = {}
    for j, st in zip(mine, held):
        for name, p in st.named_parameters():
            if seen.setdefault(id(p), j) != j:
                raise ValueError(f"parameter '{name}' is used by stages {seen[id(p)]} and {j}, which run on one "
                                 "rank; with data_parallel > 1 each stage reduces its own gradients, so a tensor "
                                 "cannot be shared between two stages of a rank: untie it, or place those stages "
                                 "on different ranks (another schedule or split)")


def _refuse_sharded_writes(stages: Sequence[torch.fx.GraphModule]) -> None:
    """Refuse, under FSDP2, parameters a stage's forward writes in place (a centre kept as a frozen parameter).

    FSDP2 shards the parameters and gathers them for each forward: the write went to the
    gathered copy, and the recomputation in backward crashed the process (a segfault).
    """
    for j, st in enumerate(stages):
        params = dict(st.named_parameters())
        written = [n for n in written_buffers(st) if n in params]
        if written and any(p.requires_grad for p in params.values()):  # a stage frozen whole is not sharded
            raise CompileError(
                f"stage {j}'s forward writes the parameter(s) {', '.join(written[:3])} in place, which "
                "data_parallel_shard=True (FSDP2) shards and gathers for each forward, so the write would go to a "
                "gathered copy. Keep such a tensor as a buffer (self.register_buffer(name, tensor)), which FSDP2 "
                "leaves whole and the replicas copy from the first, or use data_parallel_shard=False")


def _refuse_quantized(model: nn.Module) -> None:
    """Refuse quantized modules across ranks, where every step sizes the values crossing on fake tensors.

    Quantized kernels have no fake (meta) implementation: the first call failed on the first
    rank in torch's ``'aten::empty_strided' ... 'QuantizedMeta'``, or blamed the inputs.
    """
    found = quantized_modules(model)
    if found:
        raise PipelineInputError(
            f"{', '.join(repr(n or 'the model') for n in found[:3])} {'is a' if len(found) == 1 else 'are'} "
            "quantized module(s) (torch.ao.quantization's convert or quantize_dynamic), which run in one process "
            "only: across ranks fxpipe sizes the values crossing from fake tensors, which quantized kernels "
            "cannot make. Run the quantized model with devices=[...] in one process (or unpipelined), or "
            "pipeline the float model (quantization-aware training with fake quantization runs across ranks)")


def _refuse_remote_generators(gm: torch.fx.GraphModule, plan: PipelinePlan) -> None:
    """Refuse a ``torch.Generator`` input read by a stage on another rank than the first stage's.

    It would reach that rank as a copy of the first rank's generator, whose state never moves
    there: every step drew the same numbers (and the caller's generator never advanced).
    """
    first = plan.stages[0].on_rank
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not any(isinstance(v, torch.Generator) for v in tree_flatten(
                node.meta.get("fxpipe.value"))[0]):
            continue
        far = [st for st in plan.stages if node.name in st.inputs and st.on_rank != first]
        if far:
            raise PipelineInputError(
                f"input '{node.target}' is a torch.Generator, read by stage {far[0].index} on rank "
                f"{far[0].on_rank}; a generator cannot be shared between ranks (that rank would draw from a copy "
                "of the first rank's, the same numbers at every step). Hold it in the module that draws from it "
                "(self.gen = torch.Generator().manual_seed(s) in __init__, seeded alike on every rank), or cut "
                "the model so the stage reading it runs on the first stage's rank")


def _refuse_sizes_from_values(engine: DistributedRuntime, gm: torch.fx.GraphModule, plan: PipelinePlan) -> None:
    """Refuse a value sent between ranks whose size follows the inputs' values (a mask's selection, a packed sequence).

    A receiving rank sizes its buffers from the micro-batch's shapes, propagated on fake
    tensors; past a data-dependent op they are the example's, resized by the rows
    (:mod:`fxpipe.passes.infer`), which guesses wrong for rows a mask picks: the receiver read
    memory never written (a loss of inf, silently). Found by propagating the example's first
    micro-batch as the first step would, twice: the second time with every guessed row count
    one more (with one micro-batch too: the sizes its values give move); a value whose size
    moves with them is refused. Only where compile met a data-dependent op.
    """
    if not gm.meta.get("fxpipe.data_dependent"):
        return
    batch = next((leaf.shape[0] for spec in engine.example for leaf in tree_flatten(spec)[0]
                  if isinstance(leaf, TensorSpec) and leaf.shape), None)
    rows = micro_sizes(batch, plan.chunks)[0] if batch else None
    if not rows:
        return  # no batch to size anything by

    def shrink(leaf: Any) -> Any:
        return replace(leaf, shape=(rows, *leaf.shape[1:])) \
            if isinstance(leaf, TensorSpec) and leaf.shape and leaf.shape[0] == batch else leaf
    layout = [spec if name in engine.binding.unbatched else map_leaves(shrink, spec)
              for name, spec in zip(engine.binding.names, engine.example)]
    prop = engine.propagate.prop
    try:
        guessed = engine.propagate(layout)
        prop.skew = 1  # every guessed row count one more: what changes with it is sized by the values
        moved = engine.propagate(layout)
    except Exception as exc:  # noqa: BLE001 - the first step says why, on every rank
        log.debug("propagating the example's first micro-batch failed: %s", exc)
        return
    finally:
        prop.skew = 0
    made_by = plan.producer()
    for later in plan.stages:
        for v in later.inputs:
            stage = plan.stages[made_by[v]] if v in made_by else None
            if stage is not None and stage.on_rank != later.on_rank and guessed.get(v) != moved.get(v):
                raise PipelineInputError(
                    f"'{v}' is sent from stage {stage.index} (rank {stage.on_rank}) to stage {later.index} "
                    f"(rank {later.on_rank}), and fxpipe cannot tell its size from the inputs' shapes: it follows "
                    "their values (rows a mask picks, nonzero's indices, a packed sequence), or comes out of a "
                    "module fake tensors cannot follow (a leaf branching on a value, run on real kernels at "
                    "compile); across ranks a receiver sizes its buffers from shapes alone. Cut where the values "
                    "crossing have the batch's rows "
                    "(split_points=), or run in one process (devices=[...]), where values are handed on as "
                    "they are")
