"""What data parallelism adds to a simulated step: gradient reduction, FSDP2's gathers, sharded state.

As the runtime does it (:mod:`fxpipe.runtime.dataparallel`), per stage and step::

    replicate (DDP)        the stage's last backward all-reduces its gradients in buckets as they
                           are ready: the reduction runs beside that backward and ends at most one
                           bucket (25 MiB) after it, or when the ring is done if that is later
                               end = max(B_end + bucket, B_start + all-reduce(grads))
                           on ranks that share a machine's cores (``slots``: gloo on CPUs) the
                           reduction's copies and sums run on the cores the backward needs, so
                           they follow it: end = B_end + all-reduce(grads) (measured on 4 ranks
                           on 2 cores, DDP's step was the backward's plus the all-reduce's or more)
    replicate, with tp     the rank's gradients all-reduced once all its backwards are done
                               end = last B_end + all-reduce(grads of its stages)
    shard (FSDP2)          all-gather the parameters before the stage's first forward (on that F),
                           held for the step; reduce-scatter after its last backward
                               end = B_end + reduce-scatter(grads)
                           memory: the full parameters and gradients plus the 1/dp shards; the
                           optimizer state 1/dp

A rank's collectives run one after another on its communication stream; the step ends when the
last rank's last reduction does. Seconds come from :class:`~fxpipe.simulate.network.Layout`
(the replicas' ring crosses the slowest link between them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.eventsim import Span
from fxpipe.simulate.memsim import Memory
from fxpipe.simulate.network import DDP_BUCKET, Layout
from fxpipe.simulate.stagecost import StageCost

__all__ = ["gather_seconds", "reduction_end", "sharded_memory"]


def gather_seconds(costs: Sequence[StageCost], rank_of: Sequence[int], layout: Layout, model: DeviceModel
                   ) -> list[float]:
    """Return each stage's FSDP2 all-gather seconds before its first forward (0 unless sharded)."""
    if not layout.shard or layout.dp == 1:
        return [0.0] * len(costs)
    return [layout.dp_seconds("all_gather", c.params, model, rank_of[j]) for j, c in enumerate(costs)]


def reduction_end(spans: Sequence[Span], costs: Sequence[StageCost], rank_of: Sequence[int], layout: Layout,
                  model: DeviceModel) -> float:
    """Return when the last rank's gradient reduction of the step ends (0 without replicas)."""
    if layout.dp == 1:
        return 0.0
    last: dict[int, Span] = {}
    for s in spans:
        if s.action.is_backward:
            last[s.action.stage] = s  # spans come in start order
    ends = []
    for r in sorted(set(rank_of)):
        mine = sorted((j for j in last if rank_of[j] == r), key=lambda j: last[j].end)
        if layout.tp > 1 and not layout.shard:  # GradSync.reduce: one flat all-reduce after the step's backwards
            nbytes = sum(costs[j].grads for j in mine)
            ends.append(max(last[j].end for j in mine) + layout.dp_seconds("all_reduce", nbytes, model, r))
            continue
        free = 0.0
        for j in mine:
            span, nbytes = last[j], costs[j].grads
            if layout.shard:
                free = max(free, span.end) + layout.dp_seconds("reduce_scatter", nbytes, model, r)
            elif model.slots > 0:  # ranks sharing a machine's cores: gloo's copies and sums take them from compute
                free = max(free, span.end) + layout.dp_seconds("all_reduce", nbytes, model, r)
            else:
                ring = layout.dp_seconds("all_reduce", nbytes, model, r)
                tail = layout.dp_seconds("all_reduce", min(nbytes, DDP_BUCKET), model, r)
                free = max(span.end + tail, max(free, span.start) + ring)
        ends.append(free)
    return max(ends, default=0.0)


def sharded_memory(mem: Memory, layout: Layout) -> Memory:
    """Return a stage's (or device's) memory under FSDP2: the shards on top of the gathered state."""
    if not layout.shard or layout.dp == 1:
        return mem
    return dataclasses.replace(mem, params=mem.params * (1 + 1 / layout.dp), optimizer=mem.optimizer / layout.dp,
                               growth=mem.growth + mem.params)  # gathered at the first forward, freed after the step
