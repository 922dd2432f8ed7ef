"""Point-to-point messages between ranks that never hang: every wait is bounded and explained.

The pipeline talks over its own process group whose timeout is fxpipe's ``timeout=``, so a
receive waits at most that long. A rank that raises posts why on the rendezvous store
(:class:`~fxpipe.runtime.transport.failure.FailureBoard`) and closes its connections, so the peers'
pending receives fail at once (as they do when a process dies); a rank whose receive fails
reads the reason and raises :class:`PeerFailure` naming the rank that failed first and why.
After a failed step the ranks meet again and continue on a fresh group (:meth:`Comm.reopen`).
Small per-step facts (the batch layout rank 0 publishes, the loss the last rank returns) go
point to point as pickled bytes (:meth:`Comm.send_object`), under the same bound; no rank
blocks in a collective that a dead peer will not join.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import PeerFailure
from fxpipe.runtime.transport.failure import FailureBoard
from fxpipe.runtime.transport.together import first_line

__all__ = ["Comm", "forget_frames", "on_every_rank", "tell_all"]

log = logging.getLogger(__name__)

OBJECT_TAG = 3  # small Python values (the step's layout, the loss); 1 and 2 carry tensors
INLINE = 4096  # bytes of a small value's first message: its length, then as much of it as fits


def on_every_rank(exc: BaseException) -> BaseException:
    """Mark an error that every rank raises by itself (a refused input): no rank needs telling.

    Posting it would leave it under the store's one error key, and a later, real failure of
    another rank would be reported to the others as this old one.
    """
    vars(exc)["fxpipe_on_every_rank"] = True
    return exc


def forget_frames(exc: BaseException | None) -> None:
    """Clear the locals of the frames ``exc`` and the exceptions chained to it hold (the step's messages, the group)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def tell_all(runtime: Any, value: Any) -> None:
    """Send a small value from this rank to every other rank of its pipeline (``runtime.comm``)."""
    for r in range(runtime.world):
        if r != runtime.rank:
            runtime.comm.send_object(value, r)


class Comm:
    """Send, receive and wait for one rank, failing fast when a peer fails."""

    def __init__(self, rank: int, timeout: float, group: Any, device: torch.device,
                 global_ranks: Sequence[int] | None = None, size: int | None = None) -> None:
        self.rank = rank  # the pipeline rank (messages name ranks by their global rank: name())
        self.global_ranks = list(global_ranks) if global_ranks is not None else None
        self.timeout = timeout
        self.group = group
        self.device = device  # where messages live: CPU for gloo, the rank's GPU for NCCL
        self.store = dist.distributed_c10d._get_default_store()
        self.board = FailureBoard(self.store, rank, size or len(self.global_ranks or ()) or 1, timeout,
                                  self.global_ranks, dist.get_world_size() if dist.is_initialized() else None)
        self.pending: list[tuple[Any, Any, int]] = []  # (work, tensor kept alive until sent, peer)
        self._coalescing: bool | None = None  # whether the group's backend batches sends and receives
        self._ranks: dict[int, int] = {}  # pipeline rank -> rank in the group

    # -- failure signalling ----------------------------------------------------------
    def name(self, rank: int | None = None) -> str:
        """Name pipeline rank ``rank`` (this one by default) by its global rank, as torchrun numbers it."""
        r = self.rank if rank is None else rank
        return f"rank {self.global_ranks[r] if self.global_ranks and r < len(self.global_ranks) else r}"

    def fail(self, message: str) -> None:
        """Tell every rank that this one failed (best effort: the store may be gone too)."""
        self.board.post(message)

    def check(self, what: str) -> None:
        """Raise :class:`PeerFailure` if a peer has posted an error."""
        reason = self.board.read(what)
        if reason is not None:
            raise PeerFailure(f"{self.name()} stopped while {what} because {reason['message']}")

    def close(self) -> None:
        """Drop this rank's connections of the pipeline: every peer waiting on it fails at once.

        The group's connections close when nothing holds the group or a pending operation of
        it, so the pending sends go too (the step they belong to has failed).
        """
        self.pending = []
        self._coalescing, self._ranks = None, {}
        group, self.group = self.group, None
        if group is not None:
            try:
                if self.device.type == "cuda" and hasattr(group, "abort"):
                    group.abort()  # NCCL: abort the communicator's pending work
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - closing after a failure: nothing more to do
                log.debug("closing the pipeline group: %s", exc)

    def reopen(self, group: Any) -> None:
        """Continue on ``group``, a fresh group of the same ranks, after a failed step."""
        self.group = group
        self._coalescing, self._ranks = None, {}

    def wait(self, works: Sequence[Any], what: str, peer: int | None = None) -> None:
        """Wait for ``works``; turn a failure or the timeout into :class:`PeerFailure`."""
        for work in works:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - closed connection or timeout
                raise self._explain(exc, what, peer) from None

    def _explain(self, exc: Exception, what: str, peer: int | None = None) -> PeerFailure:
        """Name the cause of a failed operation: a peer's posted error, the timeout, or a death."""
        self.check(what)
        if "imed out" in str(exc):
            why, others = self._why_silent()
            message = f"{self.name()}: nothing arrived for {self.timeout:.0f} s while {what}; " + why
            if others:  # the ranks' calls crossed between pipes: fatal on this pipe and on theirs
                self.board.post_crossed(message, others)
            else:
                self.board.post(message)
            return PeerFailure(message)
        who = self.name(peer) if peer is not None else "a peer"
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # a peer that timed out closes its connections before it posts why
            time.sleep(0.1)
            self.check(what)
            if self.board.post_ended() is not None:  # or its script ended early (posted at its exit)
                self.check(what)  # the first reason posted is every rank's
        message = (f"{self.name()}: communication failed while {what} ({who} probably died, "
                   f"posting no error): {first_line(exc)}")
        self.board.post(f"{who} died ({self.name()} lost its connection while {what})", fatal=True)
        return PeerFailure(message)

    def _why_silent(self) -> tuple[str, list[int]]:
        """Say why a peer sent nothing: it calls another pipe (read off the store; their numbers), or is stuck."""
        me = self.global_ranks[self.rank] if self.global_ranks else self.rank
        others = self.board.elsewhere(me)
        if others:
            mine = self.board.number()
            where = ", ".join(f"rank {r} is calling pipe #{n + 1}" for r, n in others)
            return ((f"this rank is calling pipe #{mine + 1} (pipes are numbered in the order each rank made them) "
                    f"but {where}: every rank must call its pipes in the same order, since a pipe's step or "
                    "call runs on all of its ranks at once"), [n for _, n in others])
        return (("a peer did not make this call (every rank calls pipe.step and pipe(x) together, as many times, "
                 "and its pipes in the same order: a call under `if rank == 0:` or a loop of other length on one "
                 "rank leaves the others waiting), or it is stuck or dead; only if a stage is really this slow, "
                 "raise fxpipe.compile(..., timeout=)"), [])

    # -- tensors -----------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[torch.Tensor, int, int]],
                 recvs: Sequence[tuple[torch.Tensor, int, int]], what: str) -> None:
        """Post sends and receives ``(tensor, peer, tag)`` as one batch; wait for the receives."""
        peers = {peer for _, peer, _ in recvs}
        self.wait(self.post(sends, recvs, what), what, peers.pop() if len(peers) == 1 else None)

    def post(self, sends: Sequence[tuple[torch.Tensor, int, int]],
             recvs: Sequence[tuple[torch.Tensor, int, int]], what: str) -> list[Any]:
        """Post sends and receives as one batch; return the receives' works, to :meth:`wait` on.

        The sends are held until :meth:`flush`.
        """
        works = self._batch(sends, recvs, what)
        self.pending += [(w, t, peer) for w, (t, peer, _) in zip(works[: len(sends)], sends)]
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
        """Post sends then receives as one batch; return their works in that order.

        A backend that coalesces (NCCL) gets them as one ``batch_isend_irecv``; one that does not
        (gloo) would only loop over them there, building a ``P2POp`` and translating the peer's
        rank per tensor, so they go straight to the group's ``send`` and ``recv``.
        """
        if self.group is None:
            raise PeerFailure(f"{self.name()}: the pipeline's connections are closed after a failed step "
                              f"(while {what}); call pipe.step or pipe(x) again on every rank to go on")
        if not sends and not recvs:
            return []
        # Plain loops, and the refusal raised outside the except clause: a comprehension's frame
        # in the failed send's traceback held the group through its closure (and that traceback
        # stayed the refusal's __context__), so close() left the connections open and a peer
        # waiting on this rank waited for the timeout (ZB-V, gloo: a send to a peer that failed).
        failed = None
        wires = []  # made before any send: a tensor that cannot go is this rank's error, not a peer's death
        for t, _, _ in (*sends, *recvs):
            wires.append(_wire(t))
        try:
            if self._coalesces():
                at = self.global_ranks.__getitem__ if self.global_ranks is not None else int
                ops = []
                for kind, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
                    for t, peer, tag in pairs:
                        ops.append(dist.P2POp(kind, t, at(peer), self.group, tag))
                return dist.batch_isend_irecv(ops)
            works = []
            for (_, peer, tag), wire in zip(sends, wires):
                works.append(self.group.send([wire], self._group_rank(peer), tag))
            for (_, peer, tag), wire in zip(recvs, wires[len(sends):]):
                works.append(self.group.recv([wire], self._group_rank(peer), tag))
            return works
        except Exception as exc:  # noqa: BLE001 - a send to a closed connection fails at once
            failed = exc
        peers = {peer for _, peer, _ in (*sends, *recvs)}  # one peer: that is the one who died
        raise self._explain(failed, what, peers.pop() if len(peers) == 1 else None)

    def _coalesces(self) -> bool:
        """Tell whether the group's backend for this rank's device batches point-to-point operations (NCCL)."""
        if self._coalescing is None:
            self._coalescing = bool(self.group._get_backend(self.device).supports_coalescing)
        return self._coalescing

    def _group_rank(self, peer: int) -> int:
        """Return pipeline rank ``peer``'s rank in the group (asked once per peer and group)."""
        rank = self._ranks.get(peer)
        if rank is None:
            rank = self._ranks[peer] = dist.get_group_rank(
                self.group, self.global_ranks[peer] if self.global_ranks is not None else peer)
        return rank

    def flush(self, what: str = "finishing sends") -> None:
        """Wait until every posted send has left."""
        pending, self.pending = self.pending, []
        for work, _, peer in pending:  # one by one: a failed send names its peer
            self.wait([work], what, peer)

    # -- small Python values, point to point ---------------------------------------------
    def send_object(self, value: Any, dst: int) -> None:
        """Send a small picklable value to rank ``dst`` (received by :meth:`recv_object`).

        One message of :data:`INLINE` bytes holds the length and, when it fits (a step's layout,
        a loss), the value; a longer value's rest follows in a second message.
        """
        data = _dumps(value)
        head = torch.zeros(INLINE, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = min(len(data), INLINE - 8)
        if first:
            head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        sends = [(head.to(self.device), dst, OBJECT_TAG)]
        if len(data) > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            sends.append((rest.to(self.device), dst, OBJECT_TAG))
        self.exchange(sends, [], "sending a small message")

    def recv_object(self, src: int, what: str) -> Any:
        """Receive a value sent by :meth:`send_object` on rank ``src``."""
        head = torch.empty(INLINE, dtype=torch.uint8, device=self.device)
        self.exchange([], [(head, src, OBJECT_TAG)], what)
        head = head.cpu()
        size = int(head[:8].view(torch.int64).item())
        data = bytes(head[8:8 + min(size, INLINE - 8)].tolist())
        if size > INLINE - 8:
            rest = torch.empty(size - (INLINE - 8), dtype=torch.uint8, device=self.device)
            self.exchange([], [(rest, src, OBJECT_TAG)], what)
            data += bytes(rest.cpu().tolist())
        return pickle.loads(data)  # no numpy needed


class _Pickler(pickle.Pickler):
    """Pickle a named tuple by its fields, to be rebuilt without its ``__new__``.

    A layout's spec of a ``PackedSequence`` holds specs where its ``__new__`` checks tensors
    (``batch_sizes.device``): unpickled through it, it would fail on the receiving rank.
    """

    def reducer_override(self, obj: Any) -> Any:
        """Reduce a named tuple to :func:`_named_tuple` and its fields; anything else as pickle does."""
        if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
            return _named_tuple, (type(obj), tuple(obj))
        return NotImplemented


def _named_tuple(cls: type, fields: tuple) -> Any:
    """Build a named tuple of ``cls`` from ``fields`` without calling its ``__new__``."""
    return tuple.__new__(cls, fields)


def _dumps(value: Any) -> bytes:
    """Pickle ``value`` (named tuples by their fields: :class:`_Pickler`)."""
    out = io.BytesIO()
    _Pickler(out).dump(value)
    return out.getvalue()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor a message carries: a complex tensor as its real view, as ``isend`` sends it."""
    return torch.view_as_real(t) if t.is_complex() else t
