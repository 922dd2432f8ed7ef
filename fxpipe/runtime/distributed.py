"""Run a plan with its stages spread over ``torch.distributed`` ranks, launched by ``torchrun``.

Every rank traces and plans the whole model (the same plan everywhere), keeps only its own
stages on its device (one, or several with ``stages_per_rank``), and runs its part of the
schedule's action lists, with the messages to and from the other ranks, through the action
interpreter (:mod:`fxpipe.runtime.actions`). The rank holding the first stage splits the
inputs and publishes the micro-batch layout; every rank sizes its receive buffers from it;
the rank holding the last stage computes the loss, which every rank returns. Parameters
used by stages on several ranks (tied embeddings) live on each of those ranks, start equal,
and get their gradients summed over them after each step (:mod:`fxpipe.runtime.procgroup`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.errors import PeerFailure, PipelineInputError
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.actions import ActionInterpreter, Program, program_for
from fxpipe.runtime.batchnorm import commit_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.runtime.microbatch import gather, micro_losses
from fxpipe.runtime.schedule import Schedule
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stagecall import StageCall
from fxpipe.runtime.transport import DistTransport
from fxpipe.runtime.worker import StageWorker

__all__ = ["DistributedRuntime"]

log = logging.getLogger(__name__)


class DistributedRuntime:
    """This rank's share of a distributed pipeline: its stages, its program, its messages."""

    def __init__(self, plan: PipelinePlan, gm: torch.fx.GraphModule, rank: int, calls: Sequence[StageCall],
                 comm: Comm, signature: CallSignature, tied: list[tuple[Any, list]], schedule: Schedule) -> None:
        self.plan = plan
        self.gm = gm
        self.rank = rank
        self.device = calls[0].device
        self.comm = comm
        self.signature = signature
        self.tied = tied
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
        self._layouts: dict[str, dict[str, Any]] = {}
        self._programs: dict[tuple[str, int], list[Program]] = {}
        self.deferred: list = []  # batch norms whose running statistics wait for the mini-batch

    def code(self) -> str:
        """Return the actions this rank runs in a step of ``plan.chunks`` micro-batches."""
        return self._programs_for("train", self.plan.chunks)[self.rank].text()

    def _programs_for(self, kind: str, m: int) -> list[Program]:
        """Lower every rank's actions for a ``"train"`` or ``"forward"`` step of ``m`` micro-batches, once.

        This rank runs its own; the others' tell it in which order its peers send.
        """
        if (kind, m) not in self._programs:
            actions = self.schedule.actions(m) if kind == "train" else self.schedule.forward_only(m)
            name = self.plan.schedule if kind == "train" else "forward"
            self._programs[(kind, m)] = [program_for(self.plan, actions, self.schedule.stages_of(r),
                                                     lambda a, b: a != b, name) for r in range(self.world)]
        return self._programs[(kind, m)]

    # -- the per-step layout, published by rank 0 ------------------------------------------
    def _layout(self, args: tuple, kwargs: dict, training: bool) -> tuple[dict, list[list[Any]]]:
        """On rank 0, split the inputs and publish their layout; elsewhere, read it."""
        if self.rank != self.first:
            header = self.comm.recv_object(self.first, f"waiting for rank {self.first}'s inputs")
            if header.get("error"):
                kind, message = header["error"]
                raise (TypeError if kind == "TypeError" else PipelineInputError)(message)
            return header, []
        try:
            self._check(spec_of(self.signature.bind(args, kwargs)))
            mbs, batch = self.signature.split(args, kwargs, self.plan.chunks, training, self.device)
            specs = [spec_of(mb) for mb in mbs]
        except (TypeError, ValueError) as exc:
            self._tell_all({"error": (type(exc).__name__, str(exc))})
            self.comm.flush()  # deliver it before this rank's exception ends the process
            raise
        header = {"batch": batch, "specs": specs}
        self._tell_all(header)
        return header, mbs

    def _tell_all(self, value: Any) -> None:
        """Send a small value from this rank to every other rank."""
        for r in range(self.world):
            if r != self.rank:
                self.comm.send_object(value, r)

    def _check(self, spec: list[Any]) -> None:
        """Refuse inputs whose non-batch shape or dtype differs from the example's."""
        for name, got, want in zip(self.signature.names, spec, self.example):
            got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
            for g, w in zip(got_leaves, want_leaves):
                if isinstance(w, TensorSpec) and isinstance(g, TensorSpec) and (
                        g.shape[1:] != w.shape[1:] or g.dtype != w.dtype or len(g.shape) != len(w.shape)):
                    raise PipelineInputError(
                        f"input '{name}' has shape {tuple(g.shape)} and dtype {g.dtype}, but the plan was "
                        f"built for shape (batch, {', '.join(map(str, w.shape[1:]))}) and dtype {w.dtype}; "
                        "the distributed runtime sizes its receive buffers from the plan, so compile with "
                        "example inputs of the shape you run")

    def _specs(self, header: dict) -> Callable[[int], dict[str, Any]]:
        """Return micro-batch index -> spec of every crossing value, propagated once per layout."""
        keys = [repr(layout) for layout in header["specs"]]

        def specs(i: int) -> dict[str, Any]:
            if keys[i] not in self._layouts:
                self._layouts[keys[i]] = passes.value_specs(self.gm, list(header["specs"][i]), self.crossing)
            return self._layouts[keys[i]]
        return specs

    # -- running ----------------------------------------------------------------------------
    def _run(self, args: tuple, kwargs: dict, losses_for: Callable | None, training: bool, grad: bool):
        """Run one step's actions on this rank; return the runner."""
        header, mbs = self._layout(args, kwargs, training)
        m = len(header["specs"])
        programs = self._programs_for("train" if grad else "forward", m)
        transport = DistTransport(self.plan, self.rank, self.device, self.comm, self._specs(header),
                                  [[a for g in p.clocked for group in g for a in group] for p in programs])
        transport.inputs = mbs
        runner = ActionInterpreter(self.plan, self.workers, transport)
        losses = losses_for(header["batch"], m) if (self.last and losses_for) else {}
        runner.begin(m, losses, checkpointing=training, grad=grad)
        runner.run(programs[self.rank])
        self.comm.flush()
        if training:
            commit_batch_norm(self.deferred)
        return runner

    def _guarded(self, body: Callable[[], Any]) -> Any:
        """Run ``body``; on any failure here, tell the other ranks before re-raising."""
        try:
            return body()
        except PeerFailure:
            raise
        except BaseException as exc:
            held = ", ".join(map(str, self.workers))
            self.comm.fail(f"rank {self.rank} (stage{'s' if len(self.workers) > 1 else ''} {held}) raised "
                           f"{type(exc).__name__}: {exc}")
            raise

    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run one training step; return the mini-batch loss on every rank."""
        def body() -> torch.Tensor:
            if not torch.is_grad_enabled():
                raise RuntimeError("pipe.step runs backward and needs autograd; call it outside torch.no_grad()")
            runner = self._run(args, kwargs, lambda batch, m: micro_losses(
                loss_fn, target, batch, m, self.device, self.signature.finish), training, grad=True)
            for group, params in self.tied:
                works = []
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    works.append(dist.all_reduce(p.grad, group=group, async_op=True))
                self.comm.wait(works, "summing the gradients of tied parameters")
            if self.last:
                assert runner.total is not None
                self._tell_all(runner.total.item())
                self.comm.flush()
                return runner.total
            return torch.tensor(self.comm.recv_object(self.last_rank, "waiting for the loss"))
        return self._guarded(body)

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run inference over micro-batches; return the output on the last rank, None elsewhere."""
        def body() -> Any:
            runner = self._run(args, kwargs, None, training, grad=False)
            if self.last:
                return self.signature.finish(gather([runner.outputs[i] for i in sorted(runner.outputs)]))
            return None
        return self._guarded(body)
