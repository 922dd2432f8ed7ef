"""The schedules fxpipe ships, as producers of action lists: what each stage does, in order.

An action (:class:`~fxpipe.runtime.actionlist.Action`) is a forward (``F``), full backward
(``B``), input-gradient backward (``I``) or weight-gradient backward (``W``) of one
micro-batch on one stage. A schedule gives every stage its list of actions;
:func:`~fxpipe.runtime.actionlist.clocks` places each one on a clock with unit-time actions,
which is how the single-process runtime orders them and how the timeline is drawn. A user's
own schedule is the same data (:mod:`fxpipe.runtime.actionlist`). GPipe with 3 stages and 4
micro-batches::

    stage 0: F0 F1 F2 F3 .  .  .  .  .  B0 B1 B2 B3       (GPipe: all forwards, then backwards)
    stage 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3
    stage 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-flush) starts backwards as soon as the last stage has a micro-batch, so a
stage holds at most ``n_stages - stage`` micro-batches of activations instead of all ``m``.

Zero bubble (ZB-H1, Qi et al., 2024) splits a backward in two: ``I`` computes the gradients
of the stage's inputs, which the previous stage waits for, and ``W`` the gradients of its
weights, which nobody waits for. Keeping 1F1B's order of ``F`` and ``I``, a stage runs a
deferred ``W`` whenever its next ``F`` or ``I`` would wait, which fills the warm-down
bubble. 2 stages, 4 micro-batches, every action one unit::

    1F1B:  stage 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3     (B0 B0: a whole backward)
           stage 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3
    ZB-H1: stage 0: F0 F1 .  I0 W0 F2 I1 W1 F3 I2 W2 I3 W3
           stage 1: .  F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3
"""

from __future__ import annotations

import os
from typing import Any, Callable

from fxpipe.errors import ScheduleError
from fxpipe.runtime import actionlist
from fxpipe.runtime.actionlist import Action, needs

__all__ = ["gpipe", "one_f_one_b", "zero_bubble", "forward_only", "SCHEDULES", "resolve", "actions_for",
           "deferring"]


def gpipe(n: int, m: int) -> list[list[Action]]:
    """Return GPipe's actions per stage: every forward, then every backward."""
    return [[Action("F", i, j) for i in range(m)] + [Action("B", i, j) for i in range(m)] for j in range(n)]


def one_f_one_b(n: int, m: int) -> list[list[Action]]:
    """Return 1F1B's actions per stage: warm-up forwards, then one forward, one backward."""
    return _warm_then_alternate(n, m, [n - j - 1 for j in range(n)])


def _warm_then_alternate(n: int, m: int, warmups: list[int], backward: str = "B") -> list[list[Action]]:
    """Return per stage ``warmups[j]`` forwards, then forward-backward pairs, then the backwards left."""
    out = []
    for j in range(n):
        warmup = min(warmups[j], m)
        actions = [Action("F", i, j) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action("F", warmup + k, j), Action(backward, k, j)]
        actions += [Action(backward, i, j) for i in range(m - warmup, m)]
        out.append(actions)
    return out


def zero_bubble(n: int, m: int, extra_warmup: int = 0) -> list[list[Action]]:
    """Return ZB-H1's actions per stage: 1F1B's forwards and input-gradient steps, weight steps in the gaps.

    The forwards and input-gradient steps (``I``) keep 1F1B's order, with ``extra_warmup`` more warm-up
    forwards on every stage but the last. The default, none, is the paper's ZB-H1; one more
    has the next stage's input ready before it asks, but holds one more micro-batch and
    measured no faster on 2 CPU ranks (``benchmarks/zb_warmup.py``).

    Simulating every action as one unit of time, a stage whose next ``F`` or ``I`` waits on
    another stage runs a deferred ``W`` instead; before an ``F`` that would make it hold more
    than ``n`` micro-batches whose ``W`` has not run, it runs a ``W`` first (warm-up aside: a
    stage holds at most ``n + extra_warmup``). With unit actions the step takes
    ``3m + n - 1`` units against 1F1B's ``3(m + n - 1)`` (for ``m >= n``).
    """
    order = _warm_then_alternate(n, m, [n - j - 1 + extra_warmup if j < n - 1 else 0 for j in range(n)], "I")
    actions: list[list[Action]] = [[] for _ in range(n)]
    done: dict[tuple[str, int, int], int] = {}  # step -> the time it ends
    pending: list[list[Action]] = [[] for _ in range(n)]
    pos, free = [0] * n, [0] * n
    held = [0] * n  # micro-batches whose W has not run
    while any(pos[j] < len(order[j]) for j in range(n)):
        j = min((j for j in range(n) if pos[j] < len(order[j])), key=lambda j: (free[j], j))
        a = order[j][pos[j]]
        dep = needs(a, n)
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
        done[step.key] = free[j]
        if w is None:
            pos[j] += 1
            if a.kind == "I":
                pending[j].append(Action("W", a.mb, j))
    for j in range(n):
        actions[j] += pending[j]
    return actions


def forward_only(n: int, m: int) -> list[list[Action]]:
    """Return the forwards alone, for inference."""
    return [[Action("F", i, j) for i in range(m)] for j in range(n)]


SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble, "forward": forward_only}


def resolve(schedule: Any, n: int, chunks: int) -> tuple[str, list[list[Action]] | None]:
    """Return a schedule argument's name and, for a user's own schedule, its checked actions.

    ``schedule`` is a name (``"gpipe"``, ``"1f1b"``, ``"zb"``), or a user's schedule: text,
    the path of a file of text, or lists of actions (:mod:`fxpipe.runtime.actionlist`).
    """
    if isinstance(schedule, str) and schedule in SCHEDULES and schedule != "forward":
        return schedule, None
    if isinstance(schedule, str) and "\n" not in schedule and " " not in schedule.strip() \
            and not os.path.exists(schedule) and not actionlist.is_token(schedule.strip()):
        names = ", ".join(repr(s) for s in SCHEDULES if s != "forward")
        raise ScheduleError(f"schedule={schedule!r}; use one of {names}, or your own schedule: a list of "
                            "action lists, their text ('0F0 0B0' per rank), or the path of a file of it")
    actions = actionlist.load_schedule(schedule)
    actionlist.check(actions, n, chunks)
    if len(actions) != n or any(a.stage != r for r, row in enumerate(actions) for a in row):
        raise ScheduleError(f"a schedule for {n} stages, one per rank, has {n} lines, line j holding "
                            f"stage j's actions; this one has {len(actions)} lines" + (
                                "" if len(actions) != n else " and mixes stages within a line"))
    return "custom", actions


def actions_for(name: str, custom: list[list[Action]] | None, n: int, m: int) -> list[list[Action]]:
    """Return the action lists of schedule ``name`` (or the user's ``custom`` one) for ``m`` micro-batches."""
    if custom is None:
        return SCHEDULES[name](n, m)
    have = 1 + max(a.mb for row in custom for a in row)
    if have != m:
        raise ScheduleError(f"the schedule given has {have} micro-batches but this step has {m} (a batch "
                            f"smaller than chunks gives fewer); pass a batch of at least {have} rows")
    return custom


def deferring(actions: list[list[Action]]) -> set[int]:
    """Return the stages whose actions include weight-gradient steps (``W``)."""
    return {a.stage for row in actions for a in row if a.kind == "W"}
