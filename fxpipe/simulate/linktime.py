"""Measure this process group's links for the simulator: a message's and a collective's latency and bandwidth.

``fxpipe.simulate(pipe, measured=True)`` on the ranks of a distributed pipe on CPUs times the
links the step will use, as it times the nodes, instead of taking the CPU model's assumed ones::

    ping-pong, ranks 0 <-> 1, two sizes     one way:    latency + bytes / bandwidth
    all-reduce over every rank, two sizes   a ring:     2 (g - 1) x latency + 2 (g - 1) / g x bytes / bandwidth

Each is the median of a few repetitions after a warm-up; the two sizes give the line's slope
(the bandwidth) and intercept (the latency). The ping-pong sets the pipeline hop
(``link_latency``, ``link_bandwidth``), the all-reduce the collectives of replicas and
tensor-parallel groups (``tp_latency``, ``tp_bandwidth``). Every rank must call it (it runs
collectives), as every rank calls ``fxpipe.simulate`` on a distributed pipe; every rank gets
rank 0's fit.

It also measures how the ranks share this machine's cores (``slots``): a GEMM loop timed on
rank 0 alone, then on every rank at once. ``g`` ranks that each take ``together`` seconds for
what one takes ``alone`` seconds by itself compute like ``g x alone / together`` ranks at full
speed: 4 ranks on 2 cores measured 1.8 here, not the 2 the core count says (caches and memory
bandwidth are shared too, and the scheduler switches between the ranks).

And what a message costs a rank that computed up to it (``wake_latency``): ranks 0 and 1 both
run the GEMM loop, then exchange a small message as the runtime does (receive posted, send,
wait); the time beyond the compute and an idle one-way message is the waiting rank's
resumption. On this machine's virtual cores it came to 1-2.5 ms, where the same exchange between
ranks doing nothing else takes 0.1 ms (gloo's receiving thread and the woken rank wait for a
core). The simulator charges it to every action that waits for a message and to every ring step
of a collective (``tp_latency``, which replicas' and tensor-parallel groups' collectives cross:
each step waits for a peer).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from fxpipe.passes.timing import median_seconds
from fxpipe.simulate.devices import DeviceModel

__all__ = ["measure_links"]

log = logging.getLogger(__name__)

SIZES = (16 * 2**10, 2 * 2**20)  # bytes: a small message and a large one


def _line(small: float, large: float) -> tuple[float, float]:
    """Return ``(intercept, bytes per second)`` of the line through the two sizes' seconds."""
    slope = max((large - small) / (SIZES[1] - SIZES[0]), 1e-15)
    return max(small - slope * SIZES[0], 0.0), 1.0 / slope


def _median(fn, repeats: int) -> float:
    """Return the median seconds of ``fn`` over ``repeats`` calls after two warm-up calls."""
    import torch.distributed as dist

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(nbytes: int, repeats: int) -> float:
    """Return one way's seconds of a ``nbytes`` message between ranks 0 and 1 (0 on the others)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4)

    def once() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return _median(once, repeats) / 2


def _all_reduce(nbytes: int, repeats: int) -> float:
    """Return the seconds of an all-reduce of ``nbytes`` over every rank."""
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 4)
    return _median(lambda: dist.all_reduce(buf), repeats)


def _gemm_loop(busy: bool) -> Callable[[], None]:
    """Return a few milliseconds of GEMMs to time (nothing where ``busy`` is false)."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)

    def gemms() -> None:
        for _ in range(4 if busy else 0):
            torch.mm(a, b)

    return gemms


def _sharing(repeats: int) -> float:
    """Return how many ranks' worth of compute every rank at once gets on this machine (``slots``)."""
    import torch.distributed as dist

    gemms = _gemm_loop(True)
    alone = median_seconds(gemms, repeats=repeats) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    times = torch.tensor([median_seconds(gemms, repeats=repeats)], dtype=torch.float64)
    dist.all_reduce(times)  # the ranks' mean
    return dist.get_world_size() * alone / (float(times) / dist.get_world_size())


def _wake(repeats: int, round_trip: float) -> float:
    """Return what a message costs ranks 0 and 1 beyond an idle exchange when both computed up to it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    gemms = _gemm_loop(rank < 2)
    out, into = torch.zeros(SIZES[0] // 4), torch.zeros(SIZES[0] // 4)

    def once() -> None:
        gemms()
        if rank < 2:  # as the runtime does: the receive posted, then the send, then the wait
            work = dist.irecv(into, 1 - rank)
            dist.send(out, 1 - rank)
            assert work is not None  # a member of the default group gets its work
            work.wait()

    compute = _median(gemms, repeats)
    total = _median(once, repeats)
    return max(total - compute - round_trip / 2, 0.0)


def measure_links(model: DeviceModel, repeats: int = 7) -> DeviceModel:
    """Return ``model`` with the default process group's point-to-point and collective links measured.

    Leaves ``model`` as it is in one process, and off a CPU process group (gloo): accelerators'
    links are the device model's.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 \
            or dist.get_backend() != "gloo":
        return model
    g = dist.get_world_size()
    hop = [_ping_pong(n, repeats) for n in SIZES]
    ring = [_all_reduce(n, repeats) for n in SIZES]
    fit = torch.tensor([*hop, *ring, _sharing(repeats), _wake(repeats, 2 * hop[0])], dtype=torch.float64)
    dist.broadcast(fit, 0)  # rank 0's, on every rank: each rank predicts the same step
    hop_latency, hop_bandwidth = _line(float(fit[0]), float(fit[1]))
    ring_latency, ring_bandwidth = _line(float(fit[2]), float(fit[3]))
    steps = 2 * (g - 1)
    measured = model.replace(link_latency=hop_latency, link_bandwidth=hop_bandwidth,
                             inter_latency=hop_latency, inter_bandwidth=hop_bandwidth,
                             tp_latency=ring_latency / steps + float(fit[5]), tp_bandwidth=ring_bandwidth * steps / g,
                             slots=min(float(fit[4]), float(g)) if model.slots > 0 else 0.0,
                             wake_latency=float(fit[5]))
    log.info("links measured over %d ranks: a message %.0f us + %.2f GB/s; a collective step %.0f us, "
             "%.2f GB/s; the ranks compute like %.2f at full speed; a waiting rank resumes in %.0f us", g,
             hop_latency * 1e6, hop_bandwidth / 1e9, measured.tp_latency * 1e6, ring_bandwidth * steps / g / 1e9,
             measured.slots, measured.wake_latency * 1e6)
    return measured
