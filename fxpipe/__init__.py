"""fxpipe: pipeline parallelism for any PyTorch model.

``fxpipe.compile(model, n_stages)`` traces the model with torch.fx, cuts the graph into
balanced stages, routes every value that skips stages straight from its producer to its
consumers, and runs the stages over micro-batches with a generated GPipe executor.
"""

from fxpipe import testing
from fxpipe.checkpointing import load, load_state_dict, save
from fxpipe.ckptdir import latest as latest_checkpoint
from fxpipe.compiler import compile
from fxpipe.deferred import deferred_init
from fxpipe.errors import (
                           CheckpointError,
                           DeferredInitError,
                           MutationError,
                           NoFeasibleCut,
                           PeerFailure,
                           PipelineInputError,
                           PlanMismatchError,
                           PropagationError,
                           ScheduleError,
                           TraceError,
                           WeightsError,
)
from fxpipe.materialize import materialize
from fxpipe.pipe import Pipe
from fxpipe.plan import PipelinePlan, SkipRoute, StagePlan
from fxpipe.runtime.checkpoint import is_checkpointing, is_recomputing
from fxpipe.runtime.procgroup import init_distributed
from fxpipe.simulate import Simulation, simulate
from fxpipe.tools.recorder import Timeline, timeline
from fxpipe.tracing import trace
from fxpipe.training import clip_grad_norm_, grad_scaler

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DeferredInitError",
    "MutationError",
    "NoFeasibleCut",
    "PeerFailure",
    "Pipe",
    "PipelineInputError",
    "PipelinePlan",
    "PlanMismatchError",
    "PropagationError",
    "ScheduleError",
    "Simulation",
    "SkipRoute",
    "StagePlan",
    "Timeline",
    "TraceError",
    "WeightsError",
    "clip_grad_norm_",
    "compile",
    "deferred_init",
    "grad_scaler",
    "init_distributed",
    "is_checkpointing",
    "is_recomputing",
    "latest_checkpoint",
    "load",
    "load_state_dict",
    "materialize",
    "save",
    "simulate",
    "testing",
    "timeline",
    "trace",
]
