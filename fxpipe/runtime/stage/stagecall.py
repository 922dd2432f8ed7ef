"""The stage call: the one way every schedule runs a stage on a micro-batch.

The GPipe program (autograd connected across stages) and the action interpreter (explicit
boundaries, F/B/I/W) both call a stage through its :class:`StageCall`. :meth:`StageCall.run`
is the primitive; every pass of every schedule goes through it::

    run(i, inputs, "forward")            grad as the caller's; the activations are kept
    run(i, inputs, "checkpoint")         no_grad, is_checkpointing(); replay_point() before
    run(i, inputs, "recompute", replay)  grad, is_recomputing(), the saved CPU and CUDA RNG
                                         state and autocast state, a "recompute" event, the
                                         buffers the forward read as they were then, and every
                                         buffer it writes put back after it (:mod:`keepstate`)
    run(i, inputs, "selective")          grad, is_checkpointing(), saved tensors placed by the
                                         stage's saver (:mod:`fxpipe.runtime.stage.selective`:
                                         the cheap ones recomputed in backward, one segment at a time)
    run(i, inputs, "offload")            grad, saved tensors moved to host memory and back
                                         (:mod:`fxpipe.runtime.stage.offload`)

Around the stage it makes the stage's device current and, when the stage raises, notes on
the exception the stage, its device, the node and the pass (:mod:`fxpipe.runtime.observe.blame`).
:meth:`StageCall.call` is the GPipe program's use: stream waits in and out, a "forward"
event, checkpointing through :func:`fxpipe.runtime.stage.recompute.checkpointed`, and the hooks
that time the call's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpipe.passes.nesting import levels_restored
from fxpipe.runtime.observe import timeline
from fxpipe.runtime.observe.blame import keep_tracebacks, note_failure
from fxpipe.runtime.stage.compiled import CompiledStage
from fxpipe.runtime.stage.copy import wait
from fxpipe.runtime.stage.keepstate import (
    bumped,
    changed,
    private_statistics,
    replayed,
    snapshot,
    versions,
    written_buffers,
)
from fxpipe.runtime.stage.normcalls import counting
from fxpipe.runtime.stage.recompute import checkpointed, in_pass, is_checkpointing, is_recomputing
from fxpipe.runtime.stage.rng import (
    RngState,
    autocast_as,
    autocast_state,
    restore_rng,
    save_rng,
    stage_generators,
    with_inputs,
)
from fxpipe.runtime.stage.stream import AbstractStream, current_stream, new_stream, on_device

__all__ = ["Replay", "StageCall", "autocast_as", "autocast_state", "restore_rng", "save_rng"]

_GRAD = {"forward": nullcontext, "checkpoint": torch.no_grad, "recompute": torch.enable_grad,
         "selective": nullcontext, "offload": nullcontext}
_FLAG = {"checkpoint": "checkpointing", "recompute": "recomputing", "selective": "checkpointing"}
SAVING = ("selective", "offload")  # passes whose saved tensors the stage's saver places


@dataclass
class Replay:
    """What a recomputation needs from its checkpointed forward: RNG, autocast and buffer state, the timeline call."""

    rng: RngState
    where: Any  # the recorder's call of the forward, or None when no timeline records
    autocast: tuple = ()
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # copies of the buffers the forward writes


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
        self.replay_cpu = True  # False for a GPU stage beside a CPU stage in one process (stage/rng.py)
        self.generators = stage_generators(gm)  # the model's own generators the stage draws from, replayed too
        self._copy_streams: list[AbstractStream] = []
        # where the saved tensors of a "selective" or "offload" forward go (the stage's policy), or None
        self.saver: Any = None
        self.around: Callable[[], Any] = nullcontext  # a context every call of the stage runs in
        self._written: list[str] | None = None  # the buffers a forward updates, kept through a recomputation
        self._probed = False  # the first checkpointed forward has shown which buffers its leaf modules write
        self._norms: set[str] | None = None  # batch norms' statistics: discarded by a recomputation, not replayed
        self._replayed: list[str] | None = None  # the buffers a replay point copies, once probed

    def trains(self, inputs: Any) -> bool:
        """Tell whether a forward on ``inputs`` has a backward: a parameter or an input tensor needs a gradient.

        A stage that has none (a frozen encoder before trainable stages) is not checkpointed: its
        recomputation would run for a backward that does nothing.
        """
        return any(p.requires_grad for p in self.gm.parameters()) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(inputs)[0])

    def copy_stream(self, i: int) -> AbstractStream:
        """Return this stage's copy stream for micro-batch ``i`` (None on CPU)."""
        while len(self._copy_streams) <= i:
            self._copy_streams.append(new_stream(self.device))
        return self._copy_streams[i]

    def span(self, kind: str, i: int) -> Any:
        """Time the block as a ``kind`` event of this stage and micro-batch ``i`` on the timeline."""
        return timeline.span(kind, self.index, i, self.device)

    def replay_point(self, inputs: Any = ()) -> Replay:
        """Capture what a later recomputation of the coming checkpointed forward on ``inputs`` needs."""
        generators = with_inputs(self.generators, inputs)  # a generator given as an input is replayed too
        return Replay(save_rng(self.device, self.replay_cpu, generators), timeline.where(), autocast_state(),
                      snapshot(self.gm, self._to_copy()))

    def _to_copy(self) -> list[str]:
        """Return the buffers a replay point copies (found once the first checkpointed forward has run)."""
        if self._replayed is not None:
            return self._replayed
        if self._norms is None:
            self._norms = private_statistics(self.gm)  # read by nothing but their norm's training-mode call
        # until a forward has shown what it writes: any buffer (a leaf's forward, a fused kernel may write it unseen)
        names = self.written() if self._probed else [*self.written(), *(n for n, _ in self.gm.named_buffers())]
        names = [n for n in dict.fromkeys(names) if n not in self._norms]
        if self._probed:
            self._replayed = names
        return names

    def run(self, i: int, inputs: Any, how: str = "forward", replay: Replay | None = None) -> Any:
        """Call the stage on micro-batch ``i``'s inputs in pass ``how``; see the module docstring."""
        recompute = how == "recompute"
        if recompute and replay is None:
            raise ValueError("a recomputation needs the Replay of its checkpointed forward")
        if how in SAVING and self.saver is None:
            raise ValueError(f"stage {self.index} has no {how} policy to run a {how} forward with")
        replay = replay if recompute else None  # only a recomputation replays
        with on_device(self.device), _GRAD[how](), (in_pass(_FLAG[how]) if how in _FLAG else nullcontext()), \
                (restore_rng(self.device, replay.rng) if replay is not None else nullcontext()), \
                autocast_as(replay.autocast if replay is not None else autocast_state()), \
                (timeline.span_at("recompute", replay.where) if replay is not None else nullcontext()), \
                (replayed(self.gm, self.written(), replay.buffers) if replay is not None else nullcontext()), \
                (self.saver.recording(i, inputs) if how in SAVING else nullcontext()) as record, self.around():
            probe = (versions(self.gm), snapshot(self.gm, [n for n, _ in self.gm.named_buffers()])) \
                if how == "checkpoint" and not self._probed else None  # every buffer: a fused kernel writes unseen
            try:
                with counting(self.index), levels_restored():  # batch norms' calls told apart; no vmap left open
                    out = self.fn(*inputs)
                if probe is not None:
                    self._found(bumped(self.gm, probe[0]) + changed(self.gm, probe[1]))
            except Exception as exc:
                note_failure(exc, self.gm, self.index, self.device, _pass())
                raise
            if record is not None:
                record.outputs = out  # what stays on the device anyway (offload)
            return out

    def written(self) -> list[str]:
        """Return the names of the buffers a forward of the stage updates (its graph's, and those a forward showed)."""
        if self._written is None:
            self._written = written_buffers(self.gm)
        return self._written

    def _found(self, names: list[str]) -> None:
        """Add the buffers a checkpointed forward wrote in place (a leaf module's own) to those it updates."""
        self._written = list(dict.fromkeys([*self.written(), *names]))
        self._probed = True

    def call(self, i: int, inputs: tuple, how: str = "forward") -> Any:
        """Run micro-batch ``i`` with autograd connected across stages (the GPipe program's call).

        ``how`` is ``"forward"``, ``"checkpoint"`` (through :func:`checkpointed`), or the stage's
        saving pass (``"selective"``, ``"offload"``).
        """
        cuda = self.device.type == "cuda"
        if cuda:  # the copies that brought the inputs are done before the stage reads them
            compute_stream = current_stream(self.device)
            inputs = wait(inputs, self.copy_stream(i), compute_stream)
        with self.span("forward", i) as timed:
            out = checkpointed(self, i, inputs) if how == "checkpoint" else self.run(i, inputs, how)
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
