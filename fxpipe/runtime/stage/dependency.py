"""Fork and join autograd lanes with phony tensors to force an order on backward.

A phony is an empty tensor. ``fork(x)`` returns ``x`` and a phony that depend on the same
autograd node; ``join(y, phony)`` returns ``y`` made to depend on that phony. In backward,
the gradient of ``y`` must flow through the phony before ``x``'s fork node can run::

        x ──Fork──▶ x' ─── ... (micro-batch i-1, stage j's output)
              │
              └─phony──▶ Join ──▶ y' ─── stage j (micro-batch i)
                          ▲
        y ────────────────┘

so stage j's backward for micro-batch i-1 runs only after that for micro-batch i: the
reverse of the forward order, which keeps every device busy (torchgpipe, section 3.2.1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.passes.spec import differentiable, unflatten

__all__ = ["depend", "fork", "get_phony", "join"]

_phonies: dict[tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """Return a cached empty tensor on ``device``."""
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with torch.no_grad():
            phony = torch.empty(0, device=device, requires_grad=requires_grad)
        _phonies[key] = phony
    return phony


class Fork(torch.autograd.Function):
    """Return the input unchanged and a phony tied to the same backward node."""

    @staticmethod
    def forward(ctx, x: torch.Tensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # x's gradient stays None where the loss does not reach it
        phony = get_phony(x.device, requires_grad=False)
        return x.detach(), phony.detach()

    @staticmethod
    def backward(ctx, grad_x, grad_phony):  # type: ignore[override]
        return grad_x


class Join(torch.autograd.Function):
    """Return the input unchanged, now depending on a phony."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, phony: torch.Tensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an x the loss does not reach passes None back, not zeros
        return x.detach()

    @staticmethod
    def backward(ctx, grad_x):  # type: ignore[override]
        return grad_x, None


def fork(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch a phony off ``x``; without autograd the phony is a plain empty tensor."""
    if torch.is_grad_enabled() and x.requires_grad:
        return Fork.apply(x)
    return x, get_phony(x.device, requires_grad=False)


def join(x: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:
    """Make ``x`` depend on ``phony`` in backward."""
    if torch.is_grad_enabled() and (x.requires_grad or phony.requires_grad) and differentiable(x.dtype):
        return Join.apply(x, phony)
    return x


def _first_grad_leaf(leaves: list[Any], need_grad: bool) -> int | None:
    """Return the index of the first floating tensor leaf (requiring grad if asked)."""
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and differentiable(leaf.dtype) and (leaf.requires_grad or not need_grad):
            return k
    return None


def depend(before: Any, after: Any) -> tuple[Any, Any]:
    """Make ``after``'s backward finish before ``before``'s begins; return both, rewired.

    ``before`` and ``after`` are any structures of values; the first floating tensor that
    requires grad in ``before`` is forked and the phony joined into the first floating tensor
    of ``after`` that requires grad (or the first floating tensor, if none does). Without autograd, or without such tensors, both come back unchanged.
    """
    if not torch.is_grad_enabled():
        return before, after
    b_leaves, b_spec = tree_flatten(before)
    a_leaves, a_spec = tree_flatten(after)
    # Join into a tensor that already requires grad where there is one: making a mask or
    # another constant require grad can change which kernel runs (SDPA's flash path refuses
    # a mask that requires grad), and with it the layout of the result.
    kb = _first_grad_leaf(b_leaves, True)
    ka = _first_grad_leaf(a_leaves, True)
    ka = _first_grad_leaf(a_leaves, False) if ka is None else ka
    if kb is None or ka is None:
        return before, after
    b_leaves[kb], phony = fork(b_leaves[kb])
    a_leaves[ka] = join(a_leaves[ka], phony)
    return unflatten(b_spec, b_leaves), unflatten(a_spec, a_leaves)
