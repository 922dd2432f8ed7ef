"""fxpipe: pipeline parallelism for any PyTorch model.

``fxpipe.compile(model, n_stages)`` traces the model with torch.fx, cuts the graph into
balanced stages, routes every value that skips stages straight from its producer to its
consumers, and runs the stages over micro-batches with a generated GPipe executor.
"""

from fxpipe.runtime.checkpoint import is_checkpointing, is_recomputing
from fxpipe.errors import (MutationError, NoFeasibleCut, PeerFailure, PipelineInputError,
                           PlanMismatchError, ScheduleError, TraceError)
from fxpipe.compiler import compile
from fxpipe.pipe import Pipe
from fxpipe.plan import PipelinePlan, SkipRoute, StagePlan
from fxpipe.simulate import Simulation, simulate
from fxpipe.tools.recorder import Timeline, timeline
from fxpipe.tracing import trace

from fxpipe import testing  # noqa: E402 - `import fxpipe` then `fxpipe.testing.assert_...` works

__version__ = "0.1.0"

__all__ = [
    "MutationError",
    "NoFeasibleCut",
    "PeerFailure",
    "Pipe",
    "PipelineInputError",
    "PipelinePlan",
    "PlanMismatchError",
    "ScheduleError",
    "Simulation",
    "SkipRoute",
    "StagePlan",
    "Timeline",
    "TraceError",
    "compile",
    "is_checkpointing",
    "is_recomputing",
    "simulate",
    "testing",
    "timeline",
    "trace",
]
