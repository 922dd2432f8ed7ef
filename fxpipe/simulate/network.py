"""A two-level network: which link each message and collective of a (dp, pp, tp) layout crosses, and its seconds.

Ranks are numbered as the runtime's mesh lays them out, ``("dp", "pp", "tp")`` with tp
innermost, and fill nodes of ``gpus_per_node`` in order::

    global rank of (replica d, pipeline rank p, tp index k) = (d x pp + p) x tp + k
    node = global rank // gpus_per_node

    inside a node    pipeline hop: link_bandwidth     collectives: tp_bandwidth (NVLink)
    between nodes    inter_bandwidth per device, inter_latency per message (InfiniBand, RoCE)

A collective over ``g`` ranks runs as a ring (what NCCL and gloo do for large messages) on the
slowest link any two neighbours of the group share::

    all-reduce                   2 (g - 1) / g x bytes / bandwidth + 2 (g - 1) x latency
    reduce-scatter, all-gather     (g - 1) / g x bytes / bandwidth +   (g - 1) x latency

``bytes`` is the whole value's (a full gradient; a full parameter for all-gather). A device
model's ``collective_scale`` multiplies a kind whose library runs it otherwise (gloo's
reduce-scatter costs more than an all-reduce, as ``measured=True`` finds on CPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.simulate.devices import DeviceModel

__all__ = ["DDP_BUCKET", "Layout", "ring_seconds"]

DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's default bucket: the last is reduced after backward ends


def ring_seconds(kind: str, nbytes: float, g: int, bandwidth: float, latency: float) -> float:
    """Return the seconds of one ring ``kind`` collective of ``nbytes`` over ``g`` ranks."""
    if g <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (g - 1) if kind == "all_reduce" else g - 1
    return steps / g * nbytes / bandwidth + steps * latency


@dataclass(frozen=True)
class Layout:
    """How a pipe's ranks are laid out: replicas (``dp``, FSDP2 ``shard``), ranks per pipeline, tp per stage."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    shard: bool = False

    @property
    def world(self) -> int:
        """Return the processes of the whole layout."""
        return self.dp * self.pp * self.tp

    def rank(self, d: int, p: int, k: int = 0) -> int:
        """Return the global rank of replica ``d``, pipeline rank ``p``, tp index ``k``."""
        return (d * self.pp + p) * self.tp + k

    def _link(self, ranks: list[int], device: DeviceModel, collective: bool) -> tuple[float, float]:
        """Return ``(bandwidth, latency)`` of the slowest link among ``ranks``."""
        nodes = {r // max(device.gpus_per_node, 1) for r in ranks}
        if len(nodes) > 1:
            return device.inter_bandwidth, device.inter_latency
        if collective:
            return device.tp_bandwidth or device.link_bandwidth, device.tp_latency or device.link_latency
        return device.link_bandwidth, device.link_latency

    def hop_seconds(self, p: int, q: int, nbytes: float, device: DeviceModel) -> float:
        """Return the seconds a message of ``nbytes`` takes from pipeline rank ``p`` to ``q`` (replica 0)."""
        if not nbytes:
            return 0.0
        bandwidth, latency = self._link([self.rank(0, p), self.rank(0, q)], device, False)
        return latency + nbytes / bandwidth

    def dp_seconds(self, kind: str, nbytes: float, device: DeviceModel, p: int = 0) -> float:
        """Return the seconds of a ``kind`` collective of ``nbytes`` over the replicas of pipeline rank ``p``."""
        bandwidth, latency = self._link([self.rank(d, p) for d in range(self.dp)], device, True)
        return ring_seconds(kind, nbytes, self.dp, bandwidth, latency) * device.collective_scale.get(kind, 1.0)

    def tp_link(self, device: DeviceModel) -> DeviceModel:
        """Return ``device`` with its collective link set to what a tp group crosses (inside a node if it fits)."""
        bandwidth, latency = self._link([self.rank(0, 0, k) for k in range(self.tp)], device, True)
        return device.replace(tp_bandwidth=bandwidth, tp_latency=latency)
