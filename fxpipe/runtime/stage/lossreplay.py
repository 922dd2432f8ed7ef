"""Run a checkpointed last stage's ``loss_fn`` again in backward as it ran in forward.

A checkpointed micro-batch's loss is computed in forward without a graph (for the value
``pipe.step`` returns) and again with one once backward has recomputed the stage. A ``loss_fn``
calling modules of its own (a GAN's discriminator: dropout, batch norm, spectral norm) would draw
other random numbers the second time, and update those modules' buffers twice (batch norm's
running statistics, spectral norm's power iteration: gradients 18-25% off eager's). The second
call runs from the random state and the buffers of the first, and both are put back after::

    forward    loss_fn(out)            no graph   random r0 -> r1, buffers b0 -> b1 (kept)
    ...        other micro-batches                random, buffers move on: r2, b2
    backward   loss_fn(recomputed)     graph      from r0 and copies of b0; r2, b2 put back

The buffers are those of every module called inside ``loss_fn`` (a global forward pre-hook
copies each one's before it runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from fxpipe.runtime.stage.rng import RngState, restore_rng, save_rng

__all__ = ["LossReplay", "first_loss", "replaying"]


@dataclass
class LossReplay:
    """The random state a ``loss_fn`` call started from, and the buffers it found (each with a copy)."""

    rng: RngState
    buffers: list[tuple[torch.Tensor, torch.Tensor]]


def first_loss(loss: Callable[[Any], torch.Tensor], out: Any, device: torch.device) -> tuple[torch.Tensor,
                                                                                            LossReplay]:
    """Call ``loss(out)`` without a graph; return its value and what a replay of the call needs."""
    rng = save_rng(device)
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def copy_buffers(module: nn.Module, args: Any) -> None:
        """Copy the buffers of a module ``loss_fn`` calls, the first time it calls it."""
        for b in module._buffers.values():
            if b is not None and id(b) not in found and not b.is_meta:
                found[id(b)] = (b, b.detach().clone())

    handle = register_module_forward_pre_hook(copy_buffers)
    try:
        with torch.no_grad():
            value = loss(out)
    finally:
        handle.remove()
    return value, LossReplay(rng, list(found.values()))


@contextmanager
def replaying(replay: LossReplay, device: torch.device) -> Iterator[None]:
    """Run the block from the replay's random state and buffers; put back the current ones after.

    Swapped, not copied: autograd may have saved a buffer for a backward still to come.
    """
    current = [(b, b.data) for b, _ in replay.buffers]
    with restore_rng(device, replay.rng):
        with torch.no_grad():
            for b, copied in replay.buffers:
                b.data = copied
        try:
            yield
        finally:
            for b, data in current:
                b.data = data
