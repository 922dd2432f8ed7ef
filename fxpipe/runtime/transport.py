"""Move stage values and gradients between ranks with batched point-to-point operations.

Receive buffers are sized from the plan: :func:`fxpipe.passes.value_specs` gives the shape of every
crossing value for a micro-batch of ``b`` rows (on fake tensors, once per size). A value goes
from the rank that makes it to every rank that reads it, skips included, and each reader
sends its gradient straight back; nothing is relayed through the ranks between. Messages
between two ranks keep the order of the producer's outputs, so both sides agree on it.

Every schedule receives micro-batches in order, forwards and backwards alike, so when a
receive is taken the next micro-batch's is posted: its data moves while this one computes,
instead of after the rank asks for it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.runtime.comm import Comm
from fxpipe.plan import PipelinePlan
from fxpipe.passes import TensorSpec

__all__ = ["DistTransport"]

FORWARD_TAG, BACKWARD_TAG = 1, 2


class DistTransport:
    """The transport of one rank (stage ``rank``): values forward, gradients backward."""

    def __init__(self, plan: PipelinePlan, rank: int, device: torch.device, comm: Comm,
                 specs: Callable[[int], dict[str, Any]]) -> None:
        self.plan = plan
        self.rank = rank
        self.device = device
        self.comm = comm
        self.specs = specs  # micro-batch index -> {value name: spec}
        self.inputs: list[list[Any]] = []
        self.m = 0  # micro-batches in this step: receives are posted up to m - 1
        self._posted: dict[tuple[str, int], tuple[list[Any], Callable[[], list[Any]]]] = {}
        stage = plan.stages[rank]
        producer = plan.producer()
        self.from_rank: dict[int, list[str]] = {}  # producer -> my inputs it sends, in its order
        for p in sorted({producer[v] for v in stage.inputs}) if rank else []:
            self.from_rank[p] = [v for v in plan.stages[p].outputs if v in stage.inputs]
        self.to_rank: dict[int, list[str]] = {}  # consumer -> my outputs it reads, in my order
        for c in plan.stages[rank + 1:]:
            values = [v for v in stage.outputs if v in c.inputs]
            if values:
                self.to_rank[c.index] = values
        self.grad_to: dict[int, list[str]] = {p: [v for v in vs if v in stage.grad_inputs]
                                              for p, vs in self.from_rank.items()}
        self.grad_from: dict[int, list[str]] = {c: [v for v in vs if v in plan.stages[c].grad_inputs]
                                                for c, vs in self.to_rank.items()}

    # -- receiving, one micro-batch ahead ------------------------------------------------
    def _take(self, kind: str, j: int, i: int) -> list[Any]:
        """Wait for micro-batch ``i``'s ``kind`` receives (posting them if needed); post ``i + 1``'s."""
        if (kind, i) not in self._posted:
            self._post(kind, i)
        if i + 1 < self.m and (kind, i + 1) not in self._posted:
            self._post(kind, i + 1)
        works, finish = self._posted.pop((kind, i))
        what = "inputs" if kind == "F" else "gradients"
        self.comm.wait(works, f"receiving micro-batch {i}'s {what} of stage {j}")
        return finish()

    def _post(self, kind: str, i: int) -> None:
        """Allocate micro-batch ``i``'s receive buffers from the plan and post the receives."""
        specs = self.specs(i)
        recvs: list[tuple[torch.Tensor, int, int]] = []
        built: dict[str, list[Callable[[], Any]]] = {}
        senders = self.from_rank if kind == "F" else self.grad_from
        for peer, names in senders.items():
            for v in names:
                build, bufs = _empty_like_spec(specs[v], self.device, floating_only=kind == "B")
                built.setdefault(v, []).append(build)
                recvs += [(b, peer, FORWARD_TAG if kind == "F" else BACKWARD_TAG) for b in bufs]
        works = self.comm.post([], recvs, f"posting micro-batch {i}'s receives")
        stage = self.plan.stages[self.rank]

        def finish() -> list[Any]:
            if kind == "F":
                return [built[v][0]() for v in stage.inputs]
            return [_sum([b() for b in built[v]]) if v in built else None for v in stage.outputs]
        self._posted[(kind, i)] = (works, finish)

    # -- forward -------------------------------------------------------------------------
    def recv_forward(self, j: int, i: int) -> list[Any]:
        """Receive this stage's inputs for micro-batch ``i`` from the ranks that make them."""
        if j == 0:
            return self.inputs[i]
        return self._take("F", j, i)

    def send_forward(self, j: int, i: int, outputs: Sequence[Any]) -> None:
        """Send each output to every rank that reads it (after the last stage: nothing)."""
        if not self.to_rank:
            return
        by_name = dict(zip(self.plan.stages[j].outputs, outputs))
        sends = [(t, c, FORWARD_TAG) for c, names in self.to_rank.items()
                 for v in names for t in _tensors(by_name[v], floating_only=False)]
        self.comm.exchange(sends, [], f"sending micro-batch {i}'s outputs of stage {j}")

    # -- backward ------------------------------------------------------------------------
    def recv_backward(self, j: int, i: int) -> list[Any]:
        """Receive and sum the gradient of each output from every rank that read it."""
        return self._take("B", j, i)

    def send_backward(self, j: int, i: int, grads: Sequence[Any]) -> None:
        """Send the gradient of each input back to the rank that made it."""
        by_name = dict(zip(self.plan.stages[j].inputs, grads))
        specs = self.specs(i)
        sends = []
        for p, names in self.grad_to.items():
            for v in names:
                sends += [(t, p, BACKWARD_TAG) for t in _grad_tensors(by_name[v], specs[v], self.device)]
        self.comm.exchange(sends, [], f"sending micro-batch {i}'s input gradients of stage {j}")


def _floating(spec: Any) -> bool:
    """Tell whether a spec leaf is a floating tensor (one that carries a gradient)."""
    return isinstance(spec, TensorSpec) and spec.dtype.is_floating_point


def _empty_like_spec(spec: Any, device: torch.device, floating_only: bool):
    """Allocate receive buffers for a value's tensors; return (build value, buffers)."""
    leaves, tree = tree_flatten(spec)
    bufs, filled = [], []
    for leaf in leaves:
        if isinstance(leaf, TensorSpec) and (_floating(leaf) or not floating_only):
            buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            bufs.append(buf)
            filled.append(buf)
        else:
            filled.append(None if floating_only else leaf)
    return (lambda: tree_unflatten(filled, tree)), bufs


def _tensors(value: Any, floating_only: bool) -> list[torch.Tensor]:
    """Return the (contiguous) tensors of a value in flattening order."""
    leaves, _ = tree_flatten(value)
    return [t.contiguous() for t in leaves if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or not floating_only)]


def _grad_tensors(grad: Any, spec: Any, device: torch.device) -> list[torch.Tensor]:
    """Return one gradient tensor per floating leaf of ``spec`` (zeros where none came)."""
    spec_leaves, _ = tree_flatten(spec)
    grad_leaves = tree_flatten(grad)[0] if grad is not None else [None] * len(spec_leaves)
    if len(grad_leaves) != len(spec_leaves):
        grad_leaves = [grad] if isinstance(grad, torch.Tensor) else [None] * len(spec_leaves)
    out = []
    for s, g in zip(spec_leaves, grad_leaves):
        if _floating(s):
            out.append(g.contiguous() if isinstance(g, torch.Tensor)
                       else torch.zeros(s.shape, dtype=s.dtype, device=device))
    return out


def _sum(values: list[Any]) -> Any:
    """Sum gradients leaf by leaf (None leaves stay None)."""
    if len(values) == 1:
        return values[0]
    flat = [tree_flatten(v) for v in values]
    leaves = [sum(col[1:], col[0]) if col[0] is not None else None
              for col in zip(*[f[0] for f in flat])]
    return tree_unflatten(leaves, flat[0][1])
