"""Run a plan with its stages spread over ``torch.distributed`` ranks, launched by ``torchrun``.

Every rank traces and plans the whole model (the same plan everywhere), keeps only its own
stages on its device (one, or several with ``stages_per_rank``), and runs its part of the
schedule's action lists, with the messages to and from the other ranks, through the action
interpreter (:mod:`fxpipe.runtime.interpreter`). The rank holding the first stage splits the
inputs and publishes the micro-batch layout; every rank sizes its receive buffers from it;
the rank holding the last stage computes the loss, which every rank returns. Parameters
used by stages on several ranks (tied embeddings) live on each of those ranks, start equal,
and get their gradients summed over them after each step (:mod:`fxpipe.runtime.transport.procgroup`), what
accumulated since the last sum only (:mod:`fxpipe.runtime.tiedgrads`).

A step that fails on one rank fails on every rank, and leaves the pipe usable::

    rank r raises ──▶ posts why, closes its connections ──▶ every peer raises PeerFailure naming it
    next call     ──▶ every rank drops the failed step's state, meets the others, fresh connections

(:mod:`fxpipe.runtime.transport.failure`). A rank that died stops the others for good: they keep raising,
naming it, until the job restarts. Under data parallel a failure ends the pipe too: the replicas'
gradient reductions cannot be realigned, so restart from the last checkpoint; so does one under
tensor parallelism, whose collectives inside a stage cannot be either.

With tensor parallelism (:mod:`fxpipe.runtime.tensorparallel`) every rank of a stage's group runs
the same program on its shards; values crossing stages are each rank's local tensors, sent to the
rank of equal tp index in the next stage, with receive buffers of the shards' shapes.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.fx

from fxpipe import passes
from fxpipe.errors import PeerFailure, PipelineInputError, ScheduleError, user_stacklevel
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime import gradnorm
from fxpipe.runtime.binding import Binding
from fxpipe.runtime.contract import Place
from fxpipe.runtime.dataparallel import GradSync, final_backwards
from fxpipe.runtime.ignored import check_first_loss, check_targets_once, look_at_targets
from fxpipe.runtime.interpreter import ActionInterpreter, Program, program_for
from fxpipe.runtime.latecalls import LateCalls
from fxpipe.runtime.microbatch import is_summed, micro_losses
from fxpipe.runtime.replicanorms import sync_norms
from fxpipe.runtime.schedules.builtin import Schedule
from fxpipe.runtime.stage.batchnorm import commit_batch_norm, discard_batch_norm, pipe_running
from fxpipe.runtime.stage.stagecall import StageCall
from fxpipe.runtime.stage.unfrozen import refuse_changed_linears, refuse_unfrozen
from fxpipe.runtime.stage.worker import StageWorker
from fxpipe.runtime.tensorparallel import local_specs, match_grads
from fxpipe.runtime.tiedgrads import open_window, sum_tied
from fxpipe.runtime.tppartial import PartialGrads
from fxpipe.runtime.transport import callstate, release, samebatch, samecall, steplayout
from fxpipe.runtime.transport.comm import Comm, forget_frames, on_every_rank
from fxpipe.runtime.transport.layoutcache import LayoutCache
from fxpipe.runtime.transport.messages import DistTransport
from fxpipe.runtime.transport.procgroup import Layout, Ties, reopen_pipeline
from fxpipe.runtime.transport.together import communication_failed, first_line
from fxpipe.runtime.transport.tpinputs import from_tp_holder

__all__ = ["DistributedRuntime"]

log = logging.getLogger(__name__)


class DistributedRuntime:
    """This rank's share of a distributed pipeline: its stages, its program, its messages."""

    def __init__(self, plan: PipelinePlan, gm: torch.fx.GraphModule, layout: Layout, calls: Sequence[StageCall],
                 comm: Comm, binding: Binding, ties: Ties, schedule: Schedule) -> None:
        self.plan = plan
        self.gm = gm
        self.rank = rank = layout.rank
        self.device = calls[0].device
        self.comm = comm
        self.binding = binding
        self.ties = ties
        self.schedule = schedule
        self.world = schedule.world
        self.first = schedule.ranks[0]  # the rank that splits the inputs
        self.last_rank = schedule.ranks[-1]  # the rank that computes the loss
        self.last = rank == self.last_rank
        defer = schedule.deferring(plan.chunks)
        self.workers = {c.index: StageWorker(c, [v in plan.stages[c.index].grad_inputs
                                                 for v in plan.stages[c.index].inputs], defer=c.index in defer)
                        for c in calls}
        self.example = [n.meta.get("fxpipe.value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.crossing = sorted({v for s in plan.stages for v in s.outputs})
        self.layouts = LayoutCache()  # crossing values' specs per micro-batch layout (the latest 256)
        # a new layout's crossing specs, on fake tensors; the outputs too, so that the last stage's shapes are
        # checked before the step (steplayout._propagated falls back to the crossing values alone)
        self.outputs = [a.name for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes]
        self.propagate = passes.Propagator(gm, [*self.crossing, *self.outputs])
        self.propagate_crossing: Any = None  # made at the first fallback
        nodes = {n.name: n for n in gm.graph.nodes}  # tensor parallel: which crossing values are shards
        self.shards = {v: nodes[v].meta["fxpipe.tp"] for v in self.crossing if "fxpipe.tp" in nodes[v].meta}
        self._programs: dict[tuple[str, int], list[Program]] = {}
        self._finals: dict[tuple[str, int], dict[int, int]] = {}
        self._transports: dict[tuple[str, int], DistTransport] = {}  # per step kind, kept across steps
        self.layout = layout
        self.grad_sync: GradSync | None = None  # data parallel, set by the build
        self.partial: PartialGrads | None = None  # tensor parallel: whole parameters beside shards, summed
        self.sync = True  # reduce gradients over replicas and ties this step (off inside pipe.no_sync())
        self.unfrozen: list = []  # parameters frozen at compile whose gradient could not come back (unfrozen.py)
        self.routeless: list = []  # model inputs later stages read with no gradient route back (unfrozen.py)
        self.replacing = {c.index: c.gm for c in calls if c.gm.meta.get("fxpipe.replaced_modules")}
        self.summed: dict[int, torch.Tensor] | None = None  # tied gradients already summed (fxpipe.runtime.tiedgrads)
        self.deferred: list = []  # batch norms whose running statistics wait for the mini-batch
        self.norms: list = []  # data parallel: the batch norms kept equal over the replicas
        self.written: list = []  # data parallel: the other buffers the stages write, kept equal too
        self.broken: str | None = None  # why the last step failed, until every rank is back
        self.unconfirmed = False  # its last call was a pipe(...) this rank finished before the last stage did
        self.late = LateCalls(len(layout.global_ranks))  # the pipe(x) calls this rank finished early
        self.rerun_after: int | None = None  # a failed one of them, read by ready(): the later ones run again
        self.target_checked = False  # that the loss's rank has the target when another rank has one
        self.call_word_due = False  # the first rank in pipe(x): the loss rank's word on it is still to be read
        self.batch_checked: set[bool] = set()  # the calls (step: True) whose ranks were found to share one batch
        self.reduction = "mean"  # the step's loss_reduction, which every rank of a pipeline must pass alike
        self.told_forward_only = False  # pipe(x) in training mode with grad on was warned of
        self.target_versions: list = []  # the last target given with its tensors' versions (samebatch.versions)
        self.released = False  # its process groups let go of at interpreter exit (transport.release)
        release.track(self)

    @property
    def tied(self) -> list[tuple[Any, list, bool]]:
        """Return this rank's ties: (group, parameters, whether this rank is the tie's first)."""
        return self.ties.mine

    # -- the contract's hooks (fxpipe.runtime.contract) ----------------------------------------
    def local(self, specs: dict[str, Any]) -> dict[str, Any]:
        """Return the specs of the crossing values as this rank holds them (a tensor-parallel shard's shape)."""
        return local_specs(specs, self.shards, self.layout.tp) if self.layout.tp > 1 else specs

    def place(self) -> Place:
        """Return this process's global rank and the group a checkpoint saves over (all ranks under replicas)."""
        group = self.comm.group if self.layout.dp == 1 and self.layout.tp == 1 else None
        return Place(dist.get_rank(), dist.get_world_size(), group, True)

    def reads(self) -> tuple[bool, bool]:
        """Return whether this rank splits the inputs (the first stage's) and computes the loss (the last's)."""
        return self.rank == self.first, self.rank == self.last_rank

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Return the whole model's gradient norm, the same on every rank (:mod:`fxpipe.runtime.gradnorm`)."""
        return gradnorm.total_norm(self, params, norm_type)

    def held(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return the parameters of ``params`` this rank's stages hold."""
        return gradnorm.held(self, params)

    def grad_scaler(self, device: str, **kwargs: Any) -> Any:
        """Return FSDP's ``ShardedGradScaler``: its ``unscale_`` agrees with every rank on inf/NaN.

        Under tensor parallelism, one that unscales DTensor shards beside whole gradients.
        """
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if self.layout.tp > 1:
            from fxpipe.runtime.tensorparallel import TPGradScaler

            return TPGradScaler(device=device, **kwargs)
        return ShardedGradScaler(device=device, **kwargs)

    def runs(self) -> list[Any]:
        """Return the GraphModule each stage of this process runs."""
        return [w.call.gm for _, w in sorted(self.workers.items())]

    def compile_stats(self) -> dict[int, dict[str, Any]]:
        """Return torch.compile's record of each compiled stage this process runs (``torch_compile=``)."""
        return {j: w.call.compiled.stats() for j, w in sorted(self.workers.items()) if w.call.compiled is not None}

    def code(self) -> str:
        """Return the actions this rank runs in a step of ``plan.chunks`` micro-batches."""
        return self._programs_for("train", self.plan.chunks)[self.rank].text()

    def _programs_for(self, kind: str, m: int) -> list[Program]:
        """Lower every rank's actions for a ``"train"`` or ``"forward"`` step of ``m`` micro-batches, once.

        This rank runs its own; the others' tell it in which order its peers send.
        """
        if (kind, m) not in self._programs:
            actions = self.schedule.actions(m) if kind == "train" else self.schedule.forward_only(m)
            self._finals[(kind, m)] = {}
            if kind == "train" and self.grad_sync is not None:
                actions, self._finals[(kind, m)] = final_backwards(actions)
            name = self.plan.schedule if kind == "train" else "forward"
            self._programs[(kind, m)] = [program_for(self.plan, actions, self.schedule.stages_of(r), name)
                                         for r in range(self.world)]
        return self._programs[(kind, m)]

    def _checks_batch(self, stepping: bool) -> bool:
        """Say whether this call is the first of its kind whose ranks' batches are compared (:mod:`samebatch`)."""
        return stepping not in self.batch_checked and self.world * self.layout.tp > 1

    # -- running ----------------------------------------------------------------------------
    def _run(self, args: tuple, kwargs: dict, losses_for: Callable | None, training: bool, grad: bool,
             target: Any = None, own_target: Any = None, first_check: Callable | None = None):
        """Run one step's actions on this rank; return the runner.

        ``target`` is the loss's (under tensor parallelism the group's, taken from its first rank
        given one); ``own_target`` the one this rank was given, which the batch check compares.
        ``first_check(batch, m)`` runs on the first rank where it is not the last (which runs ``losses_for``).
        """
        if self.rank == self.first:
            header, mbs = steplayout.publish(self, args, kwargs, training, has_target=target is not None,
                                             stepping=losses_for is not None, target=target,
                                             check_batch=self._checks_batch(losses_for is not None))
        else:
            steplayout.tell_target_given(self, losses_for is not None, target, training)
            header, mbs = steplayout.receive(self), []
        m = len(header["specs"])
        stepping = losses_for is not None
        if header.get("call", steplayout.call_name(stepping)) != steplayout.call_name(stepping):
            raise PipelineInputError(steplayout.other_call(self, self.rank, stepping, not stepping))
        if self.rank != self.first:
            self._refuse_other_state(header, training, stepping)
        if losses_for is not None:
            steplayout.check_target(self, target, bool(header.get("target_on_first")), header.get("batch"))
        if "digest" in header:  # the call's first: a sampler sharding over every rank is refused, not run
            if self.rank == self.first:
                steplayout.take_call_word(self)  # before the loss rank's check of the batch
            samebatch.agree_on_batch(self, args, kwargs, own_target, header)
            self.batch_checked.add(stepping)
        elif "glance" in header and self.rank != self.first:  # a loop out of step later (a shorter loader)
            samebatch.check_glance(self, args, kwargs, own_target, header)
        elif self.rank != self.first:  # under tp, no glance: still refuse a value for an input the trace fixed
            samebatch.check_fixed(self, args, kwargs)
        self.target_versions = samebatch.versions(own_target)  # written in place by loss_fn: not compared next
        kind = "train" if grad else "forward"
        try:
            programs = self._programs_for(kind, m)
        except ScheduleError as exc:  # too few micro-batches: every rank sees the same m
            raise on_every_rank(exc) from None
        specs = steplayout.specs_for(self, header)
        transport = self._transports.get((kind, m))
        if transport is None:  # what it reads off the plan and the programs, once per step kind
            transport = self._transports[(kind, m)] = DistTransport(
                self.plan, self.rank, self.device, self.comm, specs,
                [[a for g in p.clocked for group in g for a in group] for p in programs])
        transport.begin(specs, mbs)
        for j, worker in self.workers.items():  # data parallel: reduce at each stage's last backward
            worker.final = self._finals[(kind, m)].get(j) if self.grad_sync is not None else None
            worker.before_backward = partial(self.grad_sync.before_backward, j) if self.grad_sync else None
        if self.grad_sync is not None:
            self.grad_sync.sync = self.sync
        runner = ActionInterpreter(self.plan, self.workers, transport)
        losses = losses_for(header["batch"], m) if (self.last and losses_for) else {}
        if first_check is not None and self.rank == self.first and not self.last:
            first_check(header["batch"], m)
        runner.begin(m, losses, checkpointing=training, grad=grad)
        try:
            runner.run(programs[self.rank])
        except BaseException:
            transport.abandon()
            runner.begin(m, {}, checkpointing=False)  # hold nothing of the failed step
            if self.grad_sync is not None:
                self.grad_sync.reshard()
            raise
        if self.rank == self.first:  # pipe(x): before waiting for this rank's sends (see there)
            steplayout.take_call_word(self)
        transport.finish()
        self.comm.flush()
        if self.grad_sync is not None and not grad:  # no backward resharded FSDP2's parameters
            self.grad_sync.reshard()
        if training:
            if self.layout.dp > 1:  # running statistics: the global batch's, or the first replica's
                sync_norms(self.norms, self.deferred, self.layout.dp_group, self.comm.wait, self.written)
            commit_batch_norm(self.deferred)
        return runner

    def ready(self) -> None:
        """After a failed step, meet every rank again on fresh connections; raise if one is gone.

        A peer's failure read now of a call this rank finished early leaves its number in
        ``rerun_after``: the calls this rank finished after it run again at its next call.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed's process group was destroyed (destroy_process_group()) before "
                               "this call of the pipe: destroy it after the pipe's last step")
        if self.released:
            raise RuntimeError("this pipe let go of its process groups when the interpreter began to exit; "
                               "run its steps before the script ends (not from an atexit handler)")
        if self.broken is None and self.unconfirmed:  # a peer may have failed the call this rank finished
            reason = self.comm.board.read("starting a call")
            self.unconfirmed = reason is None  # unread: the call begins, and a late post is told by its number
            if reason is not None:
                log.warning("rank %d: its pipe(...) call %s failed on another rank (%s); rejoining",
                            self.layout.global_ranks[self.rank], reason.get("call"), reason["message"])
                self._abandon(PeerFailure(reason["message"]))
                if self.late.knows(reason.get("call")):
                    self.rerun_after = int(reason["call"])
        else:
            self.unconfirmed = False
        if self.broken is None and self.comm.board.death is not None and self.comm.board.crossed:
            self.comm.board.rejoin()  # the ranks' calls crossed between pipes (posted here by another): refused
        if self.broken is None:
            return
        if self.layout.dp > 1 or self.layout.tp > 1:
            what = "the replicas' gradient reductions" if self.layout.dp > 1 else "the tensor-parallel collectives"
            raise PeerFailure(f"rank {self.layout.global_ranks[self.rank]}: an earlier step failed ({self.broken}); "
                              f"under {'data' if self.layout.dp > 1 else 'tensor'} parallel {what} cannot be "
                              "realigned after a failure, so restart the job and resume from the last complete "
                              "checkpoint (fxpipe.latest_checkpoint)")
        self.comm.board.rejoin()
        self.comm.reopen(reopen_pipeline(self.layout, self.comm.timeout))
        self.ties.reopen()
        self.broken = None

    def refuse(self, exc: BaseException, stepping: bool = True) -> NoReturn:
        """Raise ``exc``, a refusal of ``pipe.step``'s (``stepping``) or ``pipe(x)``'s own arguments, on every rank.

        The first stage's rank and the loss's rank tell it through the step's own first messages
        (the layout, and the loss rank's word on its target), so every rank raises it before
        anything runs, and the replicas too (their first ranks agree on each step): nothing is
        abandoned, and under data parallel the pipe steps on. Another rank's refusal, which no
        message carries before the step runs, fails the step as any failure does: the others,
        waiting in theirs, raise ``PeerFailure`` naming it (under data parallel that ends the
        pipe). Raised before the step instead, the others would pair their step with this rank's
        next call: its inputs against their target. Under tensor parallelism every rank's call
        begins with an agreement (:mod:`~fxpipe.runtime.transport.samecall`), which carries any
        rank's refusal to every rank.
        """
        def body() -> NoReturn:
            if self.layout.tp > 1:  # the groups' ranks take inputs and target from any of theirs: told to every rank
                samecall.agree_on_call(self, stepping, True, refusal=exc)
            if self.rank == self.first:
                steplayout.publish(self, (), {}, True, stepping=stepping, refusal=exc)
            steplayout.tell_target_given(self, stepping, None, refusal=exc)
            header = steplayout.receive(self)  # the first rank's refusal, or the loss rank's it told, raises
            if stepping and self.rank == self.last_rank:  # the first step: the loss rank's check of the target
                steplayout.check_target(self, None, bool(header.get("target_on_first")), header.get("batch"), exc)
            raise exc  # a middle rank's refusal, which no message carries: a failed step
        try:
            self._guarded(body)
        except BaseException as raised:
            if getattr(raised, "fxpipe_on_every_rank", False) and raised is not exc:
                raise on_every_rank(exc) from None  # this rank's own error, which the others raised for it
            raise
        raise AssertionError("unreachable: _guarded re-raises")

    def _refuse_other_state(self, header: dict, training: bool, stepping: bool) -> None:
        """Refuse a call whose mode, autocast or loss reduction differ from the first rank's (its ``header``).

        The loss's rank refuses its first step's on every rank, as its check of the target
        (later steps: the first rank compared its word); another rank's fails the step.
        """
        g = self.layout.global_ranks
        theirs = (header.get("training", training), tuple(header.get("autocast", ())), header.get("reduction", ""))
        wrong = callstate.mismatch(g[self.rank], callstate.state(training, self.reduction if stepping else ""),
                                   g[self.first], theirs)
        if wrong is None:
            return
        exc = PipelineInputError(wrong)
        if stepping and self.rank == self.last_rank and not self.target_checked and self.layout.tp == 1:
            try:
                steplayout.check_target(self, None, bool(header.get("target_on_first")), header.get("batch"), exc)
            except PipelineInputError:
                raise on_every_rank(exc) from None
        raise exc

    def check_stages(self) -> None:
        """Refuse a step whose stages on this rank changed since compile in a way the action lists cannot run."""
        refuse_unfrozen(self.unfrozen)
        refuse_changed_linears(self.replacing)

    def broke(self, exc: BaseException) -> None:
        """Close this rank's connections after a collective failed outside a step, so its next call rejoins.

        A rank alone in ``fxpipe.save`` waits out the timeout while its peer's step fails; without
        this its next step would run on the closed connections and fail too, and the ranks' calls
        would drift one step apart.
        """
        if self.broken is None:
            self._abandon(exc)

    def release(self) -> None:
        """Drop every reference this rank holds to a process group, so they are freed before Python is not.

        Called as the interpreter exits: it first posts how many calls this rank made, which a
        peer still in a call reads to name a skipped call rather than a death.
        """
        self.comm.board.end()
        self.released = True
        self._transports.clear()
        self.comm.pending = []
        self.comm.group = None
        self.ties.mine = [(None, params, first) for _, params, first in self.ties.mine]
        self.layout.pp_group = self.layout.dp_group = self.layout.tp_group = self.layout.call_group = None
        self.layout.mesh = self.layout.tp_mesh = None  # a DeviceMesh holds its groups too
        self.partial = None  # holds the tensor-parallel group
        if self.grad_sync is not None:
            self.grad_sync.wrapped.clear()  # DDP's reducer holds the replicas' group
            self.grad_sync.group = None

    def _abandon(self, exc: BaseException) -> None:
        """Close this rank's connections and drop the failed step's state (see the module's picture)."""
        line = f"{type(exc).__name__}: {exc}".split("\n")[0]
        self.broken = line if len(line) <= 500 else line[:500].rsplit(" ", 1)[0] + " ..."  # told again: cut at a word
        self.target_checked = False  # a rank may have read the loss rank's verdict that another never got
        self.call_word_due = False  # its connections are new
        forget_frames(exc)  # the frames (the chained exceptions' too) hold the step's pending messages
        self.layout.pp_group = None  # the group's connections close once nothing holds it
        self.comm.close()
        self.ties.close()
        self.summed = None
        if self.partial is not None:
            self.partial.discard()
        for worker in self.workers.values():
            worker.discard()
        discard_batch_norm(self.deferred)

    def _guarded(self, body: Callable[[], Any]) -> Any:
        """Run ``body``; on any failure here, tell the other ranks and close the connections, then re-raise.

        A failure a peer posts for a ``pipe(x)`` call this rank had finished early
        (:mod:`fxpipe.runtime.latecalls`), read at the start or met in this call, makes this rank
        rejoin, run the calls it finished after the failed one again, then this one.
        """
        self.comm.board.enter(self.layout.global_ranks[self.rank])
        self.ready()
        failed, self.rerun_after = self.rerun_after, None  # read now, or by a save's or a sum's ready() since
        self.comm.board.call += 1
        number, rng = self.comm.board.call, _random_state()
        for _ in range(len(self.late.calls) + 2):  # each pass forgets at least one remembered call
            try:
                with pipe_running(self.deferred):
                    if failed is not None:
                        for _, again, state in self.late.after(failed):  # the peers' next calls: results discarded
                            _set_random_state(state)
                            again()
                        _set_random_state(rng)
                    self.unconfirmed = False
                    result = body()
            except PeerFailure as caught:
                failed = self._failed_before(caught)
                if failed is None:
                    return self._failed(caught)
            except BaseException as caught:  # noqa: BLE001 - re-raised by _failed
                return self._failed(caught)
            else:
                self.late.finished(number, body, rng, self.unconfirmed)
                return result
            log.warning("rank %d: its pipe(...) call %d failed on another rank after this rank had finished it; "
                        "rejoining and running the calls since again", self.layout.global_ranks[self.rank], failed)
            self.ready()
        raise AssertionError("unreachable: every pass forgets a call")

    def _failed_before(self, exc: PeerFailure) -> int | None:
        """Return the number of the call a peer failed, where this rank had finished it early (abandoning this one)."""
        reason = self.comm.board.read("telling which call failed")
        if reason is None or reason["fatal"] or not self.late.knows(reason.get("call")):
            return None
        self._abandon(exc)
        return int(reason["call"])

    def _failed(self, caught: BaseException) -> NoReturn:
        """Tell the other ranks of this rank's failure (unless a peer's), close the connections, re-raise.

        Called from the ``except`` clause handling ``caught``.
        """
        exc = caught
        if getattr(exc, "fxpipe_on_every_rank", False):
            raise caught  # every rank raised it itself, at the same point: nothing is in flight
        me = self.layout.global_ranks[self.rank]
        if (self.layout.dp > 1 or self.layout.tp > 1) and communication_failed(exc):  # over replicas or a tp group
            what = "the replicas" if self.layout.dp > 1 else "the stage's tensor-parallel group"
            reason = self.comm.board.read(f"in a collective over {what}")  # they share the board's keys
            ended = None if reason else self.comm.board.post_ended()  # a script ended early (posted at its exit)
            cause = (f"because {reason['message']}" if reason else f"because {ended}" if ended else
                     "another rank's step failed, and it raises the cause")
            exc = PeerFailure(f"rank {me}: a collective over {what} failed ({first_line(exc)}) {cause}")
        if not isinstance(exc, PeerFailure):
            held = ", ".join(map(str, self.workers))
            notes = "".join(f" ({n})" for n in getattr(exc, "__notes__", ()))
            self.comm.fail(f"rank {me} (stage{'s' if len(self.workers) > 1 else ''} "
                           f"{held}) raised {type(exc).__name__}: {exc}{notes}")
        self._abandon(exc)
        if exc is not caught:
            raise exc from caught
        raise caught

    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run one training step; return the mini-batch loss on every rank."""
        def body() -> torch.Tensor:
            self.reduction = "sum" if is_summed(loss_fn) else "mean"
            samecall.agree_on_call(self, True, training)  # tensor parallel: every rank's call alike, or refused
            if self.grad_sync is not None:  # parameters frozen since compile: DDP wrapped again
                self.grad_sync.refresh()
            tgt = from_tp_holder(self, target, target is not None)[0] if self.last else target
            opened = self.summed is None
            if opened:  # the first step since the last sum: what that sum made equal stays out
                self.summed = open_window(self.tied)
            def losses_for(batch: int | None, m: int) -> dict[int, Callable[[Any], torch.Tensor]]:
                # labels= is an input: the first rank's (the last may have none), which looks at it
                check_targets_once(self.binding, tgt, kwargs if self.rank == self.first else {}, batch, m, loss_fn)
                return micro_losses(loss_fn, tgt, batch, m, self.device, self.binding.finish,
                                    partial(check_first_loss, self.binding))
            if self.layout.tp > 1 and self.partial is None:
                sharded = self.grad_sync is not None and self.grad_sync.shard  # FSDP2: sums at the synced step
                self.partial = PartialGrads([w.call.gm for w in self.workers.values()], self.layout.tp_group,
                                            window=sharded)
            based = self.partial is not None and self.partial.based()
            if self.partial is not None:
                self.partial.before()
            def labels_seen(batch: int | None, m: int) -> None:
                look_at_targets(self.binding, {"labels": kwargs.get("labels")}, batch, m, loss_fn)
            try:
                runner = self._run(args, kwargs, losses_for, training, grad=True, target=tgt, own_target=target,
                                   first_check=labels_seen)
            except BaseException as exc:
                # refused on every rank before anything ran: the tie's window and the tp base this call
                # opened hold the gradients before the user's zero_grad, so the next step opens its own
                if getattr(exc, "fxpipe_on_every_rank", False):
                    if opened:
                        self.summed = None
                    if self.partial is not None and not based:
                        self.partial.discard()
                raise
            if self.layout.tp > 1:
                match_grads([p for w in self.workers.values() for p in w.call.gm.parameters()])
            if self.partial is not None:
                self.partial.after(self.sync)
            if self.sync:  # replicas reduced and a tie's accumulated gradients summed once, at the synced step
                if self.grad_sync is not None:
                    self.grad_sync.reduce()
                    self.grad_sync.reshard()  # a stage frozen whole ran no backward, which reshards FSDP2's
                sum_tied(self.tied, self.summed or {}, self.comm.wait)
                self.summed = None
            if self.last:
                assert runner.total is not None
                total = runner.total
                if self.layout.dp > 1:  # the global batch's loss: the replicas' mean
                    total = total.clone()
                    dist.all_reduce(total, group=self.layout.dp_group)
                    total /= self.layout.dp
                steplayout.tell_all(self, (total.item(), str(total.dtype).removeprefix("torch.")))
                self.comm.flush()
                return total
            value, dtype = self.comm.recv_object(self.last_rank, "waiting for the loss")
            return torch.tensor(value, dtype=getattr(torch, dtype), device=self.device)  # as the loss's rank has it
        return self._guarded(body)

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run inference over micro-batches; return the output on the last rank, None elsewhere."""
        if training and torch.is_grad_enabled() and not self.told_forward_only:
            self.told_forward_only = True  # once: an evaluation in training mode without no_grad is told too
            warnings.warn(
                "pipe(x) across ranks runs forwards only: its output (on the last stage's rank, None elsewhere) "
                "carries no autograd graph, so loss.backward() on it raises 'element 0 of tensors does not require "
                "grad'. Train with pipe.step(x, target=y, loss_fn=...); evaluate under torch.no_grad() or after "
                "pipe.eval()", stacklevel=user_stacklevel())

        def body() -> Any:
            samecall.agree_on_call(self, False, training)
            runner = self._run(args, kwargs, None, training, grad=False)
            self.unconfirmed = not self.last  # nothing told this rank that the later stages finished
            if self.last:
                return self.binding.finish(self.binding.gather([runner.outputs[i] for i in sorted(runner.outputs)], training))
            return None
        return self._guarded(body)


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Return this process's CPU random state and, where CUDA is in use, every device's."""
    return torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_random_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    """Put back a state :func:`_random_state` returned."""
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
