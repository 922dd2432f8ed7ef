"""Run a plan in one process, one device per stage.

``pipe(x)`` runs the generated GPipe schedule (:mod:`fxpipe.runtime.codegen`) with autograd connected
across stages, so the user's ``backward`` flows through every stage; this module provides
what that code calls: ``compute`` (a stage on one micro-batch, checkpointed or not, between
stream waits), ``copy`` (to another stage's device on copy streams) and ``depend`` (fork/join
ordering of backward). ``pipe.step`` runs GPipe the same way, and 1F1B through the action
engine (:mod:`fxpipe.runtime.actions`) with explicit per-stage backward.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from fxpipe.runtime.actions import ActionRunner, LocalTransport, compile_actions
from fxpipe.runtime.batchnorm import commit_batch_norm
from fxpipe.tools import recorder
from fxpipe.runtime.checkpoint import checkpointed
from fxpipe.runtime.codegen import compile_source, gpipe_source
from fxpipe.runtime.copy import copy, wait
from fxpipe.runtime.dependency import depend
from fxpipe.runtime.microbatch import gather, micro_losses
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.signature import CallSignature
from fxpipe.runtime.stream import current_stream, new_stream, on_device
from fxpipe.runtime.threads import DeviceThreads
from fxpipe.runtime.worker import StageWorker

__all__ = ["LocalRuntime"]

log = logging.getLogger(__name__)


class LocalRuntime:
    """Execute a plan's stages over micro-batches in this process."""

    def __init__(self, plan: PipelinePlan, stage_fns: Sequence[Callable], devices: Sequence[torch.device],
                 signature: CallSignature) -> None:
        self.plan = plan
        self.stage_fns = list(stage_fns)
        self.devices = list(devices)
        self.signature = signature
        self.checkpointing = False
        self.deferred: list = []  # batch norms whose running statistics wait for the mini-batch
        self._programs: dict[tuple[str, int], tuple[str, Callable]] = {}
        self._copy_streams: list[list] = [[] for _ in devices]
        self.threads: DeviceThreads | None = None
        self.use_threads(len({d for d in self.devices if d.type == "cuda"}) > 1)
        n = plan.n_stages
        self.workers = {j: StageWorker(j, fn, self.devices[j], [v in plan.stages[j].grad_inputs
                                                                 for v in plan.stages[j].inputs], j == n - 1,
                                                  defer=plan.schedule == "zb")
                        for j, fn in enumerate(self.stage_fns)}

    def use_threads(self, on: bool) -> None:
        """Compute each clock's stages on one worker thread per device (the CUDA default)."""
        if self.threads is not None:
            self.threads.close()
        self.threads = DeviceThreads(self.devices) if on else None
        self._programs.clear()

    # -- the generated programs ------------------------------------------------------
    def program(self, m: int, kind: str = "gpipe") -> tuple[str, Callable]:
        """Return the source and function of a schedule for ``m`` micro-batches, compiled once.

        ``kind`` is ``"gpipe"`` (the autograd-connected forward) or ``"actions"`` (the plan's
        schedule as forward and backward actions, for ``step``).
        """
        key = (kind, m)
        if key not in self._programs:
            if kind == "gpipe":
                name = f"gpipe_{self.plan.n_stages}x{m}"
                source = gpipe_source(self.plan, m, name, threaded=self.threads is not None)
                self._programs[key] = (source, compile_source(source, name, f"<fxpipe {name}>"))
            else:
                self._programs[key] = compile_actions(self.plan, m, list(range(self.plan.n_stages)),
                                                      self.plan.schedule)
        return self._programs[key]

    def code(self) -> str:
        """Return the source of the program ``step`` runs for ``plan.chunks`` micro-batches."""
        kind = "gpipe" if self.plan.schedule == "gpipe" else "actions"
        return self.program(self.plan.chunks, kind)[0]

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run the model's forward over micro-batches; return the model's output structure."""
        mbs, _ = self.signature.split(args, kwargs, self.plan.chunks, training, self.devices[0])
        output = gather(self.run(mbs, training))
        if training:
            commit_batch_norm(self.deferred)
        return self.signature.finish(output)

    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run forward and backward of one mini-batch with a loss per micro-batch; return the loss."""
        if not torch.is_grad_enabled():
            raise RuntimeError("pipe.step runs backward and needs autograd; call it outside torch.no_grad()")
        mbs, batch = self.signature.split(args, kwargs, self.plan.chunks, training, self.devices[0])
        losses = micro_losses(loss_fn, target, batch, len(mbs), self.devices[-1], self.signature.finish)
        if self.plan.schedule == "gpipe":
            outputs = self.run(mbs, training)
            if training:
                commit_batch_norm(self.deferred)
            total = sum((losses[i](out) for i, out in enumerate(outputs[1:], 1)), losses[0](outputs[0]))
            total.backward()
            return total.detach()
        transport = LocalTransport(self.plan, self.devices)
        transport.inputs = mbs
        runner = ActionRunner(self.plan, self.workers, transport)
        runner.begin(len(mbs), losses, checkpointing=training)
        self.program(len(mbs), "actions")[1](runner)
        if training:
            commit_batch_norm(self.deferred)
        assert runner.total is not None
        return runner.total

    def run(self, micro_batches: list[list[Any]], training: bool) -> list[Any]:
        """Run every micro-batch through every stage; return the last stage's outputs.

        Checkpointing applies only when ``training`` and autograd is enabled.
        """
        _, fn = self.program(len(micro_batches))
        self.checkpointing = training and torch.is_grad_enabled()
        return fn(self, micro_batches)

    # -- what the program calls ----------------------------------------------------------
    def copy_stream(self, j: int, i: int):
        """Return stage ``j``'s copy stream for micro-batch ``i`` (None on CPU)."""
        streams = self._copy_streams[j]
        while len(streams) <= i:
            streams.append(new_stream(self.devices[j]))
        return streams[i]

    def compute(self, j: int, i: int, inputs: tuple, checkpoint: bool) -> Any:
        """Run stage ``j`` on micro-batch ``i``'s inputs, checkpointed if asked and training."""
        device = self.devices[j]
        fn = self.stage_fns[j]
        if device.type == "cuda":
            compute_stream = current_stream(device)
            inputs = wait(inputs, self.copy_stream(j, i), compute_stream)
        with on_device(device), recorder.span("forward", j, i, device) as call:  # timeline
            if checkpoint and self.checkpointing:
                out = checkpointed(fn, inputs, device)
            else:
                out = fn(*inputs)
        out = recorder.mark_backward(call, inputs, out)  # timeline: hooks only while recording
        if device.type == "cuda" and j < self.plan.n_stages - 1:
            out = wait(out, compute_stream, self.copy_stream(j, i))
        return out

    def clock(self, tasks: tuple) -> list[Any]:
        """Compute ``(stage, micro-batch, inputs, checkpoint)`` tasks together, a thread per device."""
        assert self.threads is not None
        return self.threads.run([(self.devices[task[0]], self.compute, task) for task in tasks])

    def copy(self, src: int, dst: int, i: int, values: tuple) -> tuple:
        """Copy micro-batch ``i``'s values from stage ``src``'s device to stage ``dst``'s."""
        with recorder.span("copy", dst, i, self.devices[dst], self.copy_stream(dst, i)):  # timeline
            return copy(values, self.copy_stream(src, i), self.copy_stream(dst, i), self.devices[dst])

    @staticmethod
    def depend(before: Any, after: Any) -> tuple[Any, Any]:
        """Order backward: ``after``'s before ``before``'s (see :mod:`fxpipe.runtime.dependency`)."""
        return depend(before, after)
