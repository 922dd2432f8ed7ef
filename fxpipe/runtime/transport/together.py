"""Name the cause when a call every rank makes together (``fxpipe.save``, ``clip_grad_norm_``) times out.

A rank that calls it alone (``if rank == 0: fxpipe.save(...)``) waits in the call's first
collective until the process group's timeout, and gloo or NCCL then raise their own
``Timed out waiting ... for send operation`` naming neither the call nor the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fxpipe.errors import PeerFailure

__all__ = ["communication_failed", "first_line", "together"]

_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl")


def communication_failed(exc: BaseException) -> bool:
    """Tell whether ``exc`` is a failed collective rather than a refusal of fxpipe's or the user's."""
    if isinstance(exc, PeerFailure):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _SIGNS)


def first_line(exc: BaseException) -> str:
    """Return the first line of an exception's message (its type's name if it has none), cut to 300 characters."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


@contextmanager
def together(call: str, rank: int, broke: Callable[[BaseException], None] | None = None) -> Iterator[None]:
    """Run the block, a collective every rank enters; a failed collective becomes a :class:`PeerFailure` naming ``call``.

    ``broke`` (the runtime's) is told of the failure, so the rank's next call rejoins its peers.
    """
    try:
        yield
    except Exception as exc:
        if not communication_failed(exc):
            raise
        if broke is not None:
            broke(exc)
        raise PeerFailure(f"rank {rank}: {call} is called by every rank together, but the other ranks did not "
                          f"join it ({first_line(exc)}): call it on every rank, not under `if rank == 0:` (a rank that "
                          "died or is still in another call gives this too)") from exc
