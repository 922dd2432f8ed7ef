"""Name the cause when a call every rank makes together (``fxpipe.save``, ``clip_grad_norm_``) times out.

A rank that calls it alone (``if rank == 0: fxpipe.save(...)``) waits in the call's first
collective until the process group's timeout, and gloo or NCCL then raise their own
``Timed out waiting ... for send operation`` naming neither the call nor the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fxpipe.errors import PeerFailure

__all__ = ["communication_failed", "first_line", "succeeded_together", "together"]

_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl")
# gloo's prefix (its source file and line) and its closing advice on a closed connection, which
# blames a crash where a rank may only have skipped the call or ended its script
_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_ADVICE = re.compile(r"\s*This is typically caused by a remote worker crashing\..*$")


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
    if not text:
        return type(exc).__name__
    line = _ADVICE.sub("", _SOURCE.sub("", text.splitlines()[0]))
    return (line or text.splitlines()[0])[:300]


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
        after = ""
        if broke is not None:
            broke(exc)
            after = (". The other ranks' call this one kept waiting (their next pipe.step) failed meanwhile: skip "
                     "this rank's next pipe.step too (continue your loop past it), or this rank's steps pair with "
                     "the others' next ones (one batch's inputs against the next one's target, silently)")
        raise PeerFailure(f"rank {rank}: {call} is called by every rank together, but the other ranks did not "
                          f"join it ({first_line(exc)}): call it on every rank, not under `if rank == 0:` (a rank that "
                          f"died or is still in another call gives this too){after}") from exc


def succeeded_together(what: str, failed: BaseException | None) -> None:
    """Tell every rank whether this one got through ``what``; raise on every rank if one did not.

    A rank whose own trace of the model fails (a model cast to another dtype on that rank) raised
    there, and the others met gloo's "Connection closed by peer" in their next collective,
    naming neither the rank nor the cause. One ``all_gather_object`` of a line per rank instead:
    the failing rank raises its own error, the others :class:`PeerFailure` quoting it.
    """
    told: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(told, None if failed is None else f"{type(failed).__name__}: {first_line(failed)}")
    if failed is not None:
        raise failed
    bad = [(r, line) for r, line in enumerate(told) if line is not None]
    if bad:
        r, line = bad[0]
        raise PeerFailure(f"rank {dist.get_rank()}: rank {r} failed {what} ({line}); every rank must build the "
                          "same model from the same config, in the same dtype, with the same example inputs")
