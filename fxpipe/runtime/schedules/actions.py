"""Schedules as data: typed actions, their text form, and the checks a schedule must pass.

An :class:`Action` is one step of one micro-batch on one stage, named as the field names
them (and as ``torch.distributed.pipelining`` writes them)::

    0F3        stage 0, forward of micro-batch 3
    2B1        stage 2, full backward of micro-batch 1
    2I1  2W1   stage 2, its input-gradient backward (what stage 1 waits for), then its
               weight-gradient backward (what nobody waits for)
    1RECV_F3   stage 1 receives micro-batch 3's inputs      (added by :func:`lower`)
    0SEND_F3   stage 0 sends micro-batch 3's outputs        (added by :func:`lower`)
    1SEND_B3   stage 1 sends its input gradients back       (added by :func:`lower`)
    0RECV_B3   stage 0 receives its outputs' gradients      (added by :func:`lower`)

A schedule is a list of action lists, one per rank, each run in its order; with one stage
per rank, line ``j`` holds stage ``j``'s actions. As text, one line per rank, one action
per token, ``#`` starting a comment::

    0F0 0F1 0B0 0B1
    1F0 1B0 1F1 1B1

:func:`check` refuses a schedule that misses or repeats a step, or that can never finish,
naming the first action that can never run. :func:`clocks` places every action on the
earliest clock its rank and its data allow, taking each action as one unit of time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxpipe.errors import ScheduleError

__all__ = [
    "COMM",
    "COMPUTE",
    "Action",
    "check",
    "clocks",
    "format_schedule",
    "in_flight",
    "is_token",
    "load_schedule",
    "lower",
    "needs",
    "parse",
]

COMPUTE = ("F", "B", "I", "W")
COMM = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
_TOKEN = re.compile(r"^(\d+)(" + "|".join(COMM + COMPUTE) + r")(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step (``kind``) of micro-batch ``mb`` on stage ``stage``, in torch.distributed.pipelining's order."""

    stage: int
    kind: str  # "F", "B", "I", "W", or a message: "RECV_F", "SEND_F", "RECV_B", "SEND_B"
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def is_backward(self) -> bool:
        """Tell whether this action computes input gradients (``B`` or ``I``)."""
        return self.kind in ("B", "I")

    @property
    def key(self) -> tuple[int, str, int]:
        """Return the step this action completes: a forward, input gradients (``B`` or ``I``), weights."""
        return (self.stage, "G" if self.is_backward else self.kind, self.mb)


ActionLists = list[list[Action]]  # one list of actions per rank: a schedule as data


def parse(text: str) -> ActionLists:
    """Read a schedule from text: a line per rank, an action per token, ``#`` comments."""
    out: ActionLists = []
    for lineno, line in enumerate(text.splitlines(), 1):
        tokens = line.split("#", 1)[0].split()
        if not tokens:
            continue
        row = []
        for token in tokens:
            match = _TOKEN.match(token)
            if match is None:
                raise ScheduleError(f"line {lineno}: {token!r} is not an action; write "
                                    f"<stage><kind><micro-batch> with kind one of "
                                    f"{', '.join(COMPUTE)}, e.g. '0F3' (the runtime adds the sends and receives)")
            stage, kind, mb = match.groups()
            row.append(Action(int(stage), kind, int(mb)))
        out.append(row)
    if not out:
        raise ScheduleError("the schedule is empty; give one line of actions per rank, e.g. '0F0 0B0'")
    return out


def format_schedule(actions: Sequence[Sequence[Action]]) -> str:
    """Write a schedule as text, one line per rank (the inverse of :func:`parse`)."""
    return "".join(" ".join(map(str, row)) + "\n" for row in actions)


def is_token(text: str) -> bool:
    """Tell whether ``text`` is one action token such as ``0F3``."""
    return _TOKEN.match(text) is not None


def load_schedule(value: str | os.PathLike | Sequence) -> ActionLists:
    """Return a user's schedule from text, a file path (a string or a path object), or lists of actions or tokens."""
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        if not os.path.isfile(path):
            raise ScheduleError(f"schedule={path!r} is not a readable file of actions")
        with open(path) as f:
            return parse(f.read())
    if isinstance(value, str):
        if not value.strip():
            return parse(value)  # refused as empty, naming what a schedule holds
        if "\n" in value or len(value.split()) > 1 and not os.path.isfile(value) \
                or is_token(value.split()[0] if value.split() else ""):
            return parse(value)  # text: a bad token is named by the parser
        try:
            with open(value) as f:
                return parse(f.read())
        except OSError as exc:
            raise ScheduleError(f"schedule={value!r} is neither a known schedule nor a readable "
                                f"file of actions ({exc.strerror})") from None
    rows = []
    for row in value:
        if isinstance(row, str):
            rows += parse(row)
            continue
        items = []
        for a in row:
            if isinstance(a, Action):
                items.append(a)
            elif isinstance(a, str):
                items += parse(a)[0]
            else:
                raise ScheduleError(f"schedule rows hold Actions or tokens like '0F3', got {a!r}")
        rows.append(items)
    return rows


def needs(a: Action, n: int) -> tuple[int, str, int] | None:
    """Return what ``a`` waits for from another step (None: only its own rank's order).

    F(i, j) needs F(i, j-1); B or I (i, j) needs the input gradients of (i, j+1), or F(i, j)
    on the last stage; W(i, j) needs I(i, j). Stages are in topological order, so every
    edge (skips included) goes to a later stage and adjacent dependencies imply the rest.
    """
    if a.kind == "F":
        return (a.stage - 1, "F", a.mb) if a.stage > 0 else None
    if a.is_backward:
        return (a.stage + 1, "G", a.mb) if a.stage < n - 1 else (a.stage, "F", a.mb)
    if a.kind == "W":
        return (a.stage, "G", a.mb)
    return None


def _name(key: tuple[int, str, int]) -> str:
    """Name a step key (stage, kind, micro-batch) as the action(s) that complete it."""
    stage, kind, mb = key
    return f"{stage}B{mb} or {stage}I{mb}" if kind == "G" else f"{stage}{kind}{mb}"


def clocks(actions: Sequence[Sequence[Action]], n: int | None = None) -> dict[Action, int]:
    """Place each compute action on the earliest clock its rank and its data allow.

    A rank runs one action per clock, in its list's order, once what it waits for is done.
    Message actions take no time and are skipped. Raises :class:`ScheduleError` naming the
    first action that can never run.
    """
    rows = [[a for a in row if a.kind in COMPUTE] for row in actions]
    n = n if n is not None else 1 + max((a.stage for row in rows for a in row), default=-1)
    done: dict[tuple[int, str, int], int] = {}
    at: dict[Action, int] = {}
    pos, free = [0] * len(rows), [0] * len(rows)
    while any(pos[r] < len(rows[r]) for r in range(len(rows))):
        progressed = False
        for r, row in enumerate(rows):
            if pos[r] >= len(row):
                continue
            a = row[pos[r]]
            need = needs(a, n)
            if need is not None and need not in done:
                continue
            start = max(free[r], done[need] + 1 if need is not None else 0)
            at[a] = done[a.key] = start
            free[r] = start + 1
            pos[r] += 1
            progressed = True
        if not progressed:
            raise ScheduleError(_blocked(rows, pos, n))
    return at


def _blocked(rows: list[list[Action]], pos: list[int], n: int) -> str:
    """Explain a deadlock: follow the waits from a stuck action to the one that can never run."""
    where = {a.key: (r, k) for r, row in enumerate(rows) for k, a in enumerate(row) if k >= pos[r]}
    r = min(r for r in range(len(rows)) if pos[r] < len(rows[r]))
    seen: list[Action] = []
    while True:
        a = rows[r][pos[r]]
        need = needs(a, n)
        assert need is not None
        head = f"the schedule can never finish: {a} (action {pos[r]} of rank {r}) waits for {_name(need)}"
        if need not in where:
            return f"{head}, which is not in the schedule; add it"
        r2, k2 = where[need]
        if r2 == r:
            return f"{head}, which comes after it on rank {r}; put {rows[r2][k2]} first"
        if a in seen:
            cycle = " -> ".join(map(str, seen[seen.index(a):] + [a]))
            return f"{head}, and the waits go round in a circle ({cycle}); reorder the actions"
        seen.append(a)
        r = r2


def check(actions: Sequence[Sequence[Action]], n: int, m: int) -> None:
    """Refuse a schedule for ``n`` stages and ``m`` micro-batches that is incomplete or deadlocks.

    Every stage needs one ``F`` and either one ``B`` or one ``I`` and one ``W`` per
    micro-batch, and nothing else; message actions are added by the runtime and refused.
    """
    runs: dict[int, set[int]] = {}  # the micro-batches each stage's actions name
    for row in actions:
        for a in row:
            if not 0 <= a.stage < n:  # a stage the pipeline lacks first: whatever else is off follows from it
                raise ScheduleError(f"{a} names stage {a.stage}, but the pipeline has {n} stages (0..{n - 1})")
            if a.kind not in COMM:
                runs.setdefault(a.stage, set()).add(a.mb)
    covered = 1 + max((max(s) for s in runs.values()), default=-1)
    every = all(runs.get(j) == set(range(covered)) for j in range(n))  # no gap, no stage short: chunks= is off
    if covered and covered != m and every:  # chunks= must be the schedule's count: said first
        raise ScheduleError(f"the schedule runs {covered} micro-batches (0..{covered - 1}) but a step has {m}: "
                            f"compile with chunks={covered}, or write the schedule for {m}")
    seen: dict[tuple[int, str, int], Action] = {}
    for r, row in enumerate(actions):
        for a in row:
            if a.kind in COMM:
                raise ScheduleError(f"{a}: give only compute actions ({', '.join(COMPUTE)}); the "
                                    "runtime adds the sends and receives")
            if not 0 <= a.mb < m:  # a gap or a stage short of it, so no chunks= fits: a number mistyped
                raise ScheduleError(f"{a} names micro-batch {a.mb}, but a step has {m} (0..{m - 1}) and the "
                                    f"stages do not all run micro-batches 0..{covered - 1}: "
                                    + (f"number them 0..{m - 1}, or drop" if m > 1 else "drop")
                                    + f" the actions of micro-batches past {m - 1}")
            if (a.stage, a.kind, a.mb) in seen:
                raise ScheduleError(f"{a} appears twice; each step runs once")
            seen[(a.stage, a.kind, a.mb)] = a
    for j in range(n):
        for i in range(m):
            has = {k for k in COMPUTE if (j, k, i) in seen}
            if "F" not in has:
                raise ScheduleError(f"stage {j} never runs the forward of micro-batch {i}: add {j}F{i}")
            if has == {"F", "W"}:
                raise ScheduleError(f"stage {j}, micro-batch {i}: {j}W{i} needs its other half {j}I{i} (the input "
                                    f"gradient, before it), or give the whole backward as {j}B{i} instead of {j}W{i}")
            if not has & {"B", "I"}:
                raise ScheduleError(f"stage {j} never runs the backward of micro-batch {i}: add {j}B{i} "
                                    f"(or {j}I{i} and {j}W{i})")
            if "B" in has and has & {"I", "W"}:
                raise ScheduleError(f"stage {j}, micro-batch {i} has both {j}B{i} (the full backward) and "
                                    f"{j}I{i}/{j}W{i} (its two halves); keep one or the other")
            if ("I" in has) != ("W" in has):
                missing = "W" if "I" in has else "I"
                raise ScheduleError(f"stage {j}, micro-batch {i}: {j}{'I' if missing == 'W' else 'W'}{i} "
                                    f"needs its other half {j}{missing}{i}")
    clocks(actions, n)


def in_flight(stage_actions: Iterable[Action]) -> int:
    """Return the most micro-batches a rank holds activations for at once."""
    live = peak = 0
    for a in stage_actions:
        live += 1 if a.kind == "F" else -1 if a.is_backward else 0
        peak = max(peak, live)
    return peak


def lower(actions: Sequence[Action], receives_from: dict[int, bool], sends_to: dict[int, bool],
          grads_from: dict[int, bool], grads_to: dict[int, bool]) -> list[Action]:
    """Add the messages around a rank's compute actions: receive before, send after.

    The maps say, per stage, whether it has inputs made on another rank, outputs read on
    another rank, and gradients to receive or to send back.
    """
    out = []
    for a in actions:
        if a.kind == "F" and receives_from.get(a.stage):
            out.append(Action(a.stage, "RECV_F", a.mb))
        if a.is_backward and grads_from.get(a.stage):
            out.append(Action(a.stage, "RECV_B", a.mb))
        out.append(a)
        if a.kind == "F" and sends_to.get(a.stage):
            out.append(Action(a.stage, "SEND_F", a.mb))
        if a.is_backward and grads_to.get(a.stage):
            out.append(Action(a.stage, "SEND_B", a.mb))
    return out
