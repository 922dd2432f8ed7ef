"""The contract between a :class:`~fxpipe.Pipe` and the runtime it holds, in one process or on one rank.

Everything outside the runtime (the Pipe, checkpoints, clipping, the simulator, the divergence
finder) goes through these members and nothing else::

    Pipe ──▶ forward / step / code / sync            what users call
    Pipe ──▶ compile_stats                          torch.compile's record of this process's stages
    checkpoint ──▶ place / deferred / ready         who saves with whom, what is in flight
    Pipe ──▶ reads                                  whether this rank's inputs and target are used
    training ──▶ grad_norm / held / grad_scaler / ready
    simulate ──▶ schedule;  tools.diverge ──▶ binding
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from fxpipe.runtime.binding import Binding
from fxpipe.runtime.schedules.builtin import Schedule

__all__ = ["Place", "Runtime"]


@dataclass(frozen=True)
class Place:
    """Where this process sits for a collective over the whole pipe (a checkpoint's save)."""

    rank: int = 0  # its global rank
    world: int = 1  # the processes of the whole pipe, replicas included
    group: Any = None  # the group they save over (None: the default group, or one process)
    distributed: bool = False


class Runtime(Protocol):
    """What a Pipe's runtime provides (:class:`~fxpipe.runtime.local.LocalRuntime`,
    :class:`~fxpipe.runtime.distributed.DistributedRuntime`)."""

    schedule: Schedule  # what step runs
    binding: Binding  # how a call's arguments become the graph's placeholders and micro-batches
    deferred: list  # deferred batch norms, whose sums a checkpoint saves
    sync: bool  # reduce gradients over replicas and ties this step (off inside pipe.no_sync())

    def code(self) -> str:
        """Return what a step of ``plan.chunks`` micro-batches runs."""
        ...

    def forward(self, args: tuple, kwargs: dict, training: bool) -> Any:
        """Run the model's forward over micro-batches."""
        ...

    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, training: bool) -> torch.Tensor:
        """Run forward and backward of one mini-batch; return its loss."""
        ...

    def ready(self) -> None:
        """Make the runtime ready for a collective after a failed step (every rank meets again)."""
        ...

    def refuse(self, exc: BaseException, stepping: bool = True) -> NoReturn:
        """Raise ``exc``, a refusal of a call's own arguments, telling the other ranks first (they are in the call).

        ``stepping``: the call is ``pipe.step`` (else ``pipe(x)``).
        """
        ...

    def check_stages(self) -> None:
        """Refuse a step whose stages changed since compile in a way its schedule cannot run (before it runs)."""
        ...

    def broke(self, exc: BaseException) -> None:
        """Count a collective that failed outside a step (``fxpipe.save`` on one rank) as a failed step."""
        ...

    def place(self) -> Place:
        """Return where this process sits among the pipe's processes."""
        ...

    def reads(self) -> tuple[bool, bool]:
        """Return whether this process reads a call's inputs and its target (others may pass placeholders)."""
        ...

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Return the norm of the whole model's gradients (every stage, replica and shard) on every rank."""
        ...

    def held(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Return the parameters of ``params`` whose gradients this process holds and clips."""
        ...

    def grad_scaler(self, device: str, **kwargs: Any) -> Any:
        """Return a gradient scaler whose inf/NaN check agrees across this pipe's processes."""
        ...

    def compile_stats(self) -> dict[int, dict[str, Any]]:
        """Return torch.compile's record of each compiled stage this process runs (empty: none compiled)."""
        ...

    def runs(self) -> list[Any]:
        """Return the GraphModule each stage of this process runs (the stage's own, or its zero-bubble copy)."""
        ...
