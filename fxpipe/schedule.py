"""Pipeline schedules as action lists: what each stage does, in order.

An :class:`Action` is a forward (``F``) or backward (``B``) of one micro-batch on one stage.
A schedule gives every stage its list of actions; :func:`clocks` simulates the list with
unit-time actions to place each one on a clock, which is how the single-process executor
orders them and how the timeline is drawn. GPipe with 3 stages and 4 micro-batches::

    stage 0: F0 F1 F2 F3 .  .  .  .  .  B0 B1 B2 B3       (GPipe: all forwards, then backwards)
    stage 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3
    stage 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-flush) starts backwards as soon as the last stage has a micro-batch, so a
stage holds at most ``n_stages - stage`` micro-batches of activations instead of all ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Action", "gpipe", "one_f_one_b", "forward_only", "SCHEDULES", "clocks", "in_flight"]


@dataclass(frozen=True)
class Action:
    """A forward or backward of micro-batch ``mb`` on stage ``stage``."""

    kind: str  # "F" or "B"
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


def gpipe(n: int, m: int) -> list[list[Action]]:
    """Return GPipe's actions per stage: every forward, then every backward."""
    return [[Action("F", i, j) for i in range(m)] + [Action("B", i, j) for i in range(m)] for j in range(n)]


def one_f_one_b(n: int, m: int) -> list[list[Action]]:
    """Return 1F1B's actions per stage: warm-up forwards, then one forward, one backward."""
    out = []
    for j in range(n):
        warmup = min(n - j - 1, m)
        actions = [Action("F", i, j) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action("F", warmup + k, j), Action("B", k, j)]
        actions += [Action("B", i, j) for i in range(m - warmup, m)]
        out.append(actions)
    return out


def forward_only(n: int, m: int) -> list[list[Action]]:
    """Return the forwards alone, for inference."""
    return [[Action("F", i, j) for i in range(m)] for j in range(n)]


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "forward": forward_only}


def clocks(actions: list[list[Action]]) -> dict[Action, int]:
    """Place each action on the earliest clock its stage and its data allow (unit-time actions).

    F(i, j) needs F(i, j-1); B(i, j) needs B(i, j+1) (or F(i, j) on the last stage). A stage
    runs one action per clock, in its list's order.
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
            if a.kind == "F":
                dep = Action("F", a.mb, j - 1) if j > 0 else None
            else:
                dep = Action("B", a.mb, j + 1) if j < n - 1 else Action("F", a.mb, j)
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
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
