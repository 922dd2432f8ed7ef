"""What a recomputation replays of its first forward: the random number generators' state, autocast.

A recomputation in backward draws the same random numbers as the forward it repeats (dropout
keeps its mask) and computes in the same precision: :func:`save_rng` and :func:`autocast_state`
capture both before the forward, :func:`restore_rng` and :func:`autocast_as` put them back
around the recomputation (and, for the RNG, restore the state from before it afterwards).

A stage replays the generator of its own device only. A stage on a GPU leaves the CPU's
generator alone: its forward and its recomputation run on that GPU's thread (the device
threads, autograd's device thread) while a stage on the CPU draws from the CPU's generator on
another thread, and setting the CPU's state from the GPU's thread would change the masks the
CPU stage draws (seen on an H200 with ``devices=["cuda:0", "cpu"]``). Random numbers that a
GPU stage draws on the CPU are therefore not replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["autocast_as", "autocast_state", "restore_rng", "same_rng", "save_rng"]


RngState = tuple[torch.Tensor | None, torch.Tensor | None]  # (the CPU's, the CUDA device's): one is None


def save_rng(device: torch.device) -> RngState:
    """Capture the RNG state of ``device``: its CUDA generator's, or the CPU's for any other device."""
    if device.type == "cuda":
        return None, torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), None


def same_rng(a: RngState, b: RngState) -> bool:
    """Tell whether two captured RNG states are equal (no random number was drawn between them)."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


@contextmanager
def restore_rng(device: torch.device, state: RngState) -> Iterator[None]:
    """Run the block with a saved RNG state, then put back the state from before."""
    cpu, cuda = state
    if cuda is not None:
        before = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(cuda, device)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(before, device)
        return
    with torch.random.fork_rng(devices=[]):
        if cpu is not None:
            torch.set_rng_state(cpu)
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
