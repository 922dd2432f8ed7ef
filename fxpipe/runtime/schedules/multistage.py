"""Schedules with several stages per rank: interleaved 1F1B and V-shaped zero bubble.

Smaller stages shorten the pipeline's fill and drain: the last rank waits only for the
first, smaller stage instead of a whole rank's share. Where the stages go:

    loop (interleaved), 2 ranks, 4 stages:      V (zbv), 2 ranks, 4 stages:
      rank 0: stages 0, 2                          rank 0: stages 0, 3
      rank 1: stages 1, 3                          rank 1: stages 1, 2
      0 ─▶ 1 ─▶ 2 ─▶ 3  (ranks 0 1 0 1)           0 ─▶ 1 ─▶ 2 ─▶ 3  (ranks 0 1 1 0)

Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM) runs forwards in groups of ``world``
micro-batches through each of a rank's stages in turn, then 1F1B; its bubble is
``(p - 1) / (v m)`` of the step instead of ``(p - 1) / m``. ZB-V (Qi et al., 2024) puts the
first and last stage on rank 0, splits backward into ``I`` and ``W``, and fills the rest of
the bubble with ``W``; built here by list scheduling with unit-time actions under 1F1B's
activation memory. Both run any number of micro-batches; with fewer than ``world`` (a last
batch of few rows) the ranks idle more.
"""

from __future__ import annotations

from fxpipe.errors import ScheduleError
from fxpipe.runtime.schedules.actions import Action, needs

__all__ = ["interleaved", "loop_placement", "v_placement", "zbv"]


def loop_placement(n: int, world: int) -> list[int]:
    """Return each stage's rank when stage ``s`` runs on rank ``s mod world``."""
    return [s % world for s in range(n)]


def v_placement(n: int, world: int) -> list[int]:
    """Return each stage's rank when rank ``r`` holds stages ``r`` and ``2 world - 1 - r``."""
    if n != 2 * world:
        raise ScheduleError(f"the V placement puts two stages on each rank: n_stages={n} needs "
                            f"{n // 2 if n % 2 == 0 else 'n_stages / 2'} ranks, got {world}; use stages_per_rank=2")
    return [s if s < world else 2 * world - 1 - s for s in range(n)]


def _groups(m: int, world: int) -> list[list[int]]:
    """Split micro-batches into groups of ``world``, the first one taking the remainder (all of them when fewer)."""
    if m < world:  # a last batch of fewer rows than ranks: one group, the ranks idle more of the step
        return [list(range(m))]
    first = world + m % world
    return [list(range(first))] + [list(range(g, g + world)) for g in range(first, m, world)]


def interleaved(n: int, m: int, world: int) -> list[list[Action]]:
    """Return interleaved 1F1B's actions per rank, stages placed in a loop (stage s on rank s mod world).

    Each rank runs forwards group by group (``world`` micro-batches; the first group also
    takes the ``m mod world`` left over), each group through its stages in order; backwards
    the same with the stages in reverse. It warms up with ``2 (world - r - 1) + (v - 1) g``
    forwards (``g``: the first group's size), then alternates one forward, one backward.
    """
    if n % world:
        raise ScheduleError(f"n_stages={n} is not a multiple of the {world} ranks; give each rank as many stages")
    v = n // world
    out = []
    for r in range(world):
        fwd = [Action(c * world + r, "F", i) for g in _groups(m, world) for c in range(v) for i in g]
        bwd = [Action(c * world + r, "B", i) for g in _groups(m, world) for c in reversed(range(v)) for i in g]
        warmup = min(2 * (world - r - 1) + (v - 1) * len(_groups(m, world)[0]), len(fwd))
        row = fwd[:warmup]
        for k in range(len(fwd) - warmup):
            row += [fwd[warmup + k], bwd[k]]
        row += bwd[len(fwd) - warmup:]
        out.append(row)
    return out


def zbv(n: int, m: int, world: int) -> list[list[Action]]:
    """Return ZB-V's actions per rank: V placement, ``I`` and ``W`` split, ``W`` filling the gaps.

    Every action takes one unit. Whenever a rank is free it runs, in this order of
    preference: the input-gradient step (``I``) of the oldest micro-batch that is ready (the
    later stage first); the ready forward of the oldest micro-batch (the later stage first),
    unless the rank already holds ``2 world`` stage-activations, 1F1B's peak on its first
    rank in units of half a stage; else a pending weight step (``W``); else it waits.
    """
    rank = v_placement(n, world)
    mine = [[s for s in range(n) if rank[s] == r] for r in range(world)]
    limit = 2 * world
    todo = {r: {Action(s, k, i) for s in mine[r] for i in range(m) for k in ("F", "I")} for r in range(world)}
    done: dict[tuple[int, str, int], int] = {}  # step -> the time it ends
    pending: list[list[Action]] = [[] for _ in range(world)]  # W whose I has run
    held = [0] * world
    free = [0] * world
    out: list[list[Action]] = [[] for _ in range(world)]

    def ready(a: Action, t: int) -> bool:
        need = needs(a, n)
        return need is None or done.get(need, t + 1) <= t

    while any(todo[r] or pending[r] for r in range(world)):
        r = min((r for r in range(world) if todo[r] or pending[r]), key=lambda r: (free[r], r))
        t = free[r]
        key = lambda a: (a.mb, -a.stage)
        backs = sorted((a for a in todo[r] if a.kind == "I" and ready(a, t)), key=key)
        fwds = sorted((a for a in todo[r] if a.kind == "F" and ready(a, t)), key=key)
        deeper = [a for a in fwds if a.stage != mine[r][0]]  # micro-batches already inside the rank
        if backs:
            step = backs[0]
        elif fwds and held[r] < limit:
            step = fwds[0]
        elif pending[r]:
            step = pending[r].pop(0)  # at the limit: a weight step frees what it holds
        elif deeper:
            step = deeper[0]  # nothing to free: let a micro-batch already inside go on
        else:  # wait for the next step another rank finishes
            later = [e for e in done.values() if e > t]
            free[r] = min(later) if later else t + 1
            continue
        if step.kind != "W":
            todo[r].discard(step)
        if step.kind == "I":
            pending[r].append(Action(step.stage, "W", step.mb))
        held[r] += {"F": 1, "W": -1}.get(step.kind, 0)
        out[r].append(step)
        free[r] = t + 1
        done[step.key] = t + 1
    return out
