"""Point-to-point messages between ranks that never hang: every wait is bounded and explained.

The pipeline talks over its own process group whose timeout is fxpipe's ``timeout=``, so a
receive waits at most that long. A rank that raises posts its error under one key of the
rendezvous store before it re-raises; when its process ends, its connections close and the
peers' pending receives fail at once. A rank whose receive fails reads that key and raises
:class:`PeerFailure` naming the rank that failed first and why. Small per-step facts (the
batch layout rank 0 publishes, the loss the last rank returns) go point to point as pickled
bytes (:meth:`Comm.send_object`), under the same bound; no rank blocks in a collective that
a dead peer will not join.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import PeerFailure

__all__ = ["Comm", "on_every_rank"]

log = logging.getLogger(__name__)

_ERROR_KEY = "fxpipe/error"
OBJECT_TAG = 3  # small Python values (the step's layout, the loss); 1 and 2 carry tensors


def on_every_rank(exc: BaseException) -> BaseException:
    """Mark an error that every rank raises by itself (a refused input): no rank needs telling.

    Posting it would leave it under the store's one error key, and a later, real failure of
    another rank would be reported to the others as this old one.
    """
    vars(exc)["fxpipe_on_every_rank"] = True
    return exc


class Comm:
    """Send, receive and wait for one rank, failing fast when a peer fails."""

    def __init__(self, rank: int, timeout: float, group: Any, device: torch.device,
                 global_ranks: Sequence[int] | None = None) -> None:
        self.rank = rank  # the pipeline rank; peers are named by pipeline rank too
        self.global_ranks = list(global_ranks) if global_ranks is not None else None
        self.timeout = timeout
        self.group = group
        self.device = device  # where messages live: CPU for gloo, the rank's GPU for NCCL
        self.store = dist.distributed_c10d._get_default_store()
        self.pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive until sent)

    # -- failure signalling ----------------------------------------------------------
    def fail(self, message: str) -> None:
        """Tell every rank that this one failed (best effort: the store may be gone too)."""
        try:
            if not self.store.check([_ERROR_KEY]):
                self.store.set(_ERROR_KEY, message)
        except Exception as exc:  # noqa: BLE001 - the store itself may be down; we are failing anyway
            log.debug("could not post this rank's failure to the store: %s", exc)

    def check(self, what: str) -> None:
        """Raise :class:`PeerFailure` if a peer has posted an error."""
        try:
            failed = self.store.check([_ERROR_KEY])
        except Exception as exc:  # noqa: BLE001
            raise PeerFailure(f"rank {self.rank}: lost the rendezvous store while {what} "
                              f"(the rank hosting it, usually rank 0, probably died): {exc}") from None
        if failed:
            message = self.store.get(_ERROR_KEY).decode()
            raise PeerFailure(f"rank {self.rank} stopped while {what} because {message}")

    def wait(self, works: Sequence[Any], what: str) -> None:
        """Wait for ``works``; turn a failure or the timeout into :class:`PeerFailure`."""
        for work in works:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - closed connection or timeout
                raise self._explain(exc, what) from None

    def _explain(self, exc: Exception, what: str) -> PeerFailure:
        """Name the cause of a failed operation: a peer's posted error, the timeout, or a death."""
        self.check(what)
        if "imed out" in str(exc):
            return PeerFailure(f"rank {self.rank}: nothing arrived for {self.timeout:.0f} s while {what}; "
                               "a peer is stuck or dead (raise fxpipe.compile(..., timeout=) if a stage "
                               "is this slow)")
        return PeerFailure(f"rank {self.rank}: communication failed while {what} "
                           f"(a peer probably died): {exc}")

    # -- tensors -----------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[torch.Tensor, int, int]],
                 recvs: Sequence[tuple[torch.Tensor, int, int]], what: str) -> None:
        """Post sends and receives ``(tensor, peer, tag)`` as one batch; wait for the receives."""
        self.wait(self.post(sends, recvs, what), what)

    def post(self, sends: Sequence[tuple[torch.Tensor, int, int]],
             recvs: Sequence[tuple[torch.Tensor, int, int]], what: str) -> list[Any]:
        """Post sends and receives as one batch; return the receives' works, to :meth:`wait` on.

        The sends are held until :meth:`flush`.
        """
        works = self._batch(sends, recvs, what)
        self.pending += list(zip(works[: len(sends)], [t for t, _, _ in sends]))
        return works[len(sends):]

    def send(self, sends: Sequence[tuple[torch.Tensor, int, int]], what: str) -> list[Any]:
        """Post sends as one batch; return their works, which the caller waits for.

        A send's work keeps its tensor alive until the work is dropped, so a caller that
        knows a send has arrived waits for it and lets it go, instead of keeping every
        tensor sent in the step until :meth:`flush`.
        """
        return self._batch(sends, [], what)

    def _batch(self, sends: Sequence[tuple[torch.Tensor, int, int]],
               recvs: Sequence[tuple[torch.Tensor, int, int]], what: str) -> list[Any]:
        """Post sends then receives as one batch; return their works in that order."""
        at = self.global_ranks.__getitem__ if self.global_ranks is not None else int
        ops = [dist.P2POp(dist.isend, t, at(peer), self.group, tag) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, at(peer), self.group, tag) for t, peer, tag in recvs]
        if not ops:
            return []
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001 - a send to a closed connection fails at once
            raise self._explain(exc, what) from None

    def flush(self, what: str = "finishing sends") -> None:
        """Wait until every posted send has left."""
        pending, self.pending = self.pending, []
        self.wait([w for w, _ in pending], what)

    # -- small Python values, point to point ---------------------------------------------
    def send_object(self, value: Any, dst: int) -> None:
        """Send a small picklable value to rank ``dst`` (received by :meth:`recv_object`)."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        self.exchange([(size, dst, OBJECT_TAG), (data, dst, OBJECT_TAG)], [], "sending a small message")

    def recv_object(self, src: int, what: str) -> Any:
        """Receive a value sent by :meth:`send_object` on rank ``src``."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.exchange([], [(size, src, OBJECT_TAG)], what)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.exchange([], [(data, src, OBJECT_TAG)], what)
        return pickle.loads(bytes(data.cpu().tolist()))  # no numpy needed
