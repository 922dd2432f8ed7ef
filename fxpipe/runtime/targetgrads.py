"""A target that requires grad (a teacher's logits computed with grad on) gives its graph its gradient.

Micro-batch losses run one backward each; a target's rows that still belong to the user's graph
would free it at the first. Each micro-batch's loss reads a detached leaf of its rows instead,
and after the step their gradients go back into the target's graph in the one backward that
gives the model inputs theirs (:meth:`fxpipe.runtime.stage.worker.StageWorker.released`)::

    teacher(x) ─▶ target ─┬─ rows of mb 0 ─▶ detach ─▶ leaf 0 ─▶ loss 0 ─▶ B ─▶ leaf 0 .grad ─┐
                          └─ rows of mb 1 ─▶ detach ─▶ leaf 1 ─▶ loss 1 ─▶ B ─▶ leaf 1 .grad ─┤
                          after the step: backward([rows of mb 0, rows of mb 1], [grads]) ◀──┘
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Losses", "TargetGrads"]


class TargetGrads:
    """The target's rows each micro-batch's loss read, with the leaves it read them through."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def detach(self, value: Any) -> Any:
        """Return ``value`` with each tensor that requires grad replaced by a leaf that does (remembered)."""
        flat, spec = tree_flatten(value)
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return value
        leaves = []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = t.detach().requires_grad_(True)
                self.pairs.append((t, leaf))
                t = leaf
            leaves.append(t)
        return spec.unflatten(leaves)

    def released(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return (and forget) the target's rows with their gradients, for the step's one backward into the user's graph.

        One backward with the model inputs' (:meth:`StageWorker.released`): an input and a target
        may share a graph (``h = enc(x); pipe.step(h, target=head(h))``), which a first backward frees.
        """
        pairs, self.pairs = [(t, leaf.grad) for t, leaf in self.pairs if leaf.grad is not None], []
        return pairs


class Losses(dict):
    """Each micro-batch's loss function, by index; :meth:`released` gives the target's share of the last backward."""

    def __init__(self, target_grads: TargetGrads) -> None:
        super().__init__()
        self.target_grads = target_grads

    def released(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return the target's rows with their gradients (see :meth:`TargetGrads.released`)."""
        return self.target_grads.released()
