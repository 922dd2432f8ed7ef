"""Remember the ``pipe(x)`` calls a rank finished before the later ranks did, to run them again.

In a ``pipe(x)`` a rank returns once it has sent its part on; nothing tells it that the later
stages finished. With more than two ranks a middle rank can be several calls ahead of the last
one, whose failure of an earlier call reaches it only then::

    rank 1   call k ✓   call k+1 ✓   call k+2 ──▶ meets "call k failed on rank 3"
    rank 3   call k ✗   (raises)     call k+1 (the user's next: a good batch)

The failing rank's next call is k+1, so rank 1 must rejoin and run k+1 again (its result
discarded: the user has it) before k+2; a rank one call ahead runs only its current call again.
:class:`LateCalls` keeps, per rank, those calls (their number, body and random state at their
start) until a call the last rank confirms (a step, which every rank ends together) clears them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["LateCalls"]


class LateCalls:
    """The unconfirmed ``pipe(x)`` calls in a row: (call number, body, random state at its start)."""

    def __init__(self, ranks: int) -> None:
        # a rank gets at most one call ahead of the next rank: never more than the pipeline's ranks
        self.calls: deque[tuple[int, Callable[[], Any], Any]] = deque(maxlen=max(ranks, 1))

    def knows(self, number: Any) -> bool:
        """Tell whether call ``number`` is one this rank finished early and still remembers."""
        return any(n == number for n, _, _ in self.calls)

    def after(self, failed: int) -> list[tuple[int, Callable[[], Any], Any]]:
        """Forget the calls up to ``failed`` (every rank reached them); return the later ones, to run again."""
        while self.calls and self.calls[0][0] <= failed:
            self.calls.popleft()
        return list(self.calls)

    def finished(self, number: int, body: Callable[[], Any], state: Any, unconfirmed: bool) -> None:
        """Record call ``number`` when this rank finished it before the last stage did; else forget them all."""
        if unconfirmed:
            self.calls.append((number, body, state))
        else:
            self.calls.clear()
