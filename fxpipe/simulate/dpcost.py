"""What data parallelism adds to a simulated step: gradient reduction, FSDP2's gathers, sharded state.

As the runtime does it (:mod:`fxpipe.runtime.dataparallel`), per stage and step::

    replicate (DDP)        the stage's last backward all-reduces its gradients in buckets as they
                           are ready, and the backward call returns once every bucket is reduced
                           (DDP waits for them at its end: on CPUs the rank blocks, on GPUs the
                           next kernels wait): the rank is held until
                               end = max(B_end + bucket, B_start + all-reduce(grads))
                           and only then runs on and sends the gradients back. On ranks that
                           share a machine's cores (``slots``: gloo on CPUs) the reduction's
                           copies and sums run on the cores the backward needs, so it follows it:
                               end = B_end + all-reduce(grads)
                           (measured on 4 ranks on 2 cores: DDP's step was the backward's plus
                           the all-reduce's or more; with two stages on a rank, the first
                           stage's last backward waited out the other's reduction)
    replicate, with tp     the rank's gradients all-reduced once all its backwards are done
                               end = last B_end + all-reduce(grads of its stages)
    shard (FSDP2)          all-gather the parameters before the stage's first forward (on that F),
                           held for the step; reduce-scatter after its last backward, on the
                           rank's communication stream (the stages' one after another)
                               end = B_end + reduce-scatter(grads)
                           not held on the rank: holding it predicted 4 gloo ranks' pp2 x dp2
                           step 1.57x too long, where the rank's other work went on beside it
                           memory: the full parameters and gradients plus the 1/dp shards; the
                           optimizer state 1/dp

:func:`reduction_hold` gives the event simulation (:func:`fxpipe.simulate.eventsim.run`) the
seconds each stage's last backward holds its rank under DDP; :func:`reduction_end` the end of
FSDP2's and the tensor-parallel replicas' reductions. Around the step, the runtime's replicas agree
on the batch size (one small all-reduce on the first stage's rank before its first forward) and
average the loss (one on the last stage's rank after its last backward), which
:func:`step_collectives` returns (at the idle link's latency: a rank that only waits for them
has no core to win back, unlike ``wake_latency``). Seconds come from :class:`~fxpipe.simulate.network.Layout`
(the replicas' ring crosses the slowest link between them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fxpipe.runtime.schedules.actions import Action
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.eventsim import Hold, Span
from fxpipe.simulate.memsim import Memory
from fxpipe.simulate.network import DDP_BUCKET, Layout
from fxpipe.simulate.stagecost import StageCost

__all__ = ["gather_seconds", "reduction_end", "reduction_hold", "sharded_memory", "step_collectives"]

SMALL = 16  # bytes of the runtime's per-step collectives: the batch sizes' bounds, the loss


def gather_seconds(costs: Sequence[StageCost], rank_of: Sequence[int], layout: Layout, model: DeviceModel
                   ) -> list[float]:
    """Return each stage's FSDP2 all-gather seconds before its first forward (0 unless sharded)."""
    if not layout.shard or layout.dp == 1:
        return [0.0] * len(costs)
    return [layout.dp_seconds("all_gather", c.params, model, rank_of[j]) for j, c in enumerate(costs)]


def reduction_hold(actions: Sequence[Sequence[Action]], costs: Sequence[StageCost], rank_of: Sequence[int],
                   layout: Layout, model: DeviceModel) -> Hold | None:
    """Return the seconds each stage's last backward holds its rank for DDP's gradient reduction (None
    without replicas, or when they reduce otherwise: :func:`reduction_end`)."""
    if layout.dp == 1 or layout.tp > 1 or layout.shard:
        return None
    last: dict[int, Action] = {}
    for row in actions:
        for a in row:
            if a.is_backward:
                last[a.stage] = a  # a stage's actions are in its rank's order

    ring, tail = {}, {}  # per stage: the whole all-reduce, and its last bucket's
    for j in last:
        nbytes, r = costs[j].grads, rank_of[j]
        ring[j] = layout.dp_seconds("all_reduce", nbytes, model, r)
        tail[j] = layout.dp_seconds("all_reduce", min(nbytes, DDP_BUCKET), model, r)

    def hold(a: Action, seconds: float) -> float:
        """Return the seconds ``a`` (its compute ``seconds`` long) waits for its stage's reduction."""
        if last.get(a.stage) != a:
            return 0.0
        if model.slots > 0:  # ranks sharing a machine's cores: gloo's copies and sums follow the backward
            return ring[a.stage]
        return max(tail[a.stage], ring[a.stage] - seconds)

    return hold


def reduction_end(spans: Sequence[Span], costs: Sequence[StageCost], rank_of: Sequence[int], layout: Layout,
                  model: DeviceModel) -> float:
    """Return when the last rank's gradient reduction of the step ends, where it does not hold the rank
    (FSDP2's reduce-scatters, tensor parallel's all-reduce after the step; 0 otherwise)."""
    if layout.dp == 1 or not (layout.shard or layout.tp > 1):
        return 0.0
    last: dict[int, Span] = {}
    for s in spans:
        if s.action.is_backward:
            last[s.action.stage] = s  # spans come in start order
    ends = []
    for r in sorted(set(rank_of)):
        mine = sorted((j for j in last if rank_of[j] == r), key=lambda j: last[j].end)
        if not mine:
            continue
        if not layout.shard:  # GradSync.reduce: one flat all-reduce after the step's backwards
            nbytes = sum(costs[j].grads for j in mine)
            ends.append(last[mine[-1]].end + layout.dp_seconds("all_reduce", nbytes, model, r))
            continue
        free = 0.0
        for j in mine:  # one after another on the rank's communication stream
            free = max(free, last[j].end) + layout.dp_seconds("reduce_scatter", costs[j].grads, model, r)
        ends.append(free)
    return max(ends, default=0.0)


def step_collectives(layout: Layout, model: DeviceModel, first: int, last: int) -> tuple[float, float]:
    """Return the seconds the replicas' batch-size check delays pipeline rank ``first``'s first forward and
    their loss average takes after rank ``last``'s last backward (0, 0 without replicas)."""
    if layout.dp == 1:
        return 0.0, 0.0
    idle = model.replace(tp_latency=max(model.tp_latency - model.wake_latency, 0.0))  # ranks that only wait
    return layout.dp_seconds("all_reduce", SMALL, idle, first), layout.dp_seconds("all_reduce", SMALL, idle, last)


def sharded_memory(mem: Memory, layout: Layout) -> Memory:
    """Return a stage's (or device's) memory under FSDP2: the shards on top of the gathered state."""
    if not layout.shard or layout.dp == 1:
        return mem
    return dataclasses.replace(mem, params=mem.params * (1 + 1 / layout.dp), optimizer=mem.optimizer / layout.dp,
                               growth=mem.growth + mem.params)  # gathered at the first forward, freed after the step
