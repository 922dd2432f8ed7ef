"""Place a schedule's actions in time: per-rank action lists, a duration per action, message delays.

A schedule is a list of action lists, one per rank, each run in its order
(:mod:`fxpipe.runtime.schedules.actions`); ``rank_of[s]`` says which rank holds stage ``s``, so a rank
may hold several stages (interleaved 1F1B places stage ``s`` on rank ``s mod world``; ZB-V
folds the stages into a V). An action starts when its rank is free and what it waits for is
done, plus the message delay when that came from another rank::

    F(i, j)        waits for F(i, p) of every stage p that feeds stage j   (+ send delay)
    B/I(i, j)      waits for B/I(i, c) of every stage c that reads stage j (+ send delay),
                   or for F(i, j) on a stage nobody reads (the last: its loss)
    W(i, j)        waits for B/I(i, j)

Two ways to run the lists:

- ``clocked=False`` (ranks, the distributed runtime): every rank runs on as soon as it can;
  the step ends when the last rank finishes.
- ``slots=`` (ranks sharing a CPU's cores): as above, but while more ranks compute than the
  machine has ``slots`` for, they share them: with ``k`` ranks busy, each standing for ``weight``
  processes (its replicas and tensor-parallel peers, which run the same actions at the same
  time), each computes at ``min(1, slots / (k x weight))`` of its speed alone (processor
  sharing). A message's flight takes no slot::

      2 slots, 4 ranks busy:    each at half speed      ─▶ a rank waiting on a message
      2 slots, 1 rank busy:     it alone, at full speed     gives its core to the others

- ``hold=`` (either way across ranks): after an action's compute its rank may stay blocked,
  waiting on a collective it started (DDP's all-reduce at the end of a stage's last backward,
  :mod:`fxpipe.simulate.dpcost`): ``hold(a, seconds)`` more seconds, taking no processor. The action,
  what it sends and the rank's next action all wait for it::

      B(3, last) ████████░░░░░░░  ─▶ B(1, last) on the same rank; its gradients sent
                 compute  reduce      (sent after the backward call returns)

- ``wake=`` (either way across ranks): an action that had to wait for a message starts that
  many seconds after the message is in (a CPU core that went idle, or a rank descheduled while
  it waited, takes that long to run again; measured by :mod:`fxpipe.simulate.linktime`).

- ``clocked=True`` (one process, :mod:`fxpipe.runtime.local`): actions run clock by clock, as
  :func:`~fxpipe.runtime.schedules.actions.clocks` places them with unit times; the actions of one
  clock on one device run one after another, devices in parallel, and the next clock starts
  when every device is done. All stages on one CPU thus take the sum of their actions.

The result is a list of :class:`Span` (start and end seconds of each action), the input of
the memory walk (:mod:`fxpipe.simulate.memsim`) and of the Chrome trace (:mod:`fxpipe.simulate`).
:func:`schedule_rows` turns a schedule's name (or your own action lists) into the lists per
rank, with the ranks of :func:`placement_map`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import ScheduleError
from fxpipe.runtime.schedules.actions import COMPUTE, Action, check, clocks, load_schedule
from fxpipe.runtime.schedules.builtin import MULTI_PRODUCERS, PLACEMENTS, PRODUCERS, check_name

__all__ = ["Span", "default_links", "placement_map", "run", "schedule_rows"]

# (stage that sends, stage that receives, "F" for values or "B" for gradients, micro-batch) -> seconds
Delay = Callable[[int, int, str, int], float]
# (action, seconds its compute took) -> seconds its rank stays blocked after it, on no processor
Hold = Callable[[Action, float], float]


@dataclass(frozen=True)
class Span:
    """One action placed in time, on the rank (or device) that ran it."""

    action: Action
    rank: int
    start: float
    end: float


def default_links(n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Return ``(feeds, reads)`` of a chain: stage j is fed by j - 1 and read by j + 1."""
    return [[j - 1] if j else [] for j in range(n)], [[j + 1] if j < n - 1 else [] for j in range(n)]


def _waits(a: Action, feeds: Sequence[Sequence[int]], reads: Sequence[Sequence[int]]
           ) -> list[tuple[tuple[int, str, int], int, str]]:
    """Return what ``a`` waits for: ``(step key, stage it comes from, message kind)`` triples."""
    if a.kind == "F":
        return [((p, "F", a.mb), p, "F") for p in feeds[a.stage]]
    if a.is_backward:
        if not reads[a.stage]:
            return [((a.stage, "F", a.mb), a.stage, "")]
        return [((c, "G", a.mb), c, "B") for c in reads[a.stage]]
    if a.kind == "W":
        return [((a.stage, "G", a.mb), a.stage, "")]
    return []


def run(ranks: Sequence[Sequence[Action]], duration: Callable[[Action], float], *,
        n_stages: int | None = None, rank_of: Sequence[int] | None = None,
        delay: Delay | None = None, feeds: Sequence[Sequence[int]] | None = None,
        reads: Sequence[Sequence[int]] | None = None, clocked: bool = False,
        device_of: Sequence[int] | None = None, slots: float = 0.0, weight: int = 1,
        wake: float = 0.0, hold: Hold | None = None) -> list[Span]:
    """Place every compute action of ``ranks`` in time; return the spans in start order.

    ``duration(a)`` gives an action's seconds; ``delay(src, dst, kind, mb)`` the seconds a
    message from stage ``src`` to stage ``dst`` on another rank takes (default 0).
    ``feeds``/``reads`` list, per stage, the stages it receives values from / sends values
    to (default: a chain). With ``clocked=True``, ``device_of[r]`` names the device of rank
    ``r`` (default: all on one), and messages cross only between devices. ``slots`` > 0: the
    ranks (each ``weight`` processes) share that many processors (see the module). ``wake``:
    seconds a rank that had to wait for a message takes to resume once it is there (a CPU core
    gone idle waking up). ``hold(a, seconds)``: seconds the rank stays blocked after ``a``'s compute,
    on no processor (a collective it waits for; across ranks only). Raises :class:`ScheduleError` for
    a schedule that cannot finish.
    """
    rows = [[a for a in row if a.kind in COMPUTE] for row in ranks]
    n = n_stages if n_stages is not None else 1 + max((a.stage for row in rows for a in row), default=-1)
    where = list(rank_of) if rank_of is not None else _ranks_from_rows(rows, n)
    if feeds is None or reads is None:
        feeds, reads = default_links(n)
    delay = delay or (lambda src, dst, kind, mb: 0.0)
    devices = list(device_of) if device_of is not None else [0] * len(rows)
    if clocked:  # one process: a value moves only between devices
        where = [devices[r] for r in where]

    def ready(a: Action, done: dict[tuple[int, str, int], float]) -> float | None:
        """Return when ``a``'s inputs are in place, or None if something it waits for has not run."""
        t = 0.0
        for key, src, kind in _waits(a, feeds, reads):
            if key not in done:
                return None
            far = kind and where[src] != where[a.stage]
            t = max(t, done[key] + (delay(src, a.stage, kind, a.mb) if far else 0.0))
        return t

    if clocked:
        return _clocked(rows, n, ready, duration, devices)
    if slots > 0 and len(rows) * weight > slots:
        return _shared(rows, n, ready, duration, slots / weight, wake, hold)
    done: dict[tuple[int, str, int], float] = {}
    spans: list[Span] = []
    pos, free = [0] * len(rows), [0.0] * len(rows)
    while any(pos[r] < len(rows[r]) for r in range(len(rows))):
        progressed = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                t = ready(a, done)
                if t is None:
                    break
                start = t + wake if t > free[r] else free[r]
                busy = duration(a)
                end = start + busy + (hold(a, busy) if hold is not None else 0.0)
                spans.append(Span(a, r, start, end))
                done[a.key] = free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            clocks(rows, n)  # raises, naming the first action that can never run
            raise ScheduleError("the schedule can never finish")  # pragma: no cover - clocks raised
    return sorted(spans, key=lambda s: (s.start, s.rank))


def _shared(rows: list[list[Action]], n: int, ready: Callable, duration: Callable[[Action], float],
            slots: float, wake: float = 0.0, hold: Hold | None = None) -> list[Span]:
    """Run every rank on as soon as it can, the busy ranks sharing ``slots`` processors equally
    (a rank held after its compute shares none)."""
    done: dict[tuple[int, str, int], float] = {}
    spans: list[Span] = []
    pos = [0] * len(rows)
    running: dict[int, list] = {}  # rank -> [action, work left (seconds alone), start]
    held: dict[int, tuple[Action, float, float]] = {}  # rank -> (action, start, when its hold ends)
    free = [0.0] * len(rows)  # when each rank's last action ended
    t = 0.0

    def finish(r: int, a: Action, start: float, end: float) -> None:
        """Place ``a`` on rank ``r`` from ``start`` to ``end``: what it sends leaves then."""
        spans.append(Span(a, r, start, end))
        done[a.key] = free[r] = end

    while True:
        for r in [r for r, (_, _, until) in held.items() if until <= t]:
            a, start, until = held.pop(r)
            finish(r, a, start, until)
        arrivals = [until for _, _, until in held.values()]
        for r, row in enumerate(rows):
            if r in running or r in held or pos[r] >= len(row):
                continue
            at = ready(row[pos[r]], done)
            if at is not None and at > free[r]:  # it waits for a message: it resumes once awake
                at += wake
            if at is not None and at <= t:
                running[r] = [row[pos[r]], duration(row[pos[r]]), t]
                pos[r] += 1
            elif at is not None:
                arrivals.append(at)
        if not running:
            if arrivals:
                t = min(arrivals)
                continue
            if all(pos[r] == len(row) for r, row in enumerate(rows)):
                return sorted(spans, key=lambda s: (s.start, s.rank))
            clocks(rows, n)  # raises, naming the first action that can never run
            raise ScheduleError("the schedule can never finish")  # pragma: no cover - clocks raised
        rate = min(1.0, slots / len(running))
        ends = {r: work / rate for r, (_, work, _) in running.items()}
        step = min(ends.values())
        if arrivals and min(arrivals) - t < step:
            step = min(arrivals) - t
        t += step
        for r in list(running):
            if ends[r] <= step * (1 + 1e-9):
                a, _, start = running.pop(r)
                wait = hold(a, t - start) if hold is not None else 0.0
                if wait > 0:
                    held[r] = (a, start, t + wait)
                else:
                    finish(r, a, start, t)
            else:
                running[r][1] -= step * rate


def _ranks_from_rows(rows: list[list[Action]], n: int) -> list[int]:
    """Return the rank of each stage as the rows hold them (a stage on no row: its own index)."""
    where = list(range(n))
    for r, row in enumerate(rows):
        for a in row:
            where[a.stage] = r
    return where


def _clocked(rows: list[list[Action]], n: int, ready: Callable, duration: Callable[[Action], float],
             device_of: Sequence[int]) -> list[Span]:
    """Run clock by clock: one device's actions of a clock in turn, devices together, then a barrier."""
    at = clocks(rows, n)
    rank = {a: r for r, row in enumerate(rows) for a in row}
    by_clock: dict[int, list[Action]] = {}
    for a in sorted(at, key=lambda a: (at[a], a.stage)):
        by_clock.setdefault(at[a], []).append(a)
    done: dict[tuple[int, str, int], float] = {}
    spans: list[Span] = []
    begin = 0.0
    for k in sorted(by_clock):
        free: dict[int, float] = {}
        for a in by_clock[k]:
            d = device_of[rank[a]]
            start = max(free.get(d, begin), ready(a, done) or 0.0)
            end = start + duration(a)
            spans.append(Span(a, d, start, end))
            done[a.key] = free[d] = end
        begin = max(free.values())
    return spans


def placement_map(placement: str | Sequence[int] | None, n: int, world: int | None) -> list[int]:
    """Return the rank of each of ``n`` stages: one each, ``"loop"`` (stage s on rank s mod world),
    ``"V"`` (down the ranks and back up), or an explicit list."""
    if placement is None:
        return list(range(n))
    if not isinstance(placement, str):
        if len(placement) != n:
            raise ValueError(f"placement lists {len(placement)} ranks for {n} stages; give one rank per stage")
        return [int(r) for r in placement]
    w = world or n
    if placement == "loop":
        return [s % w for s in range(n)]
    if placement == "V":
        return [s % w if (s // w) % 2 == 0 else w - 1 - s % w for s in range(n)]
    raise ValueError(f"placement={placement!r}; use 'loop', 'V', or a list of one rank per stage")


def schedule_rows(schedule: Any, n: int, m: int, placement: Any, ranks: int | None
                  ) -> tuple[str, list[list[Action]], list[int]]:
    """Return a schedule's name (``"custom"`` for your own action lists), its action lists per rank,
    and the rank of each stage.

    A built-in producer's lists are per stage (one stage per rank), or already per rank when
    they mix stages (a producer for several stages per rank): then the lists say the placement.
    """
    if isinstance(schedule, str) and schedule in MULTI_PRODUCERS:  # several stages per rank
        if not ranks and n % 2:
            raise ScheduleError(f"schedule={schedule!r} places several of the {n} stages on each rank; say on how "
                                f"many ranks with ranks= (a divisor of {n}; by default two stages per rank)")
        world = ranks if ranks else n // 2
        if schedule == "zbv" and n != 2 * world:
            raise ScheduleError(f"schedule='zbv' puts two stages on each rank: {n} stages run on ranks={n // 2}, "
                                f"not ranks={world}" if n % 2 == 0 else
                                f"schedule='zbv' puts two stages on each rank: give an even number of stages, not {n}")
        own = PLACEMENTS[schedule](n, world)
        _refuse_other_placement(schedule, placement, n, world, own)
        return schedule, MULTI_PRODUCERS[schedule](n, m, world), own
    if isinstance(schedule, str) and schedule in PRODUCERS:
        produced = PRODUCERS[schedule](n, m)
        if any(a.stage != r for r, row in enumerate(produced) for a in row):  # rows per rank already
            _refuse_other_placement(schedule, placement, n, ranks, _owners(produced, n))
            return schedule, produced, _owners(produced, n)
        rank_of = placement_map(placement, n, ranks)
        if max(rank_of) + 1 != n:
            raise ValueError(f"schedule={schedule!r} runs one stage per rank; for placement={placement!r} "
                             "give the schedule's action lists per rank")
        rows: list[list[Action]] = [[] for _ in range(n)]
        for j, acts in enumerate(produced):
            rows[rank_of[j]] += acts
        return schedule, rows, rank_of
    check_name(schedule)
    rows = load_schedule(schedule)
    check(rows, n, m)
    _refuse_other_placement("your own", placement, n, len(rows), _owners(rows, n))
    return "custom", rows, _owners(rows, n)


def _refuse_other_placement(schedule: str, placement: Any, n: int, world: int | None, own: list[int]) -> None:
    """Refuse a ``placement=`` other than the one a schedule's action lists fix (it would be ignored)."""
    if placement is None or placement_map(placement, n, world) == own:
        return
    raise ValueError(
        f"placement={placement!r} differs from where schedule={schedule!r}'s action lists put the {n} stages "
        f"(ranks {own}): lists that hold several stages per rank fix their placement. Leave placement= out, or "
        "write your own action lists for the placement you want (placement= places one-stage-per-rank schedules)")


def _owners(rows: list[list[Action]], n: int) -> list[int]:
    """Return the rank whose list holds each stage's actions."""
    owner = {a.stage: r for r, row in enumerate(rows) for a in row}
    return [owner.get(j, j) for j in range(n)]
