"""Find a ``balance`` for :class:`~fxpipe.compat.torchgpipe.GPipe` automatically.

::

    from fxpipe.compat.torchgpipe import GPipe
    from fxpipe.compat.torchgpipe.balance import balance_by_time

    balance = balance_by_time(4, model, torch.empty(128, 3, 224, 224), device="cuda:0")
    model = GPipe(model, balance, chunks=8)

Each layer is measured (time with fxpipe's profiler, or the memory its forward keeps), then
fxpipe's exact partitioner cuts the layers into the contiguous groups with the least largest
cost (:mod:`~fxpipe.compat.torchgpipe.balance.blockpartition`). ``fxpipe.compile`` does the
same on the whole graph, without an ``nn.Sequential`` or a balance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fxpipe.compat.torchgpipe.balance import blockpartition
from fxpipe.compat.torchgpipe.balance.profile import profile_sizes, profile_times

__all__ = ["balance_by_size", "balance_by_time"]

Device = torch.device | int | str


def _device(device: Device | None) -> torch.device:
    """Return the profiling device: the one given, else CUDA as in torchgpipe, else (no CUDA here) the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def balance_cost(cost: Sequence[float], partitions: int) -> list[int]:
    """Return the number of layers in each of ``partitions`` groups cutting ``cost`` best."""
    return [len(block) for block in blockpartition.solve(list(cost), partitions)]


def balance_by_time(partitions: int, module: nn.Sequential, sample: Any, *, timeout: float = 1.0,
                    device: Device | None = None) -> list[int]:
    """Return a balance of ``module`` into ``partitions`` groups of equal forward + backward time.

    ``sample`` is an example input (a tensor or a tuple of tensors, any batch size); each
    layer runs on copies on ``device`` (default: CUDA as in torchgpipe, the CPU on a machine
    without it; CPU works too), and profiling repeats until
    ``timeout`` seconds have passed. Raises ValueError if a parameter already has a gradient.
    """
    return balance_cost(profile_times(module, sample, timeout, _device(device)), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Any, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Device | None = None) -> list[int]:
    """Return a balance of ``module`` into ``partitions`` groups of equal memory.

    A layer's memory is what its forward keeps alive for one micro-batch of ``input`` (the
    mini-batch to train, split into ``chunks``), plus its parameters times ``param_scale``
    (2 for SGD's weights and gradients, 4-5 for Adam). Unlike torchgpipe, CPU devices work (the
    default device is CUDA where there is one, else the CPU).
    Raises ValueError if a parameter already has a gradient.
    """
    return balance_cost(profile_sizes(module, input, chunks, param_scale, _device(device)),
                        partitions)
