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

The buffers are those of every module ``loss_fn`` refers to or calls (see :class:`LossState`),
and the random state includes the generators these hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from fxpipe.runtime.stage.rng import RngState, held, held_generators, restore_rng, save_rng

__all__ = ["LossReplay", "LossState", "first_loss", "kept", "replaying"]


@dataclass
class LossState:
    """What a ``loss_fn`` call may change besides its value: its modules' buffers, its own generators.

    The modules are those ``loss_fn`` refers to (a bound method's module, a closure's, with their
    submodules: a submodule's ``.forward()`` called directly, ``F.batch_norm`` on a module's own
    buffers) and those it calls (a global forward pre-hook finds them); the generators are those
    it or these modules hold.
    """

    buffers: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    generators: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    copies: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, module: nn.Module) -> None:
        """Copy the buffers of ``module`` and its submodules, and save its generators' states (each once)."""
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and not b.is_meta and (id(m), name) not in self.buffers:
                    if id(b) not in self.copies:  # a buffer two modules share: one copy
                        self.copies[id(b)] = b.detach().clone()
                    self.buffers[(id(m), name)] = (m, name, b, self.copies[id(b)])
            self.add_generators(held_generators(m))

    def add_generators(self, generators: list[torch.Generator]) -> None:
        """Save the states of ``generators`` not saved yet."""
        for g in generators:
            self.generators.setdefault(id(g), (g, g.get_state()))

    def changed(self) -> tuple[list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]],
                               list[tuple[torch.Generator, torch.Tensor]]]:
        """Return the buffers (reassigned or written) and generators (drawn from) the call changed.

        Told by value (batch norm's kernel updates its statistics without bumping their version
        counters), compared on each device at once: one wait for a GPU, not one per buffer.
        """
        entries = list(self.buffers.values())
        kept = [m._buffers.get(name) is b for m, name, b, _ in entries]
        by_device: dict[torch.device, list[int]] = {}
        for k, (_, _, b, copy) in enumerate(entries):
            if kept[k] and b.shape == copy.shape:  # resized in place: changed
                by_device.setdefault(b.device, []).append(k)
            else:
                kept[k] = False
        for positions in by_device.values():
            same = torch.stack([(entries[k][2] == entries[k][3]).all() for k in positions]).tolist()
            for k, equal in zip(positions, same):
                kept[k] = bool(equal)
        buffers = [entry for entry, unchanged in zip(entries, kept) if not unchanged]
        generators = [(g, st) for g, st in self.generators.values() if not torch.equal(g.get_state(), st)]
        return buffers, generators


@contextmanager
def watching(loss: Callable[..., Any]) -> Iterator[LossState]:
    """Run the block with what ``loss`` refers to and calls recorded as it was before (a :class:`LossState`)."""
    state = LossState()
    for module in held(loss, nn.Module):
        state.add(module)
    state.add_generators(held_generators(loss))
    handle = register_module_forward_pre_hook(lambda module, args: state.add(module))
    try:
        yield state
    finally:
        handle.remove()


@dataclass
class LossReplay:
    """The random state a ``loss_fn`` call started from, and the buffers it changed (each with a copy)."""

    rng: RngState
    buffers: list[tuple[nn.Module, str, torch.Tensor]]


def first_loss(loss: Callable[[Any], torch.Tensor], out: Any, device: torch.device) -> tuple[torch.Tensor,
                                                                                            LossReplay]:
    """Call ``loss(out)`` without a graph; return its value and what a replay of the call needs."""
    cpu, cuda, _ = save_rng(device)
    with watching(loss) as state, torch.no_grad():
        value = loss(out)
    buffers, generators = state.changed()
    return value, LossReplay((cpu, cuda, tuple(generators)), [(m, name, copy) for m, name, _, copy in buffers])


@contextmanager
def replaying(replay: LossReplay, device: torch.device) -> Iterator[None]:
    """Run the block from the replay's random state and buffers; put back the current ones after.

    Swapped, not copied: autograd may have saved a buffer for a backward still to come.
    """
    current = [(m, name, m._buffers.get(name)) for m, name, _ in replay.buffers]
    with restore_rng(device, replay.rng):
        for m, name, copied in replay.buffers:
            m._buffers[name] = copied
        try:
            yield
        finally:
            for m, name, b in current:
                m._buffers[name] = b


@contextmanager
def kept(loss: Callable[..., Any]) -> Iterator[None]:
    """Run the block (a look at ``loss``) and put back the buffers and generators it changed.

    A changed buffer is given back as its copy, not written over: autograd may have saved it.
    """
    with watching(loss) as state:
        yield
    buffers, generators = state.changed()
    for m, name, _, copy in buffers:
        m._buffers[name] = copy
    for g, st in generators:
        g.set_state(st)
