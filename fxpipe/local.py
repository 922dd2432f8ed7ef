"""Run a plan in one process, one device per stage, with the generated GPipe schedule.

The schedule itself is generated code (:mod:`fxpipe.codegen`); this module provides what it
calls: ``compute`` (a stage on one micro-batch, checkpointed or not, between stream waits),
``copy`` (to another stage's device on copy streams) and ``depend`` (fork/join ordering of
backward). Backward is autograd's: the user calls ``backward`` on the gathered output.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from fxpipe import recorder
from fxpipe.checkpoint import checkpointed
from fxpipe.codegen import compile_source, gpipe_source
from fxpipe.copy import copy, wait
from fxpipe.dependency import depend
from fxpipe.plan import PipelinePlan
from fxpipe.stream import current_stream, new_stream, on_device

__all__ = ["LocalRuntime"]

log = logging.getLogger(__name__)


class LocalRuntime:
    """Execute a plan's stages over micro-batches in this process."""

    def __init__(self, plan: PipelinePlan, stage_fns: Sequence[Callable], devices: Sequence[torch.device]) -> None:
        self.plan = plan
        self.stage_fns = list(stage_fns)
        self.devices = list(devices)
        self.checkpointing = False
        self._programs: dict[int, tuple[str, Callable]] = {}
        self._copy_streams: list[list] = [[] for _ in devices]

    # -- the generated program -------------------------------------------------------
    def program(self, m: int) -> tuple[str, Callable]:
        """Return the source and function of the schedule for ``m`` micro-batches, compiled once."""
        if m not in self._programs:
            name = f"gpipe_{self.plan.n_stages}x{m}"
            source = gpipe_source(self.plan, m, name)
            self._programs[m] = (source, compile_source(source, name, f"<fxpipe {name}>"))
        return self._programs[m]

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

    def copy(self, src: int, dst: int, i: int, values: tuple) -> tuple:
        """Copy micro-batch ``i``'s values from stage ``src``'s device to stage ``dst``'s."""
        with recorder.span("copy", dst, i, self.devices[dst], self.copy_stream(dst, i)):  # timeline
            return copy(values, self.copy_stream(src, i), self.copy_stream(dst, i), self.devices[dst])

    @staticmethod
    def depend(before: Any, after: Any) -> tuple[Any, Any]:
        """Order backward: ``after``'s before ``before``'s (see :mod:`fxpipe.dependency`)."""
        return depend(before, after)
