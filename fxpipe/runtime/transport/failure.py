"""Tell every rank of a pipeline why a step failed, and bring them back together for the next one.

The ranks share the rendezvous store. Every key fxpipe writes there lives under one prefix
per torchrun restart round, pipe and failure count (the *generation*), so nothing from a
round, a pipe or an earlier failure is read in another::

    fxpipe/<restart round>/<pipe>/<generation>/error        why the step failed (first writer wins)
    fxpipe/<restart round>/<pipe>/<generation>/back/<rank>  this rank is ready again
    fxpipe/<restart round>/<pipe>/parted                    a rank gave up rejoining: no call may run
    fxpipe/<restart round>/<pipe>/ended/<global rank>       its script ended after this many calls (and on what)
    fxpipe/<restart round>/where/<global rank>            the pipe this process called last


    rank r raises   ──▶ posts why, closes its connections (its peers' waits fail at once)
    a peer's wait   ──▶ reads why: PeerFailure naming rank r; closes its own connections, so
    fails               the ranks waiting on it wake too. No reason posted: the rank it waited
                        on died; it posts that, marked fatal
    the next step   ──▶ every rank posts ``back`` and waits for all; then fresh connections,
                        generation + 1. A fatal reason, or a rank not back within the timeout,
                        raises PeerFailure naming it instead; the rank that gave up posts
                        ``parted``, so the late rank's next call is refused as well rather
                        than paired with a later call of the others
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from fxpipe.errors import PeerFailure

__all__ = ["FailureBoard"]

log = logging.getLogger(__name__)

_PIPES = itertools.count()  # every rank compiles its pipes in the same order: the same number for each
_entered: list[str | None] = [None]  # the prefix of the pipe this process called last (written on a change)
_BOARDS: weakref.WeakValueDictionary[str, FailureBoard] = weakref.WeakValueDictionary()  # this process's, by prefix


class FailureBoard:
    """The store keys through which the ranks of one pipeline report failures and rejoin."""

    def __init__(self, store: Any, rank: int, size: int, timeout: float,
                 global_ranks: Sequence[int] | None = None, world: int | None = None) -> None:
        self.store = store
        self.rank = rank  # pipeline rank
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))  # how errors name ranks
        self.size = size  # ranks in the pipeline
        self.world = world or max(self.global_ranks) + 1  # ranks of the pipe: every pipeline's (replicas, tp)
        self.timeout = timeout
        self.generation = 0
        self.call = 0  # this rank's calls of the pipe so far (every rank makes the same calls): posted with a failure
        self.death: str | None = None  # a death this rank learned of: no step can run after it
        self.crossed = False  # that death is the ranks' calls crossed between pipes, not a lost rank
        self.parted = False  # that death is a rank given up on while rejoining: the calls no longer pair
        self.prefix = f"fxpipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_PIPES)}"
        _BOARDS[self.prefix] = self

    def _key(self, *parts: object) -> str:
        """Return the store key of ``parts`` in this generation."""
        return "/".join([self.prefix, str(self.generation), *map(str, parts)])

    def enter(self, me: int) -> None:
        """Note on the store that global rank ``me`` now calls this pipe, if its last call was to another.

        One store write per change of pipe (none while a script calls one pipe): what a peer that
        times out reads to tell a rank calling another pipe from a slow or dead one (:meth:`elsewhere`).
        """
        if _entered[0] != self.prefix:
            try:
                self.store.set(self._where(me), self.prefix)
                _entered[0] = self.prefix
            except Exception as exc:  # noqa: BLE001 - only a better message depends on it
                log.debug("could not note this rank's pipe on the store: %s", exc)

    def elsewhere(self, me: int) -> list[tuple[int, int]]:
        """Return ``(global rank, pipe number)`` of each peer whose last call was to another pipe."""
        found = []
        for rank in self.global_ranks:
            try:
                if rank != me and self.store.check([self._where(rank)]):
                    prefix = self.store.get(self._where(rank)).decode()
                    if prefix != self.prefix:
                        found.append((rank, int(prefix.rsplit("/", 1)[-1])))
            except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
                return found
        return found

    def post_crossed(self, message: str, numbers: Sequence[int]) -> None:
        """Post a crossing of the ranks' calls on this pipe and on the pipes ``numbers`` the peers were in.

        A peer that timed out first may already have gone on to call the pipe this rank is
        in; its board must hold the crossing too, or that peer's next call would pair with
        this rank's call after it.
        """
        self.post(message, crossed=True)
        base = self.prefix.rsplit("/", 1)[0]
        for n in set(numbers):
            board = _BOARDS.get(f"{base}/{n}")
            if board is not None and board is not self:
                board.post(message, crossed=True)

    def number(self) -> int:
        """Return this pipe's number: how many pipes this process made before it."""
        return int(self.prefix.rsplit("/", 1)[-1])

    def _where(self, rank: int) -> str:
        """Return the store key naming the pipe global rank ``rank`` called last."""
        return f"{self.prefix.rsplit('/', 1)[0]}/where/{rank}"

    def post(self, message: str, fatal: bool = False, crossed: bool = False) -> None:
        """Post why the step failed, unless a reason is already posted (best effort: the store may be gone).

        ``crossed``: the ranks called their pipes in different orders, which is fatal too: after
        it their calls can pair off by one (a rank's inputs of one batch with another's target
        of the next), so no later call may run.
        """
        fatal = fatal or crossed
        try:
            posted = json.dumps({"message": message, "fatal": fatal, "crossed": crossed, "call": self.call})
            if self.store.compare_set(self._key("error"), "", posted).decode() != posted:  # set only if unset
                self.read("posting a failure")  # the first reason is every rank's: remember it if a death
                return
        except Exception as exc:  # noqa: BLE001 - the store itself may be down; we are failing anyway
            log.debug("could not post this rank's failure to the store: %s", exc)
        if fatal and self.death is None:  # posted, or the store is gone: this rank's reason stands
            self.death, self.crossed = message, crossed

    def read(self, what: str) -> dict[str, Any] | None:
        """Return the posted reason of this generation (``message``, ``fatal``, the failing rank's ``call``), or None."""
        try:
            if not self.store.check([self._key("error")]):
                return None
            reason = json.loads(self.store.get(self._key("error")).decode())
        except Exception as exc:  # noqa: BLE001
            raise PeerFailure(f"rank {self.global_ranks[self.rank]}: lost the rendezvous store while {what} "
                              f"(the process hosting it, usually rank 0 or torchrun's agent, probably "
                              f"died): {exc}") from None
        if reason["fatal"] and self.death is None:
            self.death, self.crossed = reason["message"], bool(reason.get("crossed"))
        return reason

    def rejoin(self) -> None:
        """Wait until every rank of the pipeline is back after a failed step; then start a new generation.

        Raises :class:`PeerFailure` at once when the failure was a death (known here first: the
        store's host may be the rank that died, or may have exited since), or naming the ranks
        that are not back within the timeout.
        """
        if self.death is None:
            self.read("rejoining after a failed step")
        if self.death is None and self._has(self._parted()):
            self.death, self.parted = self.store.get(self._parted()).decode(), True
        if self.parted:
            me = f"rank {self.global_ranks[self.rank]}"
            what = str(self.death).replace(f"{me} gave up", "this rank gave up", 1)
            raise PeerFailure(f"{me}: {what}; from then on one rank's calls "
                              "no longer pair with the others' (a rank's inputs would meet another's next target), so "
                              "this pipe refuses every call: restart the job and resume from the last complete "
                              "checkpoint (fxpipe.latest_checkpoint), with timeout= above the longest stall")
        if self.death is not None and self.crossed:
            raise PeerFailure(f"rank {self.global_ranks[self.rank]}: an earlier call of this pipe timed out because "
                              f"the ranks called their pipes in different orders ({self.death}); after that their "
                              "calls cannot be paired again (one rank's inputs would meet another's next target): "
                              "fix the order, restart the job and resume from the last complete checkpoint "
                              "(fxpipe.latest_checkpoint)")
        if self.death is not None:
            raise PeerFailure(f"rank {self.global_ranks[self.rank]}: the pipeline lost a rank in an earlier step "
                              f"({self.death}); it cannot go on without it: restart the job "
                              "(torchrun --max-restarts) and resume from the last complete checkpoint "
                              "(fxpipe.latest_checkpoint)")
        keys = [self._key("back", r) for r in range(self.size)]
        self.store.set(keys[self.rank], "1")
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001 - the timeout, or the store lost: say which ranks are missing
            missing = [self.global_ranks[r] for r, k in enumerate(keys) if not self._has(k)]
            if missing:
                self._part(missing)
                raise PeerFailure(f"rank {self.global_ranks[self.rank]}: after a failed step, rank(s) {missing} did "
                                  f"not come back within {self.timeout:.0f} s (dead, stalled, or not calling "
                                  "pipe.step/pipe(x) again; every rank must catch the error and go on together). "
                                  "A rank back later would pair its calls with the others' next ones, so this pipe "
                                  "refuses every later call on every rank: restart the job and resume from the last "
                                  "complete checkpoint (fxpipe.latest_checkpoint)") from None
        self.generation += 1
        log.info("pipeline rank %d rejoined its pipeline after a failed step (generation %d)",
                 self.rank, self.generation)

    def end(self) -> None:
        """Post, as this rank's script ends, how many calls of the pipe it made, and the error it ends on (best effort).

        A peer whose connection to this rank then closes in a later call tells a skipped call or
        an error outside the pipe's calls (:meth:`ended_before`) from a death. The keys are by
        global rank: the pipelines of a pipe (replicas, tensor-parallel indices) share them.
        """
        try:
            self.store.set(f"{self.prefix}/ended/{self.global_ranks[self.rank]}",
                           json.dumps({"calls": self.call, "error": _unhandled()}))
        except Exception as exc:  # noqa: BLE001 - the store's host may have exited first
            log.debug("could not post this rank's end to the store: %s", exc)

    def ended_before(self) -> str | None:
        """Say which peers' scripts ended before making the call this rank is in, after how many calls and on what
        error; or None."""
        me, short, errors = self.global_ranks[self.rank], [], []
        for g in range(self.world):
            key = f"{self.prefix}/ended/{g}"
            if g != me and self._has(key):
                try:
                    ended = json.loads(self.store.get(key).decode())
                except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
                    return None
                if ended["calls"] < self.call:
                    short.append(f"rank {g} after {ended['calls']}")
                    if ended["error"]:
                        errors.append(f"rank {g} on {ended['error']}")
        if not short:
            return None
        head = f"the script of {', '.join(short)} call(s) of this pipe ended while rank {me} is in its call {self.call}"
        if errors:
            return (f"{head}: it ended on an error raised outside the pipe's calls ({'; '.join(errors)}; its "
                    "traceback is in that rank's log). Fix it, restart the job and resume from the last complete "
                    "checkpoint (fxpipe.latest_checkpoint)")
        return (f"{head}: its script stopped early (sys.exit, an error caught there and not raised again), or "
                "skipped a call: every rank makes the same calls (pipe.step and pipe(x) together, as many times), and "
                "a call skipped on one rank (under `if rank == ...:`, a `continue`, a shorter loader) paired each of "
                "its later calls with the others' next one, so the steps since ran one step's inputs against "
                "another's target: fix the loop, and resume from a checkpoint saved before the skip")

    def post_ended(self) -> str | None:
        """Post, as every rank's fatal reason, that a peer's script ended before this call (:meth:`ended_before`);
        return what was posted, or None."""
        ended = self.ended_before()
        if ended is not None:
            self.post(ended, fatal=True)
        return ended

    def _parted(self) -> str:
        """Return the store key a rank that gave up rejoining writes (one per pipe, every generation's)."""
        return f"{self.prefix}/parted"

    def _part(self, missing: Sequence[int]) -> None:
        """Post that this rank gave up waiting for ``missing`` to rejoin, and refuse every later call here."""
        self.death = (f"rank {self.global_ranks[self.rank]} gave up waiting for rank(s) {list(missing)} to rejoin "
                      f"after a failed step ({self.timeout:.0f} s, the pipe's timeout=)")
        self.parted = True
        try:
            self.store.set(self._parted(), self.death)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the late rank cannot rejoin anyway
            log.debug("could not post the parting to the store: %s", exc)

    def _has(self, key: str) -> bool:
        """Tell whether ``key`` is in the store (False if the store is gone)."""
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001
            return False


def _unhandled() -> str | None:
    """Name the exception ending the interpreter (``sys.last_value``, set as its traceback is printed), or None."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return None
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
