"""Run a plan with one stage per ``torch.distributed`` rank, launched by ``torchrun``.

Every rank traces and plans the whole model (the same plan everywhere), keeps only its own
stage on its device, and runs its part of the schedule's action lists, with the messages
to and from the other ranks, through the action interpreter (:mod:`fxpipe.runtime.actions`).
Rank 0 splits the inputs and publishes the micro-batch layout; every rank sizes its receive
buffers from it; the last rank computes the loss, which every rank returns. Parameters used
by several stages (tied embeddings) live on each rank that reads them, start equal, and get
their gradients summed over those ranks after each step, like DeepSpeed's tied layers.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.runtime.actionlist import Action
from fxpipe.runtime.actions import ActionInterpreter, Program, program_for
from fxpipe.runtime.batchnorm import commit_batch_norm
from fxpipe.runtime.comm import Comm
from fxpipe.errors import PeerFailure, PipelineInputError
from fxpipe.runtime.microbatch import gather, micro_losses
from fxpipe.runtime.placement import named_tensors
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.schedule import actions_for, deferring
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stagecall import StageCall
from fxpipe.runtime.transport import DistTransport
from fxpipe.runtime.worker import StageWorker
from fxpipe.passes.annotate import TensorSpec, spec_of

__all__ = ["setup_distributed", "agree_on_stages", "tied_groups", "DistributedRuntime"]

log = logging.getLogger(__name__)


def setup_distributed(n_stages: int, timeout: float) -> tuple[int, torch.device, Any]:
    """Join (or start) the default process group; return this rank, its device, fxpipe's group."""
    if not dist.is_available():
        raise ValueError("runtime='distributed' needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"runtime='distributed' needs a process group: launch with "
                             f"`torchrun --nproc-per-node {n_stages} script.py` (missing {missing}) "
                             "or call torch.distributed.init_process_group first")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != n_stages:
        raise ValueError(f"n_stages={n_stages} but {world} ranks are running; one stage runs per rank, "
                         f"so launch with --nproc-per-node {n_stages} (or compile with n_stages={world})")
    backend = dist.get_backend()
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout), backend=backend)
    return rank, device, group


def agree_on_stages(gm: torch.fx.GraphModule, n_stages: int, comm: Comm) -> None:
    """Make every rank use rank 0's stage assignment (measured costs may differ between ranks)."""
    mine = {n.name: n.meta["fxpipe.stage"] for n in passes.compute_nodes(gm)}
    if comm.rank == 0:
        for r in range(1, n_stages):
            comm.send_object(mine, r)
        comm.flush()
        return
    theirs = comm.recv_object(0, "waiting for rank 0's stage assignment")
    if theirs != mine:
        log.info("rank %d adopts rank 0's stage assignment", comm.rank)
        passes.assign_by_name(gm, theirs, n_stages)


def tied_groups(stages: list[torch.fx.GraphModule], rank: int, timeout: float) -> list[tuple[Any, list]]:
    """Create a group per set of stages sharing tensors; return this rank's (group, tensors) pairs.

    Every rank calls this with the same stages, so groups are created in the same order. The
    shared tensors are made equal to those of the lowest rank that holds them.
    """
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for j, gm in enumerate(stages):
        for _, t in named_tensors(gm):
            if j not in holders.setdefault(id(t), []):
                holders[id(t)].append(j)
                tensors[id(t)] = t
    by_ranks: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for key, ranks in holders.items():
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(ranks), []).append(tensors[key])
    mine = []
    for ranks in sorted(by_ranks):
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout))
        if rank in ranks:
            for t in by_ranks[ranks]:
                dist.broadcast(t.data, src=ranks[0], group=group)
            mine.append((group, [t for t in by_ranks[ranks] if isinstance(t, torch.nn.Parameter)]))
    return mine


class DistributedRuntime:
    """This rank's share of a distributed pipeline: its stage, its program, its messages."""

    def __init__(self, plan: PipelinePlan, gm: torch.fx.GraphModule, call: StageCall, comm: Comm,
                 signature: CallSignature, tied: list[tuple[Any, list]],
                 custom: list[list[Action]] | None = None) -> None:
        self.plan = plan
        self.gm = gm
        self.rank = rank = call.index
        self.device = call.device
        self.comm = comm
        self.signature = signature
        self.tied = tied
        self.custom = custom  # the user's own schedule, or None for plan.schedule's
        stage = plan.stages[rank]
        self.last = rank == plan.n_stages - 1
        defer = rank in deferring(actions_for(plan.schedule, custom, plan.n_stages, plan.chunks))
        self.worker = StageWorker(call, [v in stage.grad_inputs for v in stage.inputs], defer=defer)
        self.example = [n.meta.get("fxpipe.value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.crossing = sorted({v for s in plan.stages for v in s.outputs})
        self._layouts: dict[str, dict[str, Any]] = {}
        self._programs: dict[tuple[str, int], Program] = {}
        self.deferred: list = []  # batch norms whose running statistics wait for the mini-batch

    def code(self) -> str:
        """Return the actions this rank runs in a step of ``plan.chunks`` micro-batches."""
        return self._program(self.plan.schedule, self.plan.chunks).text()

    def _program(self, schedule: str, m: int) -> Program:
        """Lower this rank's actions of ``schedule`` for ``m`` micro-batches, once."""
        if (schedule, m) not in self._programs:
            actions = actions_for(schedule, self.custom if schedule != "forward" else None,
                                  self.plan.n_stages, m)
            self._programs[(schedule, m)] = program_for(self.plan, actions, [self.rank],
                                                        lambda a, b: a != b, schedule)
        return self._programs[(schedule, m)]

    # -- the per-step layout, published by rank 0 ------------------------------------------
    def _layout(self, args: tuple, kwargs: dict, training: bool) -> tuple[dict, list[list[Any]]]:
        """On rank 0, split the inputs and publish their layout; elsewhere, read it."""
        if self.rank != 0:
            header = self.comm.recv_object(0, "waiting for rank 0's inputs")
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
        for r in range(self.plan.n_stages):
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
        transport = DistTransport(self.plan, self.rank, self.device, self.comm, self._specs(header))
        transport.inputs = mbs
        transport.m = m
        runner = ActionInterpreter(self.plan, {self.rank: self.worker}, transport)
        losses = losses_for(header["batch"], m) if (self.last and losses_for) else {}
        runner.begin(m, losses, checkpointing=training, grad=grad)
        runner.run(self._program(self.plan.schedule if grad else "forward", m))
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
            self.comm.fail(f"rank {self.rank} (stage {self.rank}) raised {type(exc).__name__}: {exc}")
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
            return torch.tensor(self.comm.recv_object(self.plan.n_stages - 1, "waiting for the loss"))
        return self._guarded(body)

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run inference over micro-batches; return the output on the last rank, None elsewhere."""
        def body() -> Any:
            runner = self._run(args, kwargs, None, training, grad=False)
            if self.last:
                return self.signature.finish(gather([runner.outputs[i] for i in sorted(runner.outputs)]))
            return None
        return self._guarded(body)
