"""The stage call: the one way every schedule runs a stage on a micro-batch.

The GPipe program (autograd connected across stages) and the action interpreter (explicit
boundaries, F/B/I/W) both call a stage through its :class:`StageCall`. :meth:`StageCall.run`
is the primitive; every pass of every schedule goes through it::

    run(i, inputs, "forward")            grad as the caller's; the activations are kept
    run(i, inputs, "checkpoint")         no_grad, is_checkpointing(); replay_point() before
    run(i, inputs, "recompute", replay)  grad, is_recomputing(), the saved CPU and CUDA RNG
                                         state and autocast state, a "recompute" event

Around the stage it makes the stage's device current and, when the stage raises, notes on
the exception the stage, its device, the node and the pass (:mod:`fxpipe.runtime.observe.blame`).
:meth:`StageCall.call` is the GPipe program's use: stream waits in and out, a "forward"
event, checkpointing through :func:`fxpipe.runtime.stage.recompute.checkpointed`, and the hooks
that time the call's backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxpipe.runtime.observe import timeline
from fxpipe.runtime.observe.blame import keep_tracebacks, note_failure
from fxpipe.runtime.stage.compiled import CompiledStage
from fxpipe.runtime.stage.copy import wait
from fxpipe.runtime.stage.recompute import checkpointed, in_pass, is_checkpointing, is_recomputing
from fxpipe.runtime.stage.stream import AbstractStream, current_stream, new_stream, on_device

__all__ = ["Replay", "StageCall", "autocast_as", "autocast_state", "restore_rng", "save_rng"]

_GRAD = {"forward": nullcontext, "checkpoint": torch.no_grad, "recompute": torch.enable_grad}
_FLAG = {"checkpoint": "checkpointing", "recompute": "recomputing"}


def save_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capture the CPU RNG state and that of ``device`` if it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def restore_rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run the block with a saved RNG state, then put back the state from before."""
    cpu, cuda = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Return what autocast does now, on CPU and CUDA: ``(device type, enabled, dtype)`` each."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


@contextmanager
def autocast_as(state: tuple[tuple[str, bool, torch.dtype], ...]) -> Iterator[None]:
    """Run the block under a saved autocast state (another thread's, or a forward's for its recompute)."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            if enabled or torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


@dataclass
class Replay:
    """What a recomputation needs from its checkpointed forward: RNG and autocast state, the timeline call."""

    rng: tuple[torch.Tensor, torch.Tensor | None]
    where: Any  # the recorder's call of the forward, or None when no timeline records
    autocast: tuple = ()


class StageCall:
    """Stage ``index`` of the plan on its device: run it on one micro-batch in any pass."""

    def __init__(self, index: int, fn: Callable, gm: torch.fx.GraphModule, device: torch.device,
                 last: bool) -> None:
        self.index = index
        self.fn = fn  # the stage GraphModule, a wrapper reading parameters from other devices, or compiled
        self.compiled = fn if isinstance(fn, CompiledStage) else None  # torch.compile's record of the stage
        self.gm = gm  # what error notes look nodes up in
        keep_tracebacks(gm)
        self.device = device
        self.last = last
        self._copy_streams: list[AbstractStream] = []

    def copy_stream(self, i: int) -> AbstractStream:
        """Return this stage's copy stream for micro-batch ``i`` (None on CPU)."""
        while len(self._copy_streams) <= i:
            self._copy_streams.append(new_stream(self.device))
        return self._copy_streams[i]

    def span(self, kind: str, i: int) -> Any:
        """Time the block as a ``kind`` event of this stage and micro-batch ``i`` on the timeline."""
        return timeline.span(kind, self.index, i, self.device)

    def replay_point(self) -> Replay:
        """Capture what a later recomputation of the coming checkpointed forward needs."""
        return Replay(save_rng(self.device), timeline.where(), autocast_state())

    def run(self, i: int, inputs: Any, how: str = "forward", replay: Replay | None = None) -> Any:
        """Call the stage on micro-batch ``i``'s inputs in pass ``how``; see the module docstring."""
        recompute = how == "recompute"
        if recompute and replay is None:
            raise ValueError("a recomputation needs the Replay of its checkpointed forward")
        replay = replay if recompute else None  # only a recomputation replays
        with on_device(self.device), _GRAD[how](), (in_pass(_FLAG[how]) if how in _FLAG else nullcontext()), \
                (restore_rng(self.device, replay.rng) if replay is not None else nullcontext()), \
                (autocast_as(replay.autocast) if replay is not None else nullcontext()), \
                (timeline.span_at("recompute", replay.where) if replay is not None else nullcontext()):
            try:
                return self.fn(*inputs)
            except Exception as exc:
                note_failure(exc, self.gm, self.index, self.device, _pass())
                raise

    def call(self, i: int, inputs: tuple, checkpoint: bool) -> Any:
        """Run micro-batch ``i`` with autograd connected across stages (the GPipe program's call)."""
        cuda = self.device.type == "cuda"
        if cuda:  # the copies that brought the inputs are done before the stage reads them
            compute_stream = current_stream(self.device)
            inputs = wait(inputs, self.copy_stream(i), compute_stream)
        with self.span("forward", i) as timed:
            out = checkpointed(self, i, inputs) if checkpoint else self.run(i, inputs)
        out = timeline.mark_backward(timed, inputs, out)  # timeline: hooks only while recording
        if cuda and not self.last:  # copies of the outputs wait for the compute that made them
            out = wait(out, compute_stream, self.copy_stream(i))
        return out


def _pass() -> str:
    """Name the pass a stage is running in (for an error note)."""
    if is_recomputing():
        return "recomputation in backward"
    if is_checkpointing():
        return "checkpointed forward"
    return "forward"
