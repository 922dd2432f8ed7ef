"""What the rank holding the first stage tells its pipeline about a step, before it runs.

It checks and splits the inputs, agrees with the other replicas on the batch size, and
sends every rank of its pipeline the micro-batch layout (batch size and the spec of each
micro-batch); each rank sizes its receive buffers from the layout (:func:`specs`,
propagated on fake tensors once per layout, autocast state and mode). Bad input is refused on
every rank of every pipeline with the same error, instead of a mismatched message.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe.errors import PipelineInputError, PropagationError
from fxpipe.frontend.export import enabled_autocast
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.passes.infer import Propagator
from fxpipe.passes.spec import map_leaves
from fxpipe.runtime.microbatch import check_target_rows
from fxpipe.runtime.stage.stagecall import autocast_state
from fxpipe.runtime.stage.unfrozen import refuse_input_grads
from fxpipe.runtime.transport import callstate
from fxpipe.runtime.transport.comm import on_every_rank, tell_all
from fxpipe.runtime.transport.samebatch import digest, glance, target_glance
from fxpipe.runtime.transport.tpinputs import from_tp_holder, group_names, inputs_given
from fxpipe.runtime.validate import check_signature

__all__ = ["call_name", "check_signature", "holders", "publish", "receive", "specs_for", "take_call_word",
           "tell_all"]

CALL_WORD = "pipe(x)"  # the loss rank's word on a pipe(x) call (a step's says whether it has a target)


def holders(runtime: Any, pipeline_rank: int, what: str) -> str:
    """Name the global rank(s) at ``pipeline_rank`` of every replica, saying they hold ``what``."""
    layout = runtime.layout
    rows = layout.pipelines()  # replica-major, then tp index
    if layout.tp > 1:  # a tensor-parallel group takes the inputs and the target from whichever of its ranks has them
        groups = [" or ".join(str(rows[d * layout.tp + k][pipeline_rank]) for k in range(layout.tp))
                  for d in range(len(rows) // layout.tp)]
        return (f"rank {'; '.join(groups)} ({what}: any rank of {'each' if len(groups) > 1 else 'its'} "
                "tensor-parallel group, whose ranks all use the values given on one)")
    ranks = [row[pipeline_rank] for row in rows]
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({what})"
    return f"ranks {', '.join(map(str, ranks))} ({what} in each of the {len(ranks)} replicas)"


def _refuse_missing_inputs(runtime: Any, values: list[Any], stepping: bool) -> None:
    """Refuse a step whose inputs are missing on the rank that splits them, naming the ranks that need them."""
    if values and all(v is None for v in values) and any(
            isinstance(leaf, TensorSpec) for leaf in tree_flatten(runtime.example)[0]):
        last = (f"the target goes to {holders(runtime, runtime.last_rank, 'the last stage, which computes the loss')}"
                if stepping else f"the output comes back on {holders(runtime, runtime.last_rank, 'the last stage')}")
        layout = runtime.layout
        if layout.tp > 1:  # no rank of this group had inputs: any of them may hold the group's
            rows = layout.pipelines()
            mine = " and ".join(str(rows[layout.replica * layout.tp + k][runtime.first]) for k in range(layout.tp))
            replica = f" (replica {layout.replica}'s first stage)" if len(rows) > layout.tp else ""
            raise PipelineInputError(
                f"{'pipe.step' if stepping else 'pipe(...)'} got no inputs on any rank of the tensor-parallel group "
                f"of ranks {mine}{replica}: pass the inputs on {holders(runtime, runtime.first, 'the first stage')} "
                f"(or on every rank); the other ranks may pass None ({last})")
        raise PipelineInputError(
            f"{'pipe.step' if stepping else 'pipe(...)'} got no inputs on rank {dist.get_rank()}, which splits them "
            f"into micro-batches: pass the inputs on {holders(runtime, runtime.first, 'the first stage')}; the other "
            f"ranks may pass None ({last})")


Verdict = str | tuple[str, str] | None  # the loss rank's check of the target: a refusal, with its kind, or none
_KINDS: dict[str, type[Exception]] = {"TypeError": TypeError, "RuntimeError": RuntimeError}


def rebuilt(kind: str, message: str) -> Exception:
    """Return the error another rank raised, as this rank raises it: the same kind where it is a refusal's own."""
    return _KINDS.get(kind, PipelineInputError)(message)


def call_name(stepping: bool) -> str:
    """Name the call a rank made: ``pipe.step`` or ``pipe(...)``."""
    return "pipe.step" if stepping else "pipe(...)"


def other_call(runtime: Any, rank: int, stepping: bool, first_stepping: bool) -> str:
    """Refuse pipeline rank ``rank``'s call (``stepping`` or not) that is not the first stage's rank's."""
    g = runtime.layout.global_ranks
    return (f"rank {g[rank]} called {call_name(stepping)} but rank {g[runtime.first]} (the first stage's) called "
            f"{call_name(first_stepping)}: every rank of a pipeline makes the same call, pipe.step(x, target=, "
            "loss_fn=) to train and pipe(x) to infer (the other ranks may pass None as inputs)")


def _agree_on_batch(batch: int | None, group: Any, replica: int, device: torch.device,
                    failure: str | None = None, stepping: bool = True, reduction: str = "mean",
                    loss_target: bool | None = None, lacking: Callable[[list[int]], str] | None = None) -> None:
    """Refuse a step whose replicas hold different batch sizes or calls, or that another replica refused, naming them.

    One all-reduce of seven integers (the largest size, the negated smallest, whether a replica
    refused its inputs, the largest and negated smallest call kind, whether a replica's loss rank
    has a target and whether one has none) per step; only when they say so are the sizes and
    refusals gathered. A replica that refused its inputs (``failure``) takes part too, so the
    others refuse the step with it instead of waiting for it in their gradient reductions.
    ``loss_target`` is whether this replica's loss rank has a target (``None``: not told, the
    first step, which :func:`check_target` compares); ``lacking(replicas)`` says this one has none
    where those have one.
    """
    size = -1 if batch is None else batch
    call = 0 if not stepping else 1 if reduction == "mean" else 2  # pipe(x), a mean step, a summed step
    bounds = torch.tensor([size, -size, int(failure is not None), call, -call, int(loss_target is True),
                           int(loss_target is False)], dtype=torch.int64, device=device)  # NCCL: on the GPU
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    if int(bounds[0]) == -int(bounds[1]) and not int(bounds[2]) and int(bounds[3]) == -int(bounds[4]) and \
            not (int(bounds[5]) and int(bounds[6])):
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (batch, failure, stepping, reduction, loss_target), group=group)
    if failure is not None:
        return  # this replica raises its own refusal
    for other, (_, refused, *_) in enumerate(gathered):
        if refused is not None:
            raise PipelineInputError(f"replica {other} refused this step ({refused}); the replicas run each step "
                                     f"together, so replica {replica} did not run it either")
    given = [other for other, told in enumerate(gathered) if told[4] is True]
    lacks = [other for other, told in enumerate(gathered) if told[4] is False]
    if given and lacks:  # a replica's loss rank without the target the others have: its loss_fn would fail alone
        if loss_target is False and lacking is not None:
            raise PipelineInputError(lacking(given))
        raise PipelineInputError(f"replica {lacks[0]} refused this step (its loss rank has no target, replica "
                                 f"{', '.join(map(str, given))}'s has); the replicas run each step together, so "
                                 f"replica {replica} did not run it either")
    for other, (_, _, called, theirs, _) in enumerate(gathered):
        if called != stepping:
            raise PipelineInputError(
                f"replica {replica} called {call_name(stepping)} but replica {other} called {call_name(called)}; "
                "the replicas run each step together: make the same call on every rank")
        if stepping and theirs != reduction:
            raise PipelineInputError(
                f"replica {replica} called pipe.step with loss_reduction={reduction!r} but replica {other} with "
                f"{theirs!r}: the replicas average their gradients, which would mix two weightings of the loss. "
                "Pass the same loss_reduction= (and loss_fn=) on every rank")
    for other, (size, *_) in enumerate(gathered):
        if size != batch and None in (size, batch):
            odd, other_size = (replica, size) if batch is None else (other, batch)
            raise PipelineInputError(
                f"replica {odd}'s inputs hold no tensor with a batch dim (a str, a number or None where the model "
                f"takes a tensor?) but the other replicas' have {other_size} rows: pass the same kinds of inputs on "
                "the first stage's rank of every replica")
        if size != batch:
            why = ("every replica averages its gradients with the others', so give each the same batch size (drop "
                   "the uneven last batch: DistributedSampler(..., drop_last=True) or DataLoader(..., drop_last=True); "
                   "or pad it)" if stepping else
                   "the replicas run each call together, micro-batch by micro-batch, so give each the same batch "
                   "size: pad the short batch (an evaluation loses no rows that way: drop the padded rows from the "
                   "outputs)")
            raise PipelineInputError(f"replica {replica} has a batch of {batch} rows but replica {other} has {size}; "
                                     + why)


def publish(runtime: Any, args: tuple, kwargs: dict, training: bool, has_target: bool = False,
            stepping: bool = True, target: Any = None, check_batch: bool = False,
            refusal: BaseException | None = None) -> tuple[dict, list[list[Any]]]:
    """On the first stage's rank: check and split the inputs, send the layout; return it and the micro-batches.

    A ``target`` given here is checked against the inputs' batch size, so that a wrong one is
    refused on every rank with the same error (not first met on the loss's rank).

    The layout carries, for each micro-batch layout the pipeline has not seen, the spec of every
    value crossing a stage boundary (propagated here on fake tensors), so that the other ranks
    size their receive buffers for a new sequence length without propagating it themselves.
    With ``check_batch`` it carries digests of the inputs and the target, which the other ranks
    compare with theirs (:mod:`~fxpipe.runtime.transport.samebatch`). A ``refusal`` of this rank's
    ``pipe.step`` arguments, or one the loss's rank sent, is refused here the same way.
    """
    (args, kwargs), has_target = from_tp_holder(runtime, (args, kwargs), inputs_given(args, kwargs), has_target)
    runtime.call_word_due = not stepping and runtime.target_checked and runtime.last_rank != runtime.rank
    loss_has = True  # after the first step, the loss's rank says (tell_target_given)
    if stepping and runtime.target_checked and runtime.last_rank != runtime.rank:
        loss_has = runtime.comm.recv_object(runtime.last_rank, "waiting for the loss rank to say whether it has a target")
    agreed = runtime.layout.dp == 1  # the replicas' first ranks meet once per step, refusing or not
    try:
        if refusal is not None:
            raise refusal
        if loss_has == CALL_WORD:  # the loss's rank called pipe(x)
            raise PipelineInputError(other_call(runtime, runtime.last_rank, stepping=False, first_stepping=True))
        if isinstance(loss_has, dict):  # the loss's rank refused its pipe.step arguments
            kind, message = loss_has["refused"]
            raise rebuilt(kind, message)
        if isinstance(loss_has, tuple):  # its word on the target, and the state it steps under
            loss_has, theirs = loss_has
            g = runtime.layout.global_ranks
            wrong = callstate.mismatch(g[runtime.last_rank], theirs, g[runtime.rank],
                                       callstate.state(training, runtime.reduction))
            if wrong is not None:
                raise PipelineInputError(wrong)
        if not args and not kwargs:  # a model taking keywords only gets nothing to bind on this rank
            _refuse_missing_inputs(runtime, [None], stepping)
        try:
            values = runtime.binding.bind(args, kwargs)
        except TypeError as exc:  # some inputs given here, others not: they may have gone to another rank
            raise TypeError(f"{exc}; on rank {dist.get_rank()}, which splits the inputs into micro-batches. Every "
                            f"input of the model (labels= too, where the model computes its own loss) goes to "
                            f"{holders(runtime, runtime.first, 'the first stage')}; only target= goes to "
                            f"{holders(runtime, runtime.last_rank, 'the last stage')}") from None
        _refuse_missing_inputs(runtime, values, stepping)
        if has_target and not loss_has:
            raise PipelineInputError(_missing_target(runtime))
        check_signature(runtime.binding.names, spec_of(values), runtime.example)
        mbs, batch = runtime.binding.split(args, kwargs, runtime.plan.chunks, training, runtime.device)
        check_target_rows(target, batch, len(mbs))
        if stepping and mbs:  # a model input requiring grad that a later stage reads without a route back
            refuse_input_grads(runtime.routeless, mbs[0])
        if not stepping:  # pipe(x): outputs the last rank could not join are refused here, on every rank
            runtime.binding.check_joinable(len(mbs), training)
        specs = [spec_of(mb) for mb in mbs]
        if not agreed:
            agreed = True
            told = stepping and runtime.target_checked  # later steps: this replica's loss rank told its word
            _agree_on_batch(batch, runtime.layout.dp_group, runtime.layout.replica, runtime.device,
                            stepping=stepping, reduction=runtime.reduction,
                            loss_target=(has_target if runtime.last_rank == runtime.rank else bool(loss_has))
                            if told else None, lacking=partial(_lacking, runtime))
        new = _propagate(runtime, specs, training)
    except Exception as exc:
        if not isinstance(exc, (TypeError, ValueError, PropagationError)) and exc is not refusal:
            raise  # a failure, not a refusal: told as a failed step
        if not agreed:
            _agree_on_batch(None, runtime.layout.dp_group, runtime.layout.replica, runtime.device, failure=str(exc),
                            stepping=stepping, reduction=runtime.reduction)
        told = f"rank {dist.get_rank()} (the first stage's): {exc}" if exc is refusal else str(exc)
        tell_all(runtime, {"error": (type(exc).__name__, told)})
        if not stepping:  # the loss rank's word, sent before it reads this: a step's waits for it to be read
            take_call_word(runtime, check=False)
        runtime.comm.flush()  # deliver it before this rank's exception ends the process
        if isinstance(exc, PropagationError):
            exc = PipelineInputError(f"the inputs cannot run through the model: {exc} (found on fake tensors before the step: nothing ran)")
        raise on_every_rank(exc) from None
    header = {"batch": batch, "specs": specs, "layouts": new, "target_on_first": has_target, "training": training,
              "call": call_name(stepping), "autocast": enabled_autocast()}
    if stepping:
        header["reduction"] = runtime.reduction
    if check_batch:
        header["digest"] = digest(values)
        header["target_digest"] = None if target is None else digest(target)
    elif runtime.world > 1 and runtime.layout.tp == 1:  # later steps: a glance, which ranks given values compare
        header["glance"] = (glance(values), target_glance(runtime, target))  # ZB-V: its loss may write it
    tell_all(runtime, header)
    return header, mbs


def _lacking(runtime: Any, given: list[int]) -> str:
    """Refuse this replica's step whose loss rank has no target where replicas ``given`` have one."""
    return (f"pipe.step got target=None on {group_names(runtime)[runtime.last_rank]}, which computes replica "
            f"{runtime.layout.replica}'s loss, but a target on replica {', '.join(map(str, given))}'s: "
            f"{_target_fix(runtime)}")


def _target_fix(runtime: Any) -> str:
    """Say where the target goes."""
    return (f"pass the target on {holders(runtime, runtime.last_rank, 'the last stage')} (pipe.plan.stages[-1].on_rank "
            "is its pipeline rank); passing the inputs and the target on every rank is fine")


def _missing_target(runtime: Any) -> str:
    """Refuse a target given on the first stage's rank(s) that the loss's rank(s) lack."""
    ranks, one = group_names(runtime), runtime.layout.tp == 1
    given = ranks[runtime.first] if one else f"the first stage's tensor-parallel group ({ranks[runtime.first]})"
    return (f"pipe.step got a target on {given}, which split{'s' if one else ''} the inputs, but "
            f"target=None on {ranks[runtime.last_rank]}, which compute{'s' if one else ''} the loss: "
            f"{_target_fix(runtime)}")


def tell_target_given(runtime: Any, stepping: bool, target: Any, training: bool = True,
                      refusal: BaseException | None = None) -> None:
    """On the loss's rank, after the first step: tell the first rank whether this step has a target (see above),
    and the state it steps under (:mod:`~fxpipe.runtime.transport.callstate`), or its refusal of its arguments.

    In ``pipe(x)`` the word only says so (:data:`CALL_WORD`): a first rank that steps then refuses
    the mixed calls on every rank at once, where it waited ``timeout=`` for a word that never came.
    The first rank of ``pipe(x)`` reads it once its own sends are posted (:func:`take_call_word`),
    so it runs its forwards without waiting for the last rank's previous call. The first stage's
    rank finishes a step last, so its wait for a step's word costs nothing.
    """
    if runtime.target_checked and runtime.rank == runtime.last_rank != runtime.first:
        word = (CALL_WORD if not stepping else {"refused": _refused(runtime, refusal)} if refusal is not None else
                (target is not None, callstate.state(training, runtime.reduction)))
        runtime.comm.send_object(word, runtime.first)
        if stepping:  # pipe(x)'s leaves with the call's last sends: the first rank reads it after its forwards
            runtime.comm.flush()


def take_call_word(runtime: Any, check: bool = True) -> None:
    """On the first stage's rank in ``pipe(x)``: read the loss rank's word on the call, once; refuse a step's.

    Read once this rank's sends are posted and before it waits for them (a loss rank that
    steps instead waits for its word to be read before it reads them), or before the first
    other message the call receives from the loss's rank (the first call's batch check).
    """
    if runtime.call_word_due:
        runtime.call_word_due = False
        word = runtime.comm.recv_object(runtime.last_rank, "waiting for the loss rank's word on this pipe(x)")
        if check and word != CALL_WORD:  # it stepped (and refused the call itself, unless this rank's sends were buffered)
            raise PipelineInputError(other_call(runtime, runtime.last_rank, stepping=True, first_stepping=False))


def _refused(runtime: Any, exc: BaseException) -> tuple[str, str]:
    """Return this rank's refusal ``exc`` of its ``pipe.step`` arguments as the other ranks raise it (kind, message)."""
    me = runtime.layout.global_ranks[runtime.rank]
    return type(exc).__name__, str(exc) if str(exc).startswith(f"rank {me}") else f"rank {me} (the loss's): {exc}"


def check_target(runtime: Any, target: Any, on_first: bool, batch: int | None = None,
                 refusal: BaseException | None = None) -> None:
    """Refuse on every rank a step whose loss's rank has no target while another rank was given one.

    Asked of every rank on a pipe's first step, before anything is computed. When the first rank
    (whose header says whether it has a target) has one, the loss's rank tells every rank whether
    it has one too. When the first rank computes the loss itself (``schedule="zbv"``: rank 0 holds
    the first and the last stage) and has none, the other ranks tell it whether they were given
    one, and it tells them its verdict. When only the loss's rank may hold the target (the way
    the docs show), it checks the target's rows against the header's ``batch`` and tells every
    rank. Under data parallel the replicas then compare verdicts and whether each loss's rank has
    a target, so that one replica's missing target is refused by all. Later steps cost less (a
    script passes its arguments the same way every step): the loss's rank tells the first rank
    whether it has a target before the layout is sent (:func:`tell_target_given`), and
    :func:`publish` refuses a target on the first rank that the loss's lacks, on every rank.
    """
    if runtime.target_checked:
        return
    loss_rank, ranks, fix = runtime.last_rank, group_names(runtime), _target_fix(runtime)
    missing = _missing_target(runtime)
    verdict: Verdict = None
    has = on_first  # whether this replica's loss rank has a target (told where only it knows)
    if runtime.first != loss_rank and on_first:
        if runtime.last:
            verdict = _refused(runtime, refusal) if refusal is not None else None if target is not None else missing
            tell_all(runtime, verdict)
            runtime.comm.flush()
        else:
            verdict = runtime.comm.recv_object(loss_rank, "waiting for the loss rank's check of the target")
    elif runtime.first == loss_rank and not on_first:
        if runtime.last:
            given = [ranks[r].removeprefix("ranks ").removeprefix("rank ") for r in range(runtime.world)
                     if r != runtime.rank and
                     runtime.comm.recv_object(r, "waiting for the other ranks to say whether they have a target")]
            verdict = None if not given else (
                f"pipe.step got target=None on {ranks[runtime.rank]}, which computes the loss (it holds the "
                f"first and the last stage), but a target on rank {', '.join(map(str, given))}: {fix}")
            tell_all(runtime, verdict)
            runtime.comm.flush()
        else:
            runtime.comm.send_object(from_tp_holder(runtime, None, False, target is not None)[1], loss_rank)
            runtime.comm.flush()
            verdict = runtime.comm.recv_object(loss_rank, "waiting for the loss rank's check of the target")
    elif runtime.first != loss_rank:  # only the loss's rank may hold the target: it checks it before anything runs
        if runtime.last:
            verdict, has = _loss_rank_verdict(runtime, target, batch)
            if refusal is not None:  # the loss rank's refusal of its arguments, told as its verdict
                verdict = _refused(runtime, refusal)
            tell_all(runtime, (verdict, has))
            runtime.comm.flush()
        else:
            verdict, has = runtime.comm.recv_object(loss_rank, "waiting for the loss rank's check of the target")
    if runtime.layout.dp > 1:  # a replica refusing alone would leave the others waiting in their reductions
        verdict = _replicas_verdict(runtime, verdict, has, fix)
    if verdict is not None:  # a refusal of the loss rank's arguments keeps its kind on every rank
        raise on_every_rank(PipelineInputError(verdict) if isinstance(verdict, str) else rebuilt(*verdict))
    runtime.target_checked = True


def _loss_rank_verdict(runtime: Any, target: Any, batch: int | None) -> tuple[Verdict, bool]:
    """On the loss's rank: refuse a target whose rows are not the inputs'; say whether it has one."""
    try:
        check_target_rows(target, batch, min(runtime.plan.chunks, batch or 1))  # the micro-batches: at most a row each
        verdict = None
    except ValueError as exc:
        verdict = str(exc)
        if verdict.startswith("target has"):  # the two sizes come from two ranks: name them
            me = dist.get_rank()
            row = next(r for r in runtime.layout.pipelines() if me in r)
            verdict = verdict.replace("; give the target", f" (the target given on rank {me}, the loss's; the inputs "
                                      f"on rank {row[runtime.first]}, the first stage's); give the target", 1)
    _, has = from_tp_holder(runtime, None, False, target is not None)  # tensor parallel: any rank of the stage's
    _, bad = from_tp_holder(runtime, None, False, verdict is not None)
    if bad and verdict is None:
        verdict = "another rank of the last stage's tensor-parallel group was given a target of another batch size"
    return verdict, has


def _replicas_verdict(runtime: Any, verdict: Verdict, has: bool, fix: str) -> Verdict:
    """Compare every replica's verdict and whether its loss's rank has a target; return this rank's verdict."""
    seen: list[Any] = [None] * dist.get_world_size(runtime.layout.dp_group)
    dist.all_gather_object(seen, (verdict, has), group=runtime.layout.dp_group)
    if verdict is not None:
        return verdict
    given = [r for r, (_, had) in enumerate(seen) if had]
    if given and not has:
        return (f"pipe.step got target=None on {group_names(runtime)[runtime.last_rank]}, which computes replica "
                f"{runtime.layout.replica}'s loss, but a target on replica {', '.join(map(str, given))}'s: {fix}")
    other = next(((r, v) for r, (v, had) in enumerate(seen) if v is not None or (given and not had)), None)
    if other is not None:
        told = other[1][1] if isinstance(other[1], tuple) else other[1]
        return (f"replica {other[0]} refused this step ({told or 'its loss rank has no target'}); the "
                f"replicas run each step together, so replica {runtime.layout.replica} did not run it either")
    return None


def _propagate(runtime: Any, specs: list[Any], training: bool) -> dict[str, Any]:
    """Propagate the crossing values' specs of every micro-batch layout not seen yet; return the new ones."""
    new: dict[str, Any] = {}
    for key, layout in zip(_keys(runtime, specs, training), specs):
        if key not in runtime.layouts:
            runtime.layouts[key] = new[key] = _propagated(runtime, layout, training)
    return new


def _propagated(runtime: Any, layout: Any, training: bool) -> dict[str, Any]:
    """Propagate one layout in the step's mode (a graph merged from both modes reads its module's flag).

    A propagation that fails with grad disabled is tried again with grad enabled, its specs then
    marked as not requiring grad: a module's inference fast path (``nn.TransformerEncoder``'s
    nested tensors, taken under ``torch.no_grad()``) cannot run on fake tensors, and the slow
    path it stands for gives values of the same shapes.
    """
    gm, mode = runtime.gm, runtime.gm.training
    gm.training = training
    try:
        try:
            specs = _checked(runtime, layout)
        except PropagationError:
            if torch.is_grad_enabled():
                raise
            with torch.enable_grad():
                specs = _checked(runtime, layout)
            specs = map_leaves(lambda v: replace(v, requires_grad=False) if isinstance(v, TensorSpec) else v, specs)
        return {name: spec for name, spec in specs.items() if name in runtime.crossing}
    finally:
        gm.training = mode


# what fake tensors cannot run (a value-dependent size, an op without a fake rule): not the input's fault
_FAKE_LIMITS = ("DataDependent", "DynamicOutputShape", "UnsupportedOperator", "UnsupportedFakeTensor")


def _checked(runtime: Any, layout: Any) -> dict[str, Any]:
    """Propagate the crossing values and the outputs (the last stage checked too); the crossing ones alone where
    only fake tensors' limits stop the outputs' propagation."""
    try:
        return runtime.propagate(list(layout))
    except PropagationError as exc:
        causes = [type(c).__name__ for c in (exc.__cause__, exc.__context__) if c is not None]
        if not runtime.outputs or not any(limit in name for name in causes for limit in _FAKE_LIMITS):
            raise
    if runtime.propagate_crossing is None:
        runtime.propagate_crossing = Propagator(runtime.gm, runtime.crossing)
    return runtime.propagate_crossing(list(layout))


def _keys(runtime: Any, specs: list[Any], training: bool) -> list[str]:
    """Return the cache key of each micro-batch layout (its specs, the autocast state, the mode, the weights' dtypes)."""
    state = (autocast_state(), _weight_dtypes(runtime.gm))
    return [repr((layout, state, training)) for layout in specs]


def _weight_dtypes(gm: torch.nn.Module) -> str:
    """Return a short digest of the dtypes of ``gm``'s parameters and buffers, in order.

    A model cast after compile (``model.double()`` on every rank) makes other crossing values:
    specs propagated before it would size receive buffers of the old dtype.
    """
    names = ",".join(str(t.dtype) for t in (*gm.parameters(), *gm.buffers()))
    return f"{zlib.crc32(names.encode()):08x}"


def receive(runtime: Any) -> dict:
    """On the other ranks: receive the layout (or the first rank's refusal, raised here too)."""
    first = runtime.first
    header = runtime.comm.recv_object(first, f"waiting for {runtime.comm.name(first)}'s inputs")
    if header.get("error"):
        kind, message = header["error"]
        if kind == "PropagationError":
            message = f"the inputs cannot run through the model: {message} (found on fake tensors before the step: nothing ran)"
        raise on_every_rank(rebuilt(kind, message))
    runtime.layouts.update(header["layouts"])
    return header


def specs_for(runtime: Any, header: dict) -> Callable[[int], dict[str, Any]]:
    """Return micro-batch index -> spec of every crossing value (propagated by the first rank, once per layout)."""
    training = header.get("training", True)
    keys = _keys(runtime, header["specs"], training)

    def specs(i: int) -> dict[str, Any]:
        if keys[i] not in runtime.layouts:  # the first rank ran under another autocast state
            runtime.layouts[keys[i]] = _propagated(runtime, header["specs"][i], training)
        return runtime.local(runtime.layouts[keys[i]])
    return specs
