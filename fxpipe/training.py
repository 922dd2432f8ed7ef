"""What a training loop needs around ``pipe.step``: a global gradient norm, and loss scaling that agrees.

Across ranks each process holds only some parameters, so a gradient norm computed per
process (``torch.nn.utils.clip_grad_norm_`` on its own parameters) clips every stage by a
different factor. :func:`clip_grad_norm_` computes the norm over all stages, replicas'
shards and tied parameters (counted once), equal to ``clip_grad_norm_`` on the whole
unpipelined model, and clips every rank by it. :func:`grad_scaler` returns a gradient
scaler whose inf/NaN check agrees across all ranks, so every rank skips the same steps.
:func:`data_shard` says which share of the data this rank's replica reads: every rank of one
pipeline reads the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpipe.pipe import Pipe
from fxpipe.runtime.contract import Runtime
from fxpipe.runtime.transport.together import together

__all__ = ["clip_grad_norm_", "data_shard", "grad_scaler"]


def _runtime(pipe: Any, what: str, instead: str) -> Runtime:
    """Return a compiled pipe's runtime; refuse anything else, naming the plain-PyTorch call."""
    if not isinstance(pipe, Pipe):
        raise TypeError(f"fxpipe.{what} takes the Pipe that fxpipe.compile returned, got {type(pipe).__name__}; "
                        f"for a model that is not pipelined use {instead}")
    return pipe.runtime


def clip_grad_norm_(pipe: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of every stage by their total norm over the whole model; return the norm.

    The norm equals ``torch.nn.utils.clip_grad_norm_`` on the unpipelined model's
    parameters, and every rank gets it (and clips by it). Call it on every rank, after the
    step's gradients are complete (outside ``pipe.no_sync()``). ``foreach`` is torch's
    (accepted so that a ported call runs; the result is the same either way).
    """
    runtime = _runtime(pipe, "clip_grad_norm_", "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
    params = [p for p in pipe.parameters() if p.grad is not None]
    if not runtime.place().distributed:  # one process holds everything
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    runtime.ready()  # after a failed step: every rank back on fresh connections
    norm_type = float(norm_type)
    with together("fxpipe.clip_grad_norm_", runtime.place().rank, runtime.broke):
        total = runtime.grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
                           "so they cannot be clipped; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for p in runtime.held(params):  # each rank clips its own stages' gradients (its shards' under FSDP2)
        grad = p.grad
        assert grad is not None  # params holds only parameters with gradients
        part = grad.to_local() if hasattr(grad, "to_local") else grad
        part.mul_(coef.to(part.device))
    return total


def grad_scaler(pipe: Any, **kwargs: Any) -> Any:
    """Return a gradient scaler for ``pipe``'s device whose inf/NaN check agrees across all ranks.

    In one process: ``torch.amp.GradScaler``. Across ranks: FSDP's ``ShardedGradScaler``,
    whose ``unscale_`` all-reduces what each rank found, so a step skipped on one rank is
    skipped on all and their scales stay equal. Pass it to ``pipe.step(..., scaler=)``.
    """
    runtime = _runtime(pipe, "grad_scaler", "torch.amp.GradScaler()")
    device = str(next((d.type for d in pipe.devices if d.type != "meta"), "cpu"))
    return runtime.grad_scaler(device, **kwargs)


def data_shard(pipe: Any) -> tuple[int, int]:
    """Return ``(replicas, this rank's replica)``: ``DistributedSampler(dataset, *fxpipe.data_shard(pipe))``.

    The ranks of one pipeline train on one batch (the first stage's inputs, the last stage's
    target), so data is sharded over the replicas (``data_parallel``), not over every rank as a
    ``DistributedSampler`` does by default. In one process, and without replicas: ``(1, 0)``.
    """
    runtime = _runtime(pipe, "data_shard", "DistributedSampler(dataset)")
    layout = getattr(runtime, "layout", None)
    return (1, 0) if layout is None else (int(layout.dp), int(layout.replica))
