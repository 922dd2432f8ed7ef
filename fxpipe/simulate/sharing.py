"""Measure how a process group's ranks share this machine's cores, on the model's own forward and backward.

``fxpipe.simulate(pipe, device="cpu", measured=True)`` on the gloo ranks of one machine shares
its cores among the ranks computing at once (the device model's ``slots``). How much compute
``g`` ranks get together depends on the work: a GEMM loop that lives in cache shares two cores
among four ranks like 1.9-2.0 ranks at full speed, where a small model's forward and backward
(more memory traffic, more allocations, autograd's bookkeeping) measured 1.5-1.7. So every rank
runs the model itself::

    every rank: a plain copy of the whole graph (random values of the parameters' full shapes)
    trial:      rank 0 alone runs k passes (forward, backward)     -> alone seconds
                every rank at once runs the same k passes          -> each rank's seconds
    slots = g x alone / mean(together)        median over trials, at most the cores and g

``k`` makes rank 0's loop last about 50 ms (a throughput, not one pass that may fit in a
scheduler time slice). Models whose parameters exceed ``limit`` bytes are not copied to every
rank: a loop of GEMM bursts stands in for their passes (10 bursts of about 5 ms).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable

import torch
import torch.fx

from fxpipe.passes.timing import seconds
from fxpipe.simulate.linktime import gemm_loop
from fxpipe.simulate.measure import inputs_of_rows, passes_of, plain_copy

__all__ = ["measure_sharing", "slots_of"]


def _broadcast(value: float) -> float:
    """Return rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(box, 0)
    return float(box)


def measure_sharing(gm: torch.fx.GraphModule, rows: int, example_inputs: tuple | None = None, trials: int = 5,
                    limit: float = 2**30) -> float | None:
    """Return how many ranks' worth of compute every rank at once gets, on the model's own passes (a GEMM
    loop where its parameters exceed ``limit`` bytes), the same on every rank; None in one process.

    Every rank of the default process group must call it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if sum(p.numel() * p.element_size() for p in gm.parameters()) > limit:
        loop = gemm_loop(True, calls=10)
        loop()
        return _broadcast(slots_of(loop, trials))
    copy = plain_copy(gm)
    _, both = passes_of(copy, inputs_of_rows(copy, rows, example_inputs), torch.device("cpu"))
    both()
    one = seconds(both) if dist.get_rank() == 0 else 0.0
    k = max(1, math.ceil(0.05 / max(_broadcast(one), 1e-6)))

    def passes() -> None:
        for _ in range(k):
            both()

    return _broadcast(slots_of(passes, trials))


def slots_of(loop: Callable[[], None], trials: int) -> float:
    """Return ``g x alone / mean(together)`` of ``loop`` timed on rank 0 alone, then on every rank at once,
    ``trials`` times in turn (the median; at most the cores this process may run on and ``g``).

    Every rank must call it; only rank 0's value is its measurement (the others' lack ``alone``).
    """
    import torch.distributed as dist

    g, ratios = dist.get_world_size(), []
    for _ in range(trials):  # alone and together in turn, so a change of the host's speed hits both
        dist.barrier()
        alone = seconds(loop) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        together = torch.tensor([seconds(loop)], dtype=torch.float64)
        dist.all_reduce(together)  # the ranks' sum
        ratios.append(g * alone / (float(together) / g))
    return min(statistics.median(ratios), float(len(os.sched_getaffinity(0))), float(g))
