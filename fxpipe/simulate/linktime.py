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

How the ranks share the machine's cores (``slots``) is measured beside it, by
:mod:`fxpipe.simulate.sharing`.

It measures what a message costs a rank that computed up to it (``wake_latency``): ranks 0 and
1 both run a GEMM loop, then exchange a small message as the runtime does (receive posted, send,
wait); the time beyond the compute and an idle one-way message is the waiting rank's
resumption. On this machine's virtual cores it came to 0.3-4.7 ms, where the same exchange between
ranks doing nothing else takes 0.1 ms (gloo's receiving thread and the woken rank wait for a
core). The simulator charges it to every action that waits for a message and to every ring step
of a collective (``tp_latency``, which replicas' and tensor-parallel groups' collectives cross:
each step waits for a peer).

Last, the other collectives FSDP2 runs, reduce-scatter and all-gather, at the large size: their
seconds over what the ring formula gives from the all-reduce's fit are the device model's
``collective_scale`` (gloo has no ring reduce-scatter of its own: it measured 1.9-5.3x here).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from fxpipe.passes.timing import seconds
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.network import ring_seconds

__all__ = ["gemm_loop", "measure_links"]

log = logging.getLogger(__name__)

SIZES = (16 * 2**10, 8 * 2**20)  # bytes: a small message and one large enough that bandwidth stands above the noise
KINDS = ("reduce_scatter", "all_gather")  # timed at the large size against the all-reduce's ring


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


def _collective(kind: str, nbytes: int, repeats: int) -> float:
    """Return the seconds of a ``kind`` collective (``reduce_scatter``, ``all_gather``) of ``nbytes`` over every rank."""
    import torch.distributed as dist

    g = dist.get_world_size()
    full, shard = torch.zeros(nbytes // 4 // g * g), torch.zeros(nbytes // 4 // g)
    if kind == "reduce_scatter":  # the *_single names from torch 2.13 (the older ones warn there)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return _median(lambda: scatter(shard, full), repeats)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _median(lambda: gather(full, shard), repeats)


def gemm_loop(busy: bool, calls: int = 1) -> Callable[[], None]:
    """Return ``calls`` times a few milliseconds of GEMMs to time (nothing where ``busy`` is false)."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)

    def gemms() -> None:
        for _ in range(4 * calls if busy else 0):
            torch.mm(a, b)

    return gemms


def _wake(trials: int, round_trip: float, calls: int = 8) -> float:
    """Return what a message costs ranks 0 and 1 beyond an idle exchange when both computed up to it.

    Each trial times ``calls`` rounds of (a GEMM burst, then a small exchange) and ``calls``
    GEMM bursts alone, both as whole loops; the median over trials of the difference per
    round, less the idle exchange, is returned.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    gemms = gemm_loop(rank < 2)
    out, into = torch.zeros(SIZES[0] // 4), torch.zeros(SIZES[0] // 4)

    def rounds(talk: bool) -> None:
        for _ in range(calls):
            gemms()
            if talk and rank < 2:  # as the runtime does: the receive posted, then the send, then the wait
                work = dist.irecv(into, 1 - rank)
                dist.send(out, 1 - rank)
                assert work is not None  # a member of the default group gets its work
                work.wait()

    rounds(True)
    extra = []
    for _ in range(trials):
        dist.barrier()
        compute = seconds(lambda: rounds(False))
        dist.barrier()
        total = seconds(lambda: rounds(True))
        extra.append((total - compute) / calls - round_trip / 2)
    return max(statistics.median(extra), 0.0)


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
    kinds = [_collective(k, SIZES[1], repeats) for k in KINDS]
    fit = torch.tensor([*hop, *ring, _wake(5, 2 * hop[0]), *kinds], dtype=torch.float64)
    dist.broadcast(fit, 0)  # rank 0's, on every rank: each rank predicts the same step
    hop_latency, hop_bandwidth = _line(float(fit[0]), float(fit[1]))
    ring_latency, ring_bandwidth = _line(float(fit[2]), float(fit[3]))
    steps = 2 * (g - 1)
    scale = {k: float(t) / ring_seconds(k, SIZES[1], g, ring_bandwidth * steps / g, ring_latency / steps)
             for k, t in zip(KINDS, fit[5:])}
    measured = model.replace(link_latency=hop_latency, link_bandwidth=hop_bandwidth,
                             inter_latency=hop_latency, inter_bandwidth=hop_bandwidth,
                             tp_latency=ring_latency / steps + float(fit[4]), tp_bandwidth=ring_bandwidth * steps / g,
                             wake_latency=float(fit[4]), collective_scale=scale)
    log.info("links measured over %d ranks: a message %.0f us + %.2f GB/s; a collective step %.0f us, "
             "%.2f GB/s; a waiting rank resumes in %.0f us; "
             "reduce-scatter and all-gather %.2fx and %.2fx the ring's", g,
             hop_latency * 1e6, hop_bandwidth / 1e9, measured.tp_latency * 1e6, ring_bandwidth * steps / g / 1e9,
             measured.wake_latency * 1e6, scale["reduce_scatter"], scale["all_gather"])
    return measured
