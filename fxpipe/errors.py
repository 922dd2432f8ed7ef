"""Errors fxpipe raises for input it cannot pipeline, each naming the cause and the fix."""

from __future__ import annotations

import os
import sys

import torch

from fxpipe import passes
from fxpipe.passes.cut import NoFeasibleCut
from fxpipe.passes.failure import PropagationError
from fxpipe.passes.tpauto import TensorParallelError

__all__ = [
    "CheckpointError",
    "CompileError",
    "DeferredInitError",
    "GraphMismatchError",
    "MemoryBudgetError",
    "MutationError",
    "NoFeasibleCut",
    "OptionMismatchError",
    "PeerFailure",
    "PipelineInputError",
    "PlanMismatchError",
    "PropagationError",
    "RecomputationError",
    "ScheduleError",
    "SearchSpaceError",
    "TensorParallelError",
    "TraceError",
    "WeightsError",
]


class TraceError(TypeError):
    """A model could not be traced by torch.fx; names the module and source line."""

    def __init__(self, message: str, *, module: str | None = None, filename: str | None = None,
                 lineno: int | None = None) -> None:
        if "torch.distributions" in message or f"{os.sep}distributions{os.sep}" in (filename or ""):
            message += _DISTRIBUTIONS
        super().__init__(message)
        self.module = module
        self.filename = filename
        self.lineno = lineno


_DISTRIBUTIONS = (
    "\nA torch.distributions object (Normal, Categorical, ...) is neither traced nor split into micro-batches: "
    "a pipe's inputs and outputs are tensors and containers of them. Return the distribution's parameters "
    "(loc, scale; logits) and build it in loss_fn: loss_fn=lambda out, y: -Normal(*out).log_prob(y).mean(). "
    "Where the model itself samples from it (an actor feeding its critics), build it with validate_args=False "
    "under tracer='export' (its argument checks branch on values), or keep the sampling module whole under "
    "tracer='fx' (leaf_modules=[ThatModule])")


def with_distributions_hint(err: TraceError, cause: BaseException) -> TraceError:
    """Return ``err`` with the torch.distributions hint added where ``cause`` was raised inside torch.distributions."""
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    inside = any(f"{os.sep}distributions{os.sep}" in f for f in frames)
    if inside and err.args and isinstance(err.args[0], str) and _DISTRIBUTIONS not in err.args[0]:
        err.args = (err.args[0] + _DISTRIBUTIONS, *err.args[1:])
    return err


class PlanMismatchError(ValueError):
    """A saved plan does not match the model's graph; says what differs."""


class GraphMismatchError(ValueError):
    """Ranks traced different graphs of one model; names the first differing node and the fix."""


class OptionMismatchError(ValueError):
    """Ranks of one pipeline were compiled with different options (schedule, chunks, ...); names the first."""


class PipelineInputError(ValueError):
    """A runtime input does not fit the pipeline (batch sizes, shapes); names the argument."""


class PeerFailure(RuntimeError):
    """Another rank of a distributed pipeline failed, died or fell silent past the timeout."""


class ModelChangedError(ValueError):
    """The model was changed after compile in a way the pipe cannot follow (a tie the traced graph reads as
    one tensor, undone); names the tensors and the fix."""


class MutationError(ValueError):
    """An in-place op changes a value that another stage reads afterwards; names the node and the fix."""


class ScheduleError(ValueError):
    """A schedule given as actions is incomplete or can never finish; names the first bad action."""


class WeightsError(ValueError):
    """Weights or init cannot fill a model's tensors (missing FQN, shape, dtype, no init); names the fix."""


class DeferredInitError(WeightsError):
    """Building under ``fxpipe.deferred_init()`` needed a tensor's values, or recorded what cannot replay."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded here (half-written, another model, another optimizer); says why."""


class RecomputationError(ValueError):
    """A backward that recomputation cannot serve (``torch.autograd.grad``, ``backward(inputs=)``,
    ``create_graph=True``, a stage writing its own input in place); names the stage and the fix."""


class CompileError(ValueError):
    """``torch.compile`` cannot compile a stage as asked (a backend that does not load, a graph break under
    ``fullgraph=True``, a backend that fails); names the stage, the node and the fix."""


class SearchSpaceError(ValueError):
    """The planner's options leave no layout to try (stage or chunk counts, tensor-parallel sizes the model
    or the GPUs cannot take); names the option and what would be searched."""


class MemoryBudgetError(ValueError):
    """No policy per stage fits ``max_memory``: says which stage overflows, by how much, and what would fit."""


_INSIDE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], passes, torch)
                if m.__file__)


def user_stacklevel() -> int:
    """Return the ``stacklevel`` that points a warning raised by the caller at the user's line (outside fxpipe and torch)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level
