"""``DeferredBatchNorm``: batch norm whose running statistics are updated once per ``chunks`` calls.

torchgpipe's stand-alone module for code that converts its batch norms itself. It normalizes
each micro-batch by that micro-batch's statistics, as batch norm does, but only accumulates
them (fxpipe's deferred batch norm, :mod:`fxpipe.runtime.stage.batchnorm`); after ``chunks``
training calls (recomputations for checkpointing do not count) it updates the running mean
and variance once, from all the rows seen, as one call on the whole mini-batch would.

``GPipe(..., deferred_batch_norm=True)`` does not need this class: fxpipe defers the
model's own batch norms and commits them after each mini-batch, whatever the number of
micro-batches it was split into.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.runtime.stage.batchnorm import commit_batch_norm, defer_batch_norm
from fxpipe.runtime.stage.recompute import is_recomputing

__all__ = ["DeferredBatchNorm"]


def _count(bn: DeferredBatchNorm, inputs: Any, output: Any) -> None:
    """Commit the running statistics once every ``bn.chunks`` training calls."""
    if bn.training and not is_recomputing():
        bn.tracked += 1
        if bn.tracked >= bn.chunks:
            commit_batch_norm([bn])
            bn.tracked = 0


class DeferredBatchNorm(_BatchNorm):
    """Batch norm over any input with channels in dim 1, its running statistics updated per ``chunks`` calls."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        self.tracked = 0
        # torchgpipe's state-dict keys: it accumulates there; fxpipe accumulates in the deferral, so they
        # stay zero between mini-batches (as torchgpipe's are after each commit) and load either way
        self.register_buffer("sum", torch.zeros(num_features))
        self.register_buffer("sum_squares", torch.zeros(num_features))
        defer_batch_norm([self])
        vars(self)["_fxpipe_always"] = True  # deferred wherever it runs, as torchgpipe's module is
        self.register_forward_hook(_count)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """Accept any input with a batch and a channel dimension."""
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Return ``module`` with every batch norm that tracks running statistics made deferred.

        A batch norm is replaced by a :class:`DeferredBatchNorm` sharing its parameters and
        buffers (a :class:`DeferredBatchNorm` with another ``chunks`` too); other modules are
        kept, with their children converted in place.
        """
        if isinstance(module, cls) and module.chunks == chunks:
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine, chunks)
            for name in ("weight", "bias"):
                if module.affine:
                    setattr(deferred, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                deferred.register_buffer(name, getattr(module, name))
            deferred.train(module.training)
            return deferred
        for name, child in list(module.named_children()):
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
