"""What a recomputation replays of its first forward: the random number generators' state, autocast.

A recomputation in backward draws the same random numbers as the forward it repeats (dropout
keeps its mask) and computes in the same precision: :func:`save_rng` and :func:`autocast_state`
capture both before the forward, :func:`restore_rng` and :func:`autocast_as` put them back
around the recomputation (and, for the RNG, restore the state from before it afterwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["autocast_as", "autocast_state", "restore_rng", "same_rng", "save_rng"]


def save_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capture the CPU RNG state and that of ``device`` if it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def same_rng(a: tuple[torch.Tensor, torch.Tensor | None], b: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    """Tell whether two captured RNG states are equal (no random number was drawn between them)."""
    if not torch.equal(a[0], b[0]):
        return False
    if a[1] is None or b[1] is None:
        return a[1] is None and b[1] is None
    return torch.equal(a[1], b[1])


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
