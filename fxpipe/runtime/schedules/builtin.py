"""The schedules fxpipe ships, as producers of action lists: what each stage does, in order.

An action (:class:`~fxpipe.runtime.schedules.actions.Action`) is a forward (``F``), full backward
(``B``), input-gradient backward (``I``) or weight-gradient backward (``W``) of one
micro-batch on one stage. A schedule gives every stage its list of actions;
:func:`~fxpipe.runtime.schedules.actions.clocks` places each one on a clock with unit-time actions,
which is how the single-process runtime orders them and how the timeline is drawn. A user's
own schedule is the same data (:mod:`fxpipe.runtime.schedules.actions`). GPipe with 3 stages and 4
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

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import ScheduleError
from fxpipe.options import MULTI_STAGE_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES
from fxpipe.runtime.schedules.actions import Action, check, is_token, load_schedule, needs
from fxpipe.runtime.schedules.multistage import interleaved, loop_placement, v_placement, zbv

logger = logging.getLogger(__name__)

__all__ = ["MULTI_PRODUCERS", "PLACEMENTS", "PRODUCERS", "Schedule", "check_name", "gpipe", "one_f_one_b", "resolve",
           "zero_bubble"]


def gpipe(n: int, m: int) -> list[list[Action]]:
    """Return GPipe's actions per stage: every forward, then every backward."""
    return [[Action(j, "F", i) for i in range(m)] + [Action(j, "B", i) for i in range(m)] for j in range(n)]


def one_f_one_b(n: int, m: int) -> list[list[Action]]:
    """Return 1F1B's actions per stage: warm-up forwards, then one forward, one backward."""
    return _warm_then_alternate(n, m, [n - j - 1 for j in range(n)])


def _warm_then_alternate(n: int, m: int, warmups: list[int], backward: str = "B") -> list[list[Action]]:
    """Return per stage ``warmups[j]`` forwards, then forward-backward pairs, then the backwards left."""
    out = []
    for j in range(n):
        warmup = min(warmups[j], m)
        actions = [Action(j, "F", i) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(j, "F", warmup + k), Action(j, backward, k)]
        actions += [Action(j, backward, i) for i in range(m - warmup, m)]
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
    done: dict[tuple[int, str, int], int] = {}  # step -> the time it ends
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
                pending[j].append(Action(j, "W", a.mb))
    for j in range(n):
        actions[j] += pending[j]
    return actions


PRODUCERS: dict[str, Callable[[int, int], list[list[Action]]]] = {  # one stage per rank
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble}


MULTI_PRODUCERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {"interleaved": interleaved, "zbv": zbv}
PLACEMENTS: dict[str, Callable[[int, int], list[int]]] = {"interleaved": loop_placement, "zbv": v_placement}
assert tuple(PRODUCERS) == SINGLE_STAGE_SCHEDULES and tuple(MULTI_PRODUCERS) == MULTI_STAGE_SCHEDULES


@dataclass
class Schedule:
    """A schedule as the runtimes use it: its name, the user's actions if any, each stage's rank."""

    name: str  # one of fxpipe.options.SCHEDULES, or "custom"
    custom: list[list[Action]] | None  # the user's action lists, one per rank
    ranks: list[int]  # the rank (in one process: the lane) each stage runs on

    @property
    def world(self) -> int:
        """Return the number of ranks the stages are placed on."""
        return 1 + max(self.ranks)

    def stages_of(self, rank: int) -> list[int]:
        """Return the stages on ``rank``, in order."""
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def actions(self, m: int) -> list[list[Action]]:
        """Return the action lists, one per rank, for a step of ``m`` micro-batches."""
        n = len(self.ranks)
        if self.custom is not None:
            have = 1 + max(a.mb for row in self.custom for a in row)
            if have != m:
                raise ScheduleError(f"the schedule given has {have} micro-batches but this step has {m} (a "
                                    f"batch smaller than chunks gives fewer); pass a batch of at least {have} rows")
            return self.custom
        if self.name in MULTI_PRODUCERS:
            return MULTI_PRODUCERS[self.name](n, m, self.world)
        return PRODUCERS[self.name](n, m)

    def forward_only(self, m: int) -> list[list[Action]]:
        """Return the forwards alone, per rank, micro-batch by micro-batch (inference)."""
        return [[Action(s, "F", i) for i in range(m) for s in self.stages_of(r)] for r in range(self.world)]

    def deferring(self, m: int) -> set[int]:
        """Return the stages whose actions include weight-gradient steps (``W``)."""
        return {a.stage for row in self.actions(m) for a in row if a.kind == "W"}


def check_name(schedule: Any) -> None:
    """Refuse a ``schedule=`` that is no schedule (a one-word string that is neither a name, an
    action token nor a file; None; a number), listing the names."""
    if isinstance(schedule, str):
        bad = schedule not in SCHEDULES and len(schedule.split()) == 1 and not os.path.exists(schedule) \
            and not is_token(schedule.strip())
    else:
        bad = not isinstance(schedule, (os.PathLike, list, tuple))
    if bad and isinstance(schedule, str) and (os.sep in schedule or schedule.endswith(".txt")):
        raise ScheduleError(f"schedule={schedule!r} looks like the path of a schedule file, and no such file "
                            "exists; check the path (relative paths are read from the working directory "
                            f"{os.getcwd()!r}), or name a schedule: {', '.join(map(repr, SCHEDULES))}")
    if bad:
        names = ", ".join(map(repr, SCHEDULES))
        raise ScheduleError(f"schedule={schedule!r}; use one of {names}, or your own schedule: a list of "
                            "action lists, their text ('0F0 0B0', a line per rank), or the path of a file of it")


def resolve(schedule: Any, n: int, chunks: int, stages_per_rank: int = 1) -> Schedule:
    """Return the :class:`Schedule` a ``schedule=`` argument names, checked for ``n`` stages.

    ``schedule`` is a name (:data:`fxpipe.options.SCHEDULES`), or a user's schedule: text, the path of a file of
    text, or lists of actions (:mod:`fxpipe.runtime.schedules.actions`), one line per rank.
    """
    v = stages_per_rank
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"stages_per_rank={v!r}; use an integer of at least 1")
    if n % v:
        raise ValueError(f"n_stages={n} is not a multiple of stages_per_rank={v}; every rank holds as many "
                         f"stages (n_stages = stages_per_rank x ranks)")
    world = n // v
    if isinstance(schedule, str) and schedule in SCHEDULES:
        if schedule in MULTI_PRODUCERS:
            if schedule == "zbv" and v != 2:
                raise ScheduleError(f"schedule='zbv' places two stages on each rank (rank r: stages r and "
                                    f"2 world - 1 - r); use stages_per_rank=2, not {v}")
            if schedule == "interleaved" and v == 1 and n > 1:
                logger.warning("schedule='interleaved' with stages_per_rank=1 puts one stage on each rank and runs "
                               "as 1F1B: pass stages_per_rank=2 (or more; n_stages = stages_per_rank x ranks) to "
                               "interleave, which shrinks the bubble")
            if chunks < world:
                logger.warning("schedule=%r with chunks=%d on %d ranks (processes, or devices in one process): fewer "
                               "micro-batches than ranks leaves every rank idle most of the step; chunks=%d or more fills the "
                               "pipeline",
                               schedule, chunks, world, world)
            return Schedule(schedule, None, PLACEMENTS[schedule](n, world))
        if v != 1:
            raise ScheduleError(f"schedule={schedule!r} runs one stage per rank; with stages_per_rank={v} use "
                                "'interleaved' or 'zbv' (or your own schedule)")
        return Schedule(schedule, None, list(range(n)))
    check_name(schedule)
    actions = load_schedule(schedule)
    check(actions, n, chunks)
    ranks = [-1] * n
    for r, row in enumerate(actions):
        for a in row:
            if ranks[a.stage] not in (-1, r):
                raise ScheduleError(f"stage {a.stage} has actions on line {ranks[a.stage] + 1} and line {r + 1}; "
                                    "a stage runs on one rank, so keep its actions on one line")
            ranks[a.stage] = r
    if len(actions) != world or any(ranks.count(r) != v for r in range(len(actions))):
        raise ScheduleError(f"with stages_per_rank={v} a schedule for {n} stages has {world} lines, each "
                            f"holding the actions of {v} stage(s); this one has {len(actions)} lines holding "
                            f"{[ranks.count(r) for r in range(len(actions))]} stages"
                            + (f": pass stages_per_rank={n // len(actions)}" if n % len(actions) == 0 and
                               all(ranks.count(r) == n // len(actions) for r in range(len(actions))) else ""))
    return Schedule("custom", actions, ranks)
