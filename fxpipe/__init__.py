"""fxpipe: pipeline parallelism for any PyTorch model.

``fxpipe.compile(model, n_stages)`` traces the model with torch.fx (or torch.export), cuts the
graph into balanced stages, routes every value that skips stages straight from its producer to
its consumers, and runs the stages over micro-batches: GPipe's generated program for
``pipe(x)``, and GPipe, 1F1B, zero bubble, interleaved 1F1B, ZB-V or your own action lists for
``pipe.step``, in one process or across ``torch.distributed`` ranks.

This package re-exports the public API; the layers under it, from the bottom: ``passes``,
``errors``/``options``, ``frontend``, ``plan``, ``runtime.schedules``/``runtime.observe``,
``materialize``/``simulate``, ``runtime``, ``pipe``, ``checkpoint``/``training``, ``compiler``,
``tools``/``compat``, ``testing`` (each package's docstring says what it reads and produces).
"""

from fxpipe import testing
from fxpipe.checkpoint.directory import latest as latest_checkpoint
from fxpipe.checkpoint.saveload import load, load_state_dict, save
from fxpipe.compiler import compile
from fxpipe.errors import (
                           CheckpointError,
                           CompileError,
                           DeferredInitError,
                           GraphMismatchError,
                           MemoryBudgetError,
                           ModelChangedError,
                           MutationError,
                           NoFeasibleCut,
                           OptionMismatchError,
                           PeerFailure,
                           PipelineInputError,
                           PlanMismatchError,
                           PropagationError,
                           RecomputationError,
                           ScheduleError,
                           SearchSpaceError,
                           TensorParallelError,
                           TraceError,
                           WeightsError,
)
from fxpipe.frontend.tracing import trace
from fxpipe.materialize.deferred import deferred_init
from fxpipe.materialize.fill import materialize
from fxpipe.pipe import Pipe
from fxpipe.plan.pipeline import PipelinePlan, SkipRoute, StagePlan
from fxpipe.runtime.observe.timeline import Timeline, timeline
from fxpipe.runtime.stage.recompute import is_checkpointing, is_recomputing
from fxpipe.runtime.transport.procgroup import init_distributed
from fxpipe.simulate.simulation import Simulation, simulate
from fxpipe.training import clip_grad_norm_, data_shard, grad_scaler

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompileError",
    "DeferredInitError",
    "GraphMismatchError",
    "MemoryBudgetError",
    "ModelChangedError",
    "MutationError",
    "NoFeasibleCut",
    "OptionMismatchError",
    "PeerFailure",
    "Pipe",
    "PipelineInputError",
    "PipelinePlan",
    "PlanMismatchError",
    "PropagationError",
    "RecomputationError",
    "ScheduleError",
    "SearchSpaceError",
    "Simulation",
    "SkipRoute",
    "StagePlan",
    "TensorParallelError",
    "Timeline",
    "TraceError",
    "WeightsError",
    "clip_grad_norm_",
    "compile",
    "data_shard",
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
