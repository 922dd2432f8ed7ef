"""Move stage values and gradients between ranks with batched point-to-point operations.

A rank holds one stage or several. A value goes from the stage that makes it to every stage
that reads it, skips included, and each reader's gradient goes straight back; nothing is
relayed through the stages between. Between two stages on one rank the value is handed
over in memory; between ranks it is one message per (sending stage, micro-batch, receiving
rank), holding the values that rank reads, in the sender's order of outputs.

A gradient the loss may not reach (``StagePlan.maybe_no_grad``: the value feeds only outputs a
loss could ignore) is followed in its message by a byte per such value saying whether it came;
one that did not is delivered as None, not zeros, so the parameters behind it keep no gradient.

Receive buffers are sized from the plan: :func:`fxpipe.passes.value_specs` gives the shape
of every crossing value for a micro-batch (on fake tensors, once per layout), and a buffer
nothing refers to any more is reused by a later message (:mod:`fxpipe.runtime.transport.buffers`).
The transport of a step kind lives across steps: what it reads off the plan and the programs
is read once, and :meth:`DistTransport.begin` starts each step. Every rank
knows every rank's program, so it posts its receives from a peer in the order that peer
sends, one message ahead of the one it waits for::

    peer q's program:  ... qSEND_F3 ... qSEND_B1 ... qSEND_F4 ...
    my receives from q, posted in that order:  F3 ─▶ B1 ─▶ F4

Messages between two ranks are therefore matched in order (as NCCL requires; gloo also
matches by tag) whatever order the receiving stages need them in, and the next message's
data moves while this one is computed on.

A send's work keeps its tensor alive until the work is dropped. Knowing the peers' programs,
a rank also knows which of its messages a peer has waited for before sending it something,
so each arrival lets the sends it acknowledges go::

    rank 0:  SEND_F0 ─────────────┐          RECV_B0 ◀──┐   (F0 arrived: its tensor goes)
    rank 1:            RECV_F0 ◀──┘ F0 B0 SEND_B0 ──────┘

Without that a rank would hold every output and gradient it sent until the step ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.microbatch import sum_grads
from fxpipe.runtime.schedules.actions import Action
from fxpipe.runtime.transport.buffers import BufferPool, dense, empty_like_spec, floating, tensor_leaves
from fxpipe.runtime.transport.comm import Comm

__all__ = ["DistTransport"]

FORWARD_TAG, BACKWARD_TAG = 1, 2
Key = tuple[int, str, int]  # (sending stage, "F" or "B", micro-batch), as an Action orders them


class DistTransport:
    """The transport of one rank: its stages' values forward and gradients backward."""

    def __init__(self, plan: PipelinePlan, rank: int, device: torch.device, comm: Comm,
                 specs: Callable[[int], dict[str, Any]], programs: Sequence[Sequence[Action]],
                 routes: tuple | None = None) -> None:
        self.plan = plan
        self.rank = rank
        self.device = device
        self.comm = comm
        self.specs = specs  # micro-batch index -> {value name: spec}
        self.pool = BufferPool(device)
        self.inputs: list[list[Any]] = []
        self.rank_of = [s.on_rank for s in plan.stages]
        self.producer = plan.producer()
        self.consumers = plan.consumers()
        self.box: dict[tuple, Any] = {}  # hand-overs: (stage, "F" | "B", value, i) -> the value for the stage reading it | its gradients for its producer
        # what each stage sends to each other rank: values forward, gradients backward
        self.fwd_to: dict[int, dict[int, list[str]]] = {}
        self.bwd_to: dict[int, dict[int, list[str]]] = {}
        for s in plan.stages:
            fwd: dict[int, list[str]] = {}
            for v in s.outputs:
                for q in dict.fromkeys(self.rank_of[c] for c in self.consumers.get(v, ())):
                    if q != s.on_rank:
                        fwd.setdefault(q, []).append(v)
            bwd: dict[int, list[str]] = {}
            for v in s.grad_inputs:
                q = self.rank_of[self.producer[v]]
                if q != s.on_rank:
                    bwd.setdefault(q, []).append(v)
            self.fwd_to[s.index], self.bwd_to[s.index] = fwd, bwd
        # gradients that may not come (the loss may not reach them), per (sending stage, rank): their
        # message ends with a byte per such value saying whether it came
        self.flagged = {s.index: {q: [v for v in names if v in s.maybe_no_grad]
                                  for q, names in self.bwd_to[s.index].items()} for s in plan.stages}
        # what the programs say: each peer's messages to this rank in its order, and what each acknowledges
        # (the same every step of the same programs: pass back ``self.routes`` to skip reading them again)
        self.routes = routes or self._read_routes(programs)
        self.queue, self.index, self.acks = self.routes
        self.begin(specs)

    def begin(self, specs: Callable[[int], dict[str, Any]], inputs: list[list[Any]] | None = None) -> None:
        """Start a step whose micro-batches' crossing values have ``specs`` (the first stage's ``inputs``)."""
        self.specs = specs
        self.inputs = inputs if inputs is not None else []
        self.box = {}
        self.pool.begin()
        self.posted = {q: 0 for q in self.queue}  # how many of each peer's messages are posted
        self.pending: dict[Key, tuple[list[Any], Callable[[], None]]] = {}
        self.arrived: set[Key] = set()
        self.sent: dict[tuple[Key, int], list[Any]] = {}  # (message, peer) -> its send works, until let go

    def _read_routes(self, programs: Sequence[Sequence[Action]]) -> tuple:
        """Return each peer's messages to this rank in its order, their index, and their acknowledgements."""
        queue: dict[int, list[Key]] = {}
        for q, program in enumerate(programs):
            if q == self.rank:
                continue
            for a in program:
                key = self._message_to(a, self.rank)
                if key is not None:
                    queue.setdefault(q, []).append(key)
        index = {key: (q, k) for q, keys in queue.items() for k, key in enumerate(keys)}
        return queue, index, self._acknowledgements(programs)

    # -- letting sent tensors go -------------------------------------------------------------
    def _acknowledgements(self, programs: Sequence[Sequence[Action]]) -> dict[Key, list[Key]]:
        """Map each message a peer sends here to this rank's messages that peer has received before.

        A send's work holds its tensor until the work is dropped. Every rank's program is
        known, so when peer ``q``'s message ``X`` arrives, this rank knows which of its own
        messages ``q`` had already waited for before sending ``X``: those have arrived, their
        sends are done, and their tensors can go (instead of living to the end of the step).
        """
        acks: dict[Key, list[Key]] = {}
        for q, program in enumerate(programs):
            if q == self.rank:
                continue
            got: list[Key] = []
            for a in program:
                if a.kind in ("RECV_F", "RECV_B"):
                    got += [k for k in self._awaited(a.kind, a.stage, a.mb, q) if self.rank_of[k[0]] == self.rank]
                elif got and self._message_to(a, self.rank) is not None:
                    acks[(a.stage, a.kind[-1], a.mb)], got = got, []
        return acks

    def _message_to(self, a: Action, q: int) -> Key | None:
        """Return the key of the message action ``a`` sends to rank ``q``, or None."""
        if a.kind == "SEND_F" and q in self.fwd_to[a.stage] or a.kind == "SEND_B" and q in self.bwd_to[a.stage]:
            return (a.stage, a.kind[-1], a.mb)
        return None

    def _awaited(self, kind: str, j: int, i: int, rank: int) -> list[Key]:
        """Return the messages rank ``rank`` waits for in its ``RECV_F`` or ``RECV_B`` of stage ``j``."""
        stage = self.plan.stages[j]
        if kind == "RECV_F":
            if j == 0:
                return []
            producers = dict.fromkeys(self.producer[v] for v in stage.inputs)
            return [(p, "F", i) for p in producers if self.rank_of[p] != rank]
        readers = {c for v in stage.outputs for c in self.consumers.get(v, ())
                   if v in self.plan.stages[c].grad_inputs}
        return [(c, "B", i) for c in sorted(readers) if self.rank_of[c] != rank]

    def _send(self, key: Key, sends: list[tuple[torch.Tensor, int, int]], what: str) -> None:
        """Post message ``key``'s sends; keep each peer's works until that peer is known to have it."""
        works = self.comm.send(sends, what)
        for (_, q, _), work in zip(sends, works):
            self.sent.setdefault((key, q), []).append(work)

    def _let_go(self, q: int, received: Key) -> None:
        """Wait for (at once: they have arrived) and drop the sends peer ``q`` got before sending ``received``."""
        for key in self.acks.get(received, ()):
            works = self.sent.pop((key, q), [])
            self.comm.wait(works, f"finishing the send of {key} to {self.comm.name(q)}", q)

    def finish(self) -> None:
        """Wait until every message this rank sent has left."""
        sent, self.sent = self.sent, {}
        for (key, q), works in sent.items():
            self.comm.wait(works, f"finishing the send of {key} to {self.comm.name(q)}", q)

    def abandon(self) -> None:
        """Drop every pending send and receive (a failed step: the runtime closes the connections)."""
        self.sent, self.pending, self.box = {}, {}, {}
        self.pool.clear()

    # -- receiving, in each peer's order ---------------------------------------------------
    def _await(self, key: Key) -> None:
        """Wait until message ``key`` arrived and is delivered to the box; post up to one more."""
        if key in self.arrived:
            return
        q, k = self.index[key]
        while self.posted[q] <= min(k + 1, len(self.queue[q]) - 1):
            self._post(self.queue[q][self.posted[q]])
            self.posted[q] += 1
        works, deliver = self.pending.pop(key)
        j, kind, i = key
        what = f"stage {j}'s {'outputs' if kind == 'F' else 'input gradients'} of micro-batch {i}"
        self.comm.wait(works, f"receiving {what} on {self.comm.name(self.rank)}", q)
        deliver()
        self.arrived.add(key)
        self._let_go(q, key)

    def _post(self, key: Key) -> None:
        """Allocate message ``key``'s receive buffers from the plan and post its receives."""
        j, kind, i = key
        specs = self.specs(i)
        names = (self.fwd_to if kind == "F" else self.bwd_to)[j][self.rank]
        built, bufs = [], []
        for v in names:
            build, tensors = empty_like_spec(specs[v], self.pool, floating_only=kind == "B")
            built.append(build)
            bufs += tensors
        flagged = self.flagged[j][self.rank] if kind == "B" else []
        if flagged:  # after the gradients: which of them came (the others are None, not zeros)
            bufs.append(torch.empty(len(flagged), dtype=torch.uint8, device=self.device))
        peer = self.rank_of[j]
        works = self.comm.post([], [(b, peer, FORWARD_TAG if kind == "F" else BACKWARD_TAG) for b in bufs],
                               f"posting the receives of stage {j}'s micro-batch {i}")

        def deliver() -> None:
            absent = {v for v, came in zip(flagged, bufs[-1].tolist()) if not came} if flagged else set()
            for v, build in zip(names, built):
                if v in absent:
                    continue
                value = build()
                if kind == "F":
                    for c in self.consumers.get(v, ()):
                        if self.rank_of[c] == self.rank:
                            self.box[(c, "F", v, i)] = value
                else:
                    self.box.setdefault((self.producer[v], "B", v, i), []).append(value)
        self.pending[key] = (works, deliver)

    # -- forward ---------------------------------------------------------------------------
    def recv_forward(self, j: int, i: int) -> list[Any]:
        """Return stage ``j``'s inputs for micro-batch ``i``, from this rank's stages and others'."""
        if j == 0:
            return self.inputs[i]
        for key in self._awaited("RECV_F", j, i, self.rank):
            self._await(key)
        return [self.box.pop((j, "F", v, i)) for v in self.plan.stages[j].inputs]

    def send_forward(self, j: int, i: int, outputs: Sequence[Any]) -> None:
        """Hand each output to this rank's stages that read it; send the rest to their ranks."""
        by_name = dict(zip(self.plan.stages[j].outputs, outputs))
        for v, value in by_name.items():
            for c in self.consumers.get(v, ()):
                if self.rank_of[c] == self.rank:
                    self.box[(c, "F", v, i)] = value
        specs = self.specs(i) if self.fwd_to[j] else {}
        sends = [(t, q, FORWARD_TAG) for q, names in self.fwd_to[j].items()
                 for v in names for t in _tensors(by_name[v], specs[v])]
        self._send((j, "F", i), sends, f"sending micro-batch {i}'s outputs of stage {j}")

    # -- backward --------------------------------------------------------------------------
    def recv_backward(self, j: int, i: int) -> list[Any]:
        """Return the summed gradient of each of stage ``j``'s outputs from every stage that read it."""
        stage = self.plan.stages[j]
        for key in self._awaited("RECV_B", j, i, self.rank):
            self._await(key)
        grads = []
        for v in stage.outputs:
            parts = self.box.pop((j, "B", v, i), [])
            grads.append(sum_grads(parts) if parts else None)
        return grads

    def send_backward(self, j: int, i: int, grads: Sequence[Any]) -> None:
        """Send the gradient of each input back to the stage that made it (in memory on this rank)."""
        stage = self.plan.stages[j]
        by_name = dict(zip(stage.inputs, grads))
        for v in stage.grad_inputs:
            if self.rank_of[self.producer[v]] == self.rank and by_name.get(v) is not None:
                self.box.setdefault((self.producer[v], "B", v, i), []).append(by_name[v])
        specs = self.specs(i)
        sends = []
        for q, names in self.bwd_to[j].items():
            for v in names:
                sends += [(t, q, BACKWARD_TAG) for t in _grad_tensors(by_name.get(v), specs[v], self.device)]
            flagged = self.flagged[j][q]
            if flagged:
                came = [any(isinstance(t, torch.Tensor) for t in tree_flatten(by_name.get(v))[0]) for v in flagged]
                sends.append((torch.tensor(came, dtype=torch.uint8, device=self.device), q, BACKWARD_TAG))
        self._send((j, "B", i), sends, f"sending micro-batch {i}'s input gradients of stage {j}")


def _tensors(value: Any, spec: Any) -> list[torch.Tensor]:
    """Return the tensors of a value in flattening order, each as its message carries it (see :func:`dense`)."""
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    specs = tensor_leaves(spec, floating_only=False)
    if len(specs) != len(tensors):  # the receiver's count differs: the message fails there, named
        return [t.resolve_conj().resolve_neg().contiguous() for t in tensors]
    return [dense(t, s) for t, s in zip(tensors, specs)]


def _grad_tensors(grad: Any, spec: Any, device: torch.device) -> list[torch.Tensor]:
    """Return one gradient tensor per floating leaf of ``spec`` (zeros where none came)."""
    spec_leaves, _ = tree_flatten(spec)
    grad_leaves = tree_flatten(grad)[0] if grad is not None else [None] * len(spec_leaves)
    if len(grad_leaves) != len(spec_leaves):
        grad_leaves = [grad] if isinstance(grad, torch.Tensor) else [None] * len(spec_leaves)
    out = []
    for s, g in zip(spec_leaves, grad_leaves):
        if floating(s):
            out.append(dense(g if isinstance(g, torch.Tensor) else torch.zeros(s.shape, dtype=s.dtype, device=device),
                             s))
    return out

