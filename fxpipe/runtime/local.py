"""Run a plan in one process, one device per stage.

``pipe(x)`` runs the generated GPipe program (:mod:`fxpipe.runtime.codegen`) with autograd
connected across stages, so the user's ``backward`` flows through every stage; this module
provides what that program calls: ``compute`` (a stage's :meth:`StageCall.call` on one
micro-batch), ``copy`` (to another stage's device on copy streams) and ``depend`` (fork/join
ordering of backward). ``pipe.step`` runs GPipe the same way, and every other schedule as
action lists through the interpreter (:mod:`fxpipe.runtime.interpreter`), with the mailbox
transport. On CUDA both use copy streams and, with several GPUs, a worker thread per device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import torch

from fxpipe.options import checkpoint_stop, saving_pass
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.binding import Binding
from fxpipe.runtime.codegen import compile_source, gpipe_source
from fxpipe.runtime.contract import Place
from fxpipe.runtime.ignored import check_first_loss, check_targets_once
from fxpipe.runtime.interpreter import ActionInterpreter, Program, program_for
from fxpipe.runtime.microbatch import micro_losses
from fxpipe.runtime.observe import timeline
from fxpipe.runtime.schedules.builtin import Schedule
from fxpipe.runtime.stage.batchnorm import commit_batch_norm, discard_batch_norm, pipe_running
from fxpipe.runtime.stage.copy import copy
from fxpipe.runtime.stage.dependency import depend
from fxpipe.runtime.stage.keepstate import note_written_weights
from fxpipe.runtime.stage.recompute import guarded
from fxpipe.runtime.stage.rng import autocast_off
from fxpipe.runtime.stage.stagecall import StageCall
from fxpipe.runtime.stage.threads import DeviceThreads
from fxpipe.runtime.stage.unfrozen import refuse_changed_linears, refuse_input_grads, refuse_unfrozen
from fxpipe.runtime.stage.worker import StageWorker
from fxpipe.runtime.transport.mailbox import LocalTransport

__all__ = ["LocalRuntime"]

log = logging.getLogger(__name__)


class LocalRuntime:
    """Execute a plan's stages over micro-batches in this process."""

    def __init__(self, plan: PipelinePlan, calls: Sequence[StageCall], binding: Binding,
                 schedule: Schedule) -> None:
        self.plan = plan
        self.calls = list(calls)
        self.devices = [c.device for c in self.calls]
        self.binding = binding
        self.schedule = schedule  # what step runs (unless GPipe: the generated program)
        self.checkpointing = False
        self.passes = [saving_pass(p) for p in plan.policies()]  # per stage: its forward's pass when training
        self.sync = True  # pipe.no_sync(): nothing to reduce in one process
        self.unfrozen: list = []  # parameters frozen at compile whose gradient could not come back (unfrozen.py)
        self.routeless: list = []  # model inputs later stages read with no gradient route back (unfrozen.py)
        self.replacing = {c.index: c.gm for c in self.calls if c.gm.meta.get("fxpipe.replaced_modules")}
        self.deferred: list = []  # batch norms whose running statistics wait for the mini-batch
        self._programs: dict[tuple[str, int], tuple[str, Any]] = {}
        self.threads: DeviceThreads | None = None
        self.use_threads(len({d for d in self.devices if d.type == "cuda"}) > 1)
        defer = schedule.deferring(plan.chunks)
        self.workers = {j: StageWorker(c, [v in plan.stages[j].grad_inputs for v in plan.stages[j].inputs],
                                       defer=j in defer)
                        for j, c in enumerate(self.calls)}

    # -- the contract's hooks (fxpipe.runtime.contract) ----------------------------------------
    def ready(self) -> None:
        """Nothing to rejoin in one process."""

    def refuse(self, exc: BaseException, stepping: bool = True) -> NoReturn:
        """Raise ``exc``: no other rank waits."""
        raise exc

    def check_stages(self) -> None:
        """Refuse a step whose stages changed since compile in a way the action lists cannot run (not GPipe's)."""
        if self.plan.schedule != "gpipe":  # GPipe's one autograd graph sends every gradient back
            refuse_unfrozen(self.unfrozen)  # the action lists send a gradient back only where one was at compile
            refuse_changed_linears(self.replacing)

    def broke(self, exc: BaseException) -> None:
        """Nothing to close in one process."""

    def place(self) -> Place:
        """Return one process, no group."""
        return Place()

    def reads(self) -> tuple[bool, bool]:
        """Return that this process reads both the inputs and the target."""
        return True, True

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Return the norm of the gradients of ``params`` (every stage is here)."""
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)

    def held(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return ``params``: this process holds every stage."""
        return list(params)

    def grad_scaler(self, device: str, **kwargs: Any) -> Any:
        """Return ``torch.amp.GradScaler`` for ``device``."""
        return torch.amp.GradScaler(device, **kwargs)

    def runs(self) -> list[Any]:
        """Return the GraphModule each stage of this process runs."""
        return [w.call.gm for _, w in sorted(self.workers.items())]

    def compile_stats(self) -> dict[int, dict[str, Any]]:
        """Return torch.compile's record of each compiled stage this process runs (``torch_compile=``)."""
        return {j: w.call.compiled.stats() for j, w in sorted(self.workers.items()) if w.call.compiled is not None}

    def use_threads(self, on: bool) -> None:
        """Compute each clock's stages on one worker thread per device (the CUDA default)."""
        if self.threads is not None:
            self.threads.close()
        self.threads = DeviceThreads(self.devices) if on else None
        self._programs.clear()

    # -- the programs --------------------------------------------------------------------
    def program(self, m: int, kind: str = "gpipe") -> tuple[str, Any]:
        """Return the source (or text) and runnable of a schedule for ``m`` micro-batches, made once.

        ``kind`` is ``"gpipe"`` (the generated, autograd-connected forward) or ``"actions"``
        (the plan's schedule as action lists, for ``step``).
        """
        key = (kind, m)
        if key not in self._programs:
            if kind == "gpipe":
                name = f"gpipe_{self.plan.n_stages}x{m}"
                source = gpipe_source(self.plan, m, name, threaded=self.threads is not None)
                self._programs[key] = (source, compile_source(source, name, f"<fxpipe {name}>"))
            else:
                actions = self.schedule.actions(m)
                prog: Program = program_for(self.plan, actions, range(self.plan.n_stages), self.plan.schedule)
                self._programs[key] = (prog.text(), prog)
        return self._programs[key]

    def code(self) -> str:
        """Return what ``step`` runs for ``plan.chunks`` micro-batches: GPipe's source, or the actions."""
        kind = "gpipe" if self.plan.schedule == "gpipe" else "actions"
        return self.program(self.plan.chunks, kind)[0]

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run the model's forward over micro-batches; return the model's output structure."""
        with pipe_running(self.deferred):
            try:
                return self._forward(args, kwargs, training)
            except BaseException as exc:
                self.binding.note_unlike(exc, args, kwargs)
                raise

    def _forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run :meth:`forward` (inside :func:`pipe_running`)."""
        mbs, _ = self.binding.split(args, kwargs, self.plan.chunks, training, self.devices[0])
        self.binding.check_joinable(len(mbs), training)
        try:
            output = self.binding.gather(self.run(mbs, training), training)
        except BaseException:  # the failed call's deferred statistics must not join the next call's
            discard_batch_norm(self.deferred)
            raise
        if training:
            commit_batch_norm(self.deferred)
        recomputed = [j for j, p in enumerate(self.plan.policies()) if checkpoint_stop(p, len(mbs))] \
            if self.checkpointing else []
        if recomputed:  # what backward through them cannot give, refused (recompute)
            guarded(output, recomputed[0])
        return self.binding.finish(output)

    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run forward and backward of one mini-batch with a loss per micro-batch; return the loss."""
        with pipe_running(self.deferred):
            try:
                return self._step(args, kwargs, target, loss_fn, training)
            except BaseException as exc:
                self.binding.note_unlike(exc, args, kwargs)
                raise

    def _step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run :meth:`step` (inside :func:`pipe_running`)."""
        mbs, batch = self.binding.split(args, kwargs, self.plan.chunks, training, self.devices[0])
        check_targets_once(self.binding, target, kwargs, batch, len(mbs), loss_fn)
        gpipe = self.plan.schedule == "gpipe"  # one autograd graph, one backward: the target's graph kept whole
        losses = micro_losses(loss_fn, target, batch, len(mbs), self.devices[-1], self.binding.finish,
                              partial(check_first_loss, self.binding), detach_target=not gpipe)
        if gpipe:
            try:  # the loss and backward may raise too: commit only a step that finished
                outputs = self.run(mbs, training)
                total = sum((losses[i](out) for i, out in enumerate(outputs[1:], 1)), losses[0](outputs[0]))
                with autocast_off():  # as eager's backward, outside the autocast around pipe.step
                    total.backward()
            except BaseException as exc:
                discard_batch_norm(self.deferred)
                note_written_weights(exc, [call.gm for call in self.calls])
                raise
            if training:
                commit_batch_norm(self.deferred)
            return total.detach()
        if mbs:
            refuse_input_grads(self.routeless, mbs[0])
        transport = LocalTransport(self.plan, self.calls)
        transport.inputs = mbs
        interpreter = ActionInterpreter(self.plan, self.workers, transport, self.threads)
        interpreter.begin(len(mbs), losses, checkpointing=training)
        try:
            interpreter.run(self.program(len(mbs), "actions")[1])
        except BaseException:  # the pipe stays usable: nothing of the failed step is kept
            for worker in self.workers.values():
                worker.discard()
            discard_batch_norm(self.deferred)
            raise
        if training:
            commit_batch_norm(self.deferred)
        assert interpreter.total is not None
        return interpreter.total

    def run(self, micro_batches: list[list[Any]], training: bool) -> list[Any]:
        """Run every micro-batch through every stage; return the last stage's outputs.

        Checkpointing applies only when ``training`` and autograd is enabled.
        """
        _, fn = self.program(len(micro_batches))
        self.checkpointing = training and torch.is_grad_enabled()
        return fn(self, micro_batches)

    # -- what the GPipe program calls ----------------------------------------------------
    def compute(self, j: int, i: int, inputs: tuple, checkpoint: bool) -> Any:
        """Run stage ``j`` on micro-batch ``i``'s inputs, checkpointed if asked, in its policy's pass, if training."""
        if not self.checkpointing or not self.calls[j].trains(inputs):  # a frozen stage: nothing to keep or redo
            return self.calls[j].call(i, inputs)
        return self.calls[j].call(i, inputs, "checkpoint" if checkpoint else self.passes[j])

    def clock(self, tasks: tuple) -> list[Any]:
        """Compute ``(stage, micro-batch, inputs, checkpoint)`` tasks together, a thread per device."""
        assert self.threads is not None
        return self.threads.run([(self.devices[task[0]], self.compute, task) for task in tasks])

    def copy(self, src: int, dst: int, i: int, values: tuple) -> tuple:
        """Copy micro-batch ``i``'s values from stage ``src``'s device to stage ``dst``'s."""
        out_of, into = self.calls[src].copy_stream(i), self.calls[dst].copy_stream(i)
        # timeline: time the copy on the stream it runs on, the source's when that is a GPU
        side, stream = (src, out_of) if self.devices[src].type == "cuda" else (dst, into)
        with timeline.span("copy", dst, i, self.devices[side], stream):
            return copy(values, out_of, into, self.devices[dst])

    @staticmethod
    def depend(before: Any, after: Any) -> tuple[Any, Any]:
        """Order backward: ``after``'s before ``before``'s (see :mod:`fxpipe.runtime.stage.dependency`)."""
        return depend(before, after)

