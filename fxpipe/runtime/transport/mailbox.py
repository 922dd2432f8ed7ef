"""The one-process transport: stages hand values over through a mailbox, on copy streams.

A value goes from the stage that makes it to every stage that reads it (skips included), and
each reader's gradient goes straight back. Between devices the copy runs on the copy
streams of both stages for that micro-batch, after the producer's compute and before the
consumer's, the same waits as the GPipe program's copies (:mod:`fxpipe.runtime.stage.copy`)::

    send:    compute[src] ─wait─▶ copy[src] ══to══▶ copy[dst]      (record_stream for both)
    receive:                                        copy[dst] ─wait─▶ compute[dst]

On CPU the copy is a plain ``.to``, and between stages on one device nothing moves.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes.spec import unflatten
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.microbatch import sum_grads, to_device
from fxpipe.runtime.stage.copy import transfer
from fxpipe.runtime.stage.stagecall import StageCall
from fxpipe.runtime.stage.stream import current_stream, wait_stream

__all__ = ["LocalTransport"]


class LocalTransport:
    """Hand values between the stages of one process, on the right device and streams."""

    def __init__(self, plan: PipelinePlan, calls: Sequence[StageCall]) -> None:
        self.plan = plan
        self.calls = list(calls)
        self.producer = plan.producer()
        self.consumers = plan.consumers()
        self.box: dict[tuple, Any] = {}
        self.lock = threading.Lock()  # stages of one clock may send from several threads
        self.inputs: list[list[Any]] = []

    def _move(self, value: Any, src: int, dst: int, i: int) -> Any:
        """Move ``value`` from stage ``src``'s device to stage ``dst``'s for micro-batch ``i``."""
        a, b = self.calls[src], self.calls[dst]
        if a.device == b.device:
            return value
        if a.device.type != "cuda" and b.device.type != "cuda":
            return to_device(value, b.device)
        leaves, spec = tree_flatten(value)
        idx = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        wait_stream(a.copy_stream(i), current_stream(a.device))  # after the compute that made it
        moved = transfer([leaves[k] for k in idx], a.copy_stream(i), b.copy_stream(i), b.device,
                         current_stream(b.device))
        for k, y in zip(idx, moved):
            leaves[k] = y
        return unflatten(spec, leaves)

    def _arrived(self, value: Any, j: int, i: int) -> Any:
        """Make stage ``j``'s compute stream wait for the copies of micro-batch ``i`` it receives."""
        wait_stream(current_stream(self.calls[j].device), self.calls[j].copy_stream(i))
        return value

    def recv_forward(self, j: int, i: int) -> list[Any]:
        """Take stage ``j``'s inputs from the mailbox (stage 0: the micro-batch)."""
        if j == 0:
            return self.inputs[i]
        with self.lock:
            values = [self.box.pop((j, "F", v, i)) for v in self.plan.stages[j].inputs]
        return self._arrived(values, j, i)

    def send_forward(self, j: int, i: int, outputs: Sequence[Any]) -> None:
        """Put each output in the mailbox of each stage that reads it."""
        for v, value in zip(self.plan.stages[j].outputs, outputs):
            for c in self.consumers.get(v, ()):
                moved = self._move(value, j, c, i)
                with self.lock:
                    self.box[(c, "F", v, i)] = moved

    def recv_backward(self, j: int, i: int) -> list[Any]:
        """Sum the gradients each output received from its consumers."""
        grads = []
        with self.lock:
            parts_of = [self.box.pop((j, "B", v, i), []) for v in self.plan.stages[j].outputs]
        for parts in parts_of:
            grads.append(sum_grads(parts) if parts else None)
        return self._arrived(grads, j, i)

    def send_backward(self, j: int, i: int, grads: Sequence[Any]) -> None:
        """Post each input's gradient to the stage that made the input."""
        for v, g in zip(self.plan.stages[j].inputs, grads):
            if g is not None and v in self.producer:
                moved = self._move(g, j, self.producer[v], i)
                with self.lock:
                    self.box.setdefault((self.producer[v], "B", v, i), []).append(moved)

