"""Refuse a torch.fx trace that wrote the model's parameters or buffers in place while tracing.

Reads:  the model's parameters and buffers, by their version counters (bumped by every
        in-place write), before and after the trace.
Writes: nothing; raises :class:`~fxpipe.errors.TraceError` naming what was written.

torch.fx records what the forward does to the values it traces: an attribute the forward reads
(``self.target[0].weight``) is one. ``module.parameters()`` and ``module.buffers()`` return the
real tensors, so a loop over them runs while tracing, once, on the model's weights, and is not
in the graph: a momentum encoder's update (BYOL's, MoCo's
``for pt, po in zip(target.parameters(), online.parameters()): pt.mul_(m).add_(po, alpha=1 - m)``)
moved the target network once at compile and never again in training.
"""

from __future__ import annotations

import torch
from torch import nn

from fxpipe.errors import TraceError

__all__ = ["named_state", "refuse_writes_while_tracing", "state_versions"]


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return ``model``'s parameters and buffers by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def state_versions(model: nn.Module) -> dict[str, int]:
    """Return the version counter of each real parameter and buffer of ``model``, by name."""
    return {name: t._version for name, t in named_state(model).items() if not t.is_meta}


def refuse_writes_while_tracing(model: nn.Module, before: dict[str, int]) -> None:
    """Raise if tracing ``model`` wrote a parameter or buffer in place since ``before`` was taken."""
    written = [name for name, v in state_versions(model).items() if name in before and v != before[name]]
    if not written:
        return
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    raise TraceError(
        f"tracing {type(model).__name__} with torch.fx wrote {shown} in place: the forward writes tensors torch.fx "
        "does not trace (a loop over module.parameters() or module.buffers(), as a momentum encoder's update "
        "pt.mul_(m).add_(po, alpha=1 - m) is), so the write ran once now, on the model's own weights, and the "
        "pipe would never run it again. Use tracer='export', which records the update, or reach the tensors "
        "as attributes (self.target[0].weight), or make the update in the training loop after "
        "optimizer.step(). The model's weights were changed once by this trace: build or load them again")
