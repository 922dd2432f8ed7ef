"""Pipeline schedules as action lists: what each stage does, in order.

An :class:`Action` is a forward (``F``), backward (``B``) or weight-gradient step (``W``) of
one micro-batch on one stage.
A schedule gives every stage its list of actions; :func:`clocks` simulates the list with
unit-time actions to place each one on a clock, which is how the single-process executor
orders them and how the timeline is drawn. GPipe with 3 stages and 4 micro-batches::

    stage 0: F0 F1 F2 F3 .  .  .  .  .  B0 B1 B2 B3       (GPipe: all forwards, then backwards)
    stage 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3
    stage 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-flush) starts backwards as soon as the last stage has a micro-batch, so a
stage holds at most ``n_stages - stage`` micro-batches of activations instead of all ``m``.

Zero bubble (ZB-H1, Qi et al., 2024) splits a backward in two: ``B`` computes the gradients
of the stage's inputs, which the previous stage waits for, and ``W`` the gradients of its
weights, which nobody waits for. Keeping 1F1B's order of ``F`` and ``B``, a stage runs a
deferred ``W`` whenever its next ``F`` or ``B`` would wait, which fills the warm-down
bubble. 2 stages, 4 micro-batches, every action one unit::

    1F1B:  stage 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3     (B0 B0: a whole backward)
           stage 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3
    ZB-H1: stage 0: F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
           stage 1: .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Action", "gpipe", "one_f_one_b", "zero_bubble", "forward_only", "SCHEDULES", "clocks", "in_flight"]


@dataclass(frozen=True)
class Action:
    """A forward, backward or weight-gradient step of micro-batch ``mb`` on stage ``stage``."""

    kind: str  # "F", "B" (all of backward, or only input gradients with "W"), or "W"
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


def gpipe(n: int, m: int) -> list[list[Action]]:
    """Return GPipe's actions per stage: every forward, then every backward."""
    return [[Action("F", i, j) for i in range(m)] + [Action("B", i, j) for i in range(m)] for j in range(n)]


def one_f_one_b(n: int, m: int) -> list[list[Action]]:
    """Return 1F1B's actions per stage: warm-up forwards, then one forward, one backward."""
    return _warm_then_alternate(n, m, [n - j - 1 for j in range(n)])


def _warm_then_alternate(n: int, m: int, warmups: list[int]) -> list[list[Action]]:
    """Return per stage ``warmups[j]`` forwards, then forward-backward pairs, then the backwards left."""
    out = []
    for j in range(n):
        warmup = min(warmups[j], m)
        actions = [Action("F", i, j) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action("F", warmup + k, j), Action("B", k, j)]
        actions += [Action("B", i, j) for i in range(m - warmup, m)]
        out.append(actions)
    return out


def zero_bubble(n: int, m: int, extra_warmup: int = 0) -> list[list[Action]]:
    """Return ZB-H1's actions per stage: 1F1B's forwards and backwards, weight steps in the gaps.

    The forwards and backwards keep 1F1B's order, with ``extra_warmup`` more warm-up
    forwards on every stage but the last. The default, none, is the paper's ZB-H1; one more
    has the next stage's input ready before it asks, but holds one more micro-batch and
    measured no faster on 2 CPU ranks (``benchmarks/zb_warmup.py``).

    Simulating every action as one unit of time, a stage whose next ``F`` or ``B`` waits on
    another stage runs a deferred ``W`` instead; before an ``F`` that would make it hold more
    than ``n`` micro-batches whose ``W`` has not run, it runs a ``W`` first (warm-up aside: a
    stage holds at most ``n + extra_warmup``). With unit actions the step takes
    ``3m + n - 1`` units against 1F1B's ``3(m + n - 1)`` (for ``m >= n``).
    """
    order = _warm_then_alternate(n, m, [n - j - 1 + extra_warmup if j < n - 1 else 0 for j in range(n)])
    actions: list[list[Action]] = [[] for _ in range(n)]
    done: dict[Action, int] = {}  # action -> the time it ends
    pending: list[list[Action]] = [[] for _ in range(n)]
    pos, free = [0] * n, [0] * n
    held = [0] * n  # micro-batches whose W has not run
    while any(pos[j] < len(order[j]) for j in range(n)):
        j = min((j for j in range(n) if pos[j] < len(order[j])), key=lambda j: (free[j], j))
        a = order[j][pos[j]]
        dep = _dependency(a, n)
        ready = 0 if dep is None else done.get(dep)  # None: not placed yet
        if pending[j] and (a.kind == "F" and held[j] >= n or ready is None or ready > free[j]):
            w = pending[j].pop(0)
        elif ready is not None:
            w = None
            free[j] = max(free[j], ready)
        else:  # wait for whichever stage acts next
            free[j] = min((free[k] for k in range(n) if k != j and pos[k] < len(order[k])
                           and free[k] > free[j]), default=free[j] + 1)
            continue
        step = w or a
        held[j] += {"F": 1, "W": -1}.get(step.kind, 0)
        actions[j].append(step)
        free[j] += 1
        done[step] = free[j]
        if w is None:
            pos[j] += 1
            if a.kind == "B":
                pending[j].append(Action("W", a.mb, j))
    for j in range(n):
        actions[j] += pending[j]
    return actions


def forward_only(n: int, m: int) -> list[list[Action]]:
    """Return the forwards alone, for inference."""
    return [[Action("F", i, j) for i in range(m)] for j in range(n)]


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble, "forward": forward_only}


def _dependency(a: Action, n: int) -> Action | None:
    """Return the action of another stage that ``a`` waits for (None: only its own stage's order).

    F(i, j) needs F(i, j-1); B(i, j) needs B(i, j+1), or F(i, j) on the last stage; a W
    follows its own stage's B.
    """
    if a.kind == "F":
        return Action("F", a.mb, a.stage - 1) if a.stage > 0 else None
    if a.kind == "B":
        return Action("B", a.mb, a.stage + 1) if a.stage < n - 1 else Action("F", a.mb, a.stage)
    return None


def clocks(actions: list[list[Action]]) -> dict[Action, int]:
    """Place each action on the earliest clock its stage and its data allow (unit-time actions).

    A stage runs one action per clock, in its list's order, once what it waits for (see
    :func:`_dependency`) is done.
    """
    n = len(actions)
    done: dict[Action, int] = {}
    pos = [0] * n
    free = [0] * n
    while any(pos[j] < len(actions[j]) for j in range(n)):
        progressed = False
        for j in range(n):
            if pos[j] >= len(actions[j]):
                continue
            a = actions[j][pos[j]]
            dep = _dependency(a, n)
            if dep is not None and dep not in done:
                continue
            start = max(free[j], done[dep] + 1 if dep is not None else 0)
            done[a] = start
            free[j] = start + 1
            pos[j] += 1
            progressed = True
        if not progressed:
            stuck = [str(actions[j][pos[j]]) for j in range(n) if pos[j] < len(actions[j])]
            raise ValueError(f"schedule deadlocks: stages wait on {stuck}")
    return done


def in_flight(stage_actions: list[Action]) -> int:
    """Return the most micro-batches a stage holds activations for at once."""
    live = peak = 0
    for a in stage_actions:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak
