"""What ``fxpipe.compile`` accepts: every option in one typed object, and the checks on their values.

    fxpipe.compile(model, n, **keywords) ─▶ CompileOptions ─▶ check() ─▶ front end, plan, build

Every layer reads the options it needs from the one object, so a new option is a field here,
not a parameter threaded through five signatures. :meth:`CompileOptions.check` refuses a
value that no layer could use, before anything is traced or moved; what only a layer can
judge (a schedule's action lists, a weights source, the launched world) is checked there.
The names the options take (schedules, checkpoint modes, balance metrics) are listed here once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import CompileError, TensorParallelError
from fxpipe.torchcompile import SPLIT_BACKENDS, TorchCompile, torch_compile_config
from fxpipe.unknownargs import BY_HAND

__all__ = ["AUTO", "BALANCE_BY", "CHECKPOINT_MODES", "MULTI_STAGE_SCHEDULES", "POLICIES", "RUNTIMES", "SCHEDULES",
           "SINGLE_STAGE_SCHEDULES", "SPLIT_BACKENDS", "TRACERS", "CompileOptions", "TorchCompile", "check_checkpoint",
           "check_export_dims", "check_init", "check_tracer", "checkpoint_stop", "cut_mode", "saving_pass",
           "torch_compile_config", "valid_timeout"]

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b", "zb")  # one stage per rank
MULTI_STAGE_SCHEDULES = ("interleaved", "zbv")  # several stages per rank
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES  # every name schedule= takes
BALANCE_BY = ("auto", "flops", "params", "memory", "time")
RUNTIMES = ("local", "distributed")
TRACERS = ("fx", "export")
W_SCHEDULES = ("zb", "zbv")  # the named schedules with W steps

# How many leading micro-batches of m each mode recomputes whole (torchgpipe's three modes);
# "selective" recomputes the cheap nodes of every micro-batch instead, "offload" none (its saved
# tensors wait in host memory).
CHECKPOINT_MODES: dict[str, Callable[[int], int]] = {
    "always": lambda m: m,
    "except_last": lambda m: m - 1,  # the last micro-batch's backward comes first anyway
    "never": lambda m: 0,
    "selective": lambda m: 0,
    "offload": lambda m: 0,
}
AUTO = "auto"  # a policy per stage, chosen for max_memory=
POLICIES = ("never", "selective", "except_last", "always")  # what "auto" chooses from, least recomputation first


def checkpoint_stop(mode: str, m: int) -> int:
    """Return how many leading micro-batches of ``m`` are checkpointed under ``mode``."""
    try:
        return CHECKPOINT_MODES[mode](m)
    except KeyError:
        raise ValueError(f"checkpoint={mode!r}; use one of {', '.join(map(repr, CHECKPOINT_MODES))}") from None


def saving_pass(mode: str) -> str:
    """Return the forward pass a stage under ``mode`` runs its micro-batches in when not checkpointed."""
    return mode if mode in ("selective", "offload") else "forward"


_CUT_MODE = {"selective": "never", "offload": "always"}  # bounds the cut's estimate keeps for them
_HUNGRY = ("never", "except_last", "always")  # by the memory the cut's estimate gives them, most first


def cut_mode(checkpoint: str | Sequence[str]) -> str:
    """Return the mode whose memory the partitioner's estimate uses for ``checkpoint=``.

    A list takes its hungriest stage's (the estimate has one mode); ``"selective"`` is bounded
    by ``"never"``'s, ``"offload"`` by ``"always"``'s; ``"auto"`` cuts for ``"never"`` (the
    simulator then chooses what fits).
    """
    modes = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
    mapped = {_CUT_MODE.get(m, "never" if m == AUTO else m) for m in modes}
    return next(m for m in _HUNGRY if m in mapped)


def check_checkpoint(checkpoint: Any, n_stages: int, max_memory: Any = None) -> None:
    """Refuse a ``checkpoint=`` that is not a mode, ``"auto"`` with a budget, or one mode per stage."""
    modes = ", ".join(map(repr, CHECKPOINT_MODES))
    if isinstance(checkpoint, str):
        if checkpoint == AUTO:
            if max_memory is None:
                raise ValueError("checkpoint='auto' chooses each stage's policy to fit a memory budget; pass "
                                 "max_memory= (bytes per device), or name a mode")
            return
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={checkpoint!r}; use one of {modes}, 'auto' (with max_memory=), "
                             "or a list with one mode per stage")
        return
    if not isinstance(checkpoint, (list, tuple)):
        raise TypeError(f"checkpoint= takes a mode ({modes}), 'auto', or a list with one mode per stage; "
                        f"got {type(checkpoint).__name__}")
    if len(checkpoint) != n_stages:
        raise ValueError(f"checkpoint= lists {len(checkpoint)} modes for {n_stages} stages; give one per stage")
    for j, mode in enumerate(checkpoint):
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint[{j}]={mode!r}; each stage takes one of {modes} "
                             "('auto' chooses for all stages at once)")


def valid_timeout(value: Any) -> bool:
    """Tell whether ``value`` is a number of seconds above 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _count(value: Any) -> bool:
    """Tell whether ``value`` is an integer of at least 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


EXPORT_DIMS = ("auto", "batch")


def check_export_dims(export_dims: Any, tracer: Any) -> None:
    """Reject an ``export_dims=`` that is not a known choice, or is given to another tracer than export."""
    if export_dims not in EXPORT_DIMS:
        raise ValueError(f"export_dims={export_dims!r}; use 'auto' (dim 0 dynamic, the other dims as free as the "
                         "model allows) or 'batch' (dim 0 dynamic, the other dims the example's)")
    if export_dims != "auto" and tracer != "export":
        raise ValueError(f"export_dims={export_dims!r} sets which dims torch.export keeps dynamic, but tracer="
                         f"{tracer!r}: pass tracer='export' with it, or leave export_dims out")


def check_tracer(tracer: Any) -> None:
    """Reject a ``tracer=`` that is neither a known front end nor a callable."""
    if not (tracer in TRACERS or (callable(tracer) and not isinstance(tracer, str))):
        raise ValueError(f"tracer={tracer!r}; use 'fx', 'export', or a callable returning the "
                         "torch.fx.GraphModule of another tracer")


def check_init(init: Any, seed: Any) -> None:
    """Reject an ``init=`` that is not callable and a ``seed=`` that is not an integer."""
    if init is not None and not callable(init):
        raise TypeError(f"init= must be a function init(module) or None, got {type(init).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed= must be an integer, got {seed!r}")


@dataclass
class CompileOptions:
    """Every option of ``fxpipe.compile`` (see its docstring for what each does)."""

    n_stages: int
    example_inputs: Any = None
    example_kwargs: dict[str, Any] | None = None
    devices: Sequence[Any] | None = None
    chunks: int = 1
    checkpoint: str | Sequence[str] = "except_last"
    balance_by: str = "auto"
    split_points: Sequence[str] | None = None
    max_memory: float | None = None
    schedule: Any = "gpipe"
    leaf_modules: Iterable[type | str] = ()
    tracer: Any = "fx"
    plan: Any = None
    runtime: str = "local"
    timeout: float = 300.0
    deferred_batch_norm: bool = False
    stages_per_rank: int = 1
    data_parallel: int = 1
    data_parallel_shard: bool = False
    tensor_parallel: int = 1
    tp_plan: Any = None
    mesh: Any = None
    weights: Any = None
    init: Callable[[Any], Any] | None = None
    seed: int = 0
    split_spec: dict[str, Any] | None = None
    torch_compile: Any = False  # check() makes it a TorchCompile, or None
    save: Callable[[Any], bool] | None = None
    unbatched: Sequence[str] = ()
    export_dims: str = "auto"

    @property
    def compiled(self) -> TorchCompile | None:
        """Return what torch.compile is asked for every stage (after :meth:`check`), or None."""
        return self.torch_compile if isinstance(self.torch_compile, TorchCompile) else None

    def policies(self) -> list[str] | None:
        """Return the mode of each stage, or None under ``"auto"`` (chosen after the cut)."""
        if isinstance(self.checkpoint, str):
            return None if self.checkpoint == AUTO else [self.checkpoint] * self.n_stages
        return list(self.checkpoint)

    @property
    def args(self) -> tuple:
        """Return the example inputs as positional arguments (one input unless a tuple)."""
        x = self.example_inputs
        return x if isinstance(x, tuple) else (() if x is None else (x,))

    @property
    def kwargs(self) -> dict[str, Any]:
        """Return the example keyword inputs."""
        return dict(self.example_kwargs or {})

    @property
    def has_inputs(self) -> bool:
        """Tell whether example inputs were given (shapes for the cost model and the buffers)."""
        return self.example_inputs is not None or bool(self.example_kwargs)

    @property
    def tp(self) -> int:
        """Return the ranks each stage is split over: ``tensor_parallel``, or the ``"tp"`` dim of ``mesh=``."""
        names = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        if "tp" in names and self.tensor_parallel == 1:
            return int(self.mesh.size(names.index("tp")))
        return self.tensor_parallel if _count(self.tensor_parallel) else 1

    @property
    def dp(self) -> int:
        """Return the replicas: ``data_parallel``, or the ``"dp"`` dim of ``mesh=``."""
        names = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        if "dp" in names and self.data_parallel == 1:
            return int(self.mesh.size(names.index("dp")))
        return self.data_parallel if _count(self.data_parallel) else 1

    def layout(self) -> dict[str, Any]:
        """Return the layout a plan records: what ``fxpipe.compile(plan=)`` reproduces."""
        return {"runtime": self.runtime, "data_parallel": self.dp, "data_parallel_shard": bool(self.data_parallel_shard),
                "tensor_parallel": self.tp, "stages_per_rank": self.stages_per_rank}

    @property
    def distributed(self) -> bool:
        """Tell whether the stages run across ``torch.distributed`` ranks."""
        return self.runtime == "distributed"

    def check(self) -> None:
        """Refuse values no layer could use, naming the option and the fix (nothing is traced yet)."""
        if not _count(self.n_stages):
            raise ValueError(f"n_stages={self.n_stages!r}; use an integer of at least 1")
        if not _count(self.chunks):
            raise ValueError(f"chunks={self.chunks!r}; use an integer of at least 1 (the number of micro-batches)")
        if not valid_timeout(self.timeout):
            raise ValueError(f"timeout={self.timeout!r}; use a number of seconds above 0 (how long a rank waits "
                             "for its peers; 300 by default)")
        check_checkpoint(self.checkpoint, self.n_stages, self.max_memory)
        if self.save is not None and not callable(self.save):
            raise TypeError(f"save= must be a function save(node) -> bool telling which nodes "
                            f"checkpoint='selective' keeps, got {type(self.save).__name__}")
        modes = [self.checkpoint] if isinstance(self.checkpoint, str) else list(self.checkpoint)
        if self.save is not None and not {"selective", "auto"} & set(modes):
            warnings.warn(f"save= tells which nodes checkpoint='selective' keeps, but checkpoint={self.checkpoint!r} "
                          "has no selective stage: it is not used", stacklevel=3)
        if self.balance_by not in BALANCE_BY:
            hint = ""
            if isinstance(self.balance_by, (list, tuple)):
                hint = f"; to place the stages by hand, pass {BY_HAND}"
            raise ValueError(f"balance_by={self.balance_by!r}; use one of {', '.join(map(repr, BALANCE_BY))}{hint}")
        names = self.unbatched
        if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)) or \
                not all(isinstance(n, str) for n in names):
            raise TypeError(f"unbatched= must be a list of the forward's input names given whole to every "
                            f"micro-batch, got {names!r}")
        points = self.split_points
        if points is not None and (isinstance(points, str) or not all(isinstance(p, str) for p in points)):
            raise TypeError(f"split_points must be a list of module or node names, got {points!r}")
        if self.max_memory is not None:
            if isinstance(self.max_memory, bool) or not isinstance(self.max_memory, (int, float)):
                raise TypeError(f"max_memory must be a number of bytes per device, got {self.max_memory!r}")
            if not self.max_memory > 0:
                raise ValueError(f"max_memory={self.max_memory!r}; use a positive number of bytes per device")
        check_tracer(self.tracer)
        check_export_dims(self.export_dims, self.tracer)
        check_init(self.init, self.seed)
        self.torch_compile = torch_compile_config(self.torch_compile)
        config = self.compiled
        if config is not None and self.tp > 1:
            raise CompileError(f"torch_compile= with tensor_parallel={self.tp}: fxpipe does not compile stages "
                               "split over DTensor shards yet (their compiled backward does not yet reduce the "
                               "sharded regions' gradients as the eager one does); run tensor-parallel stages "
                               "eagerly (leave torch_compile= out), or compile with tensor_parallel=1")
        if config is not None and "selective" in (self.policies() or []):
            raise CompileError("checkpoint='selective' marks every value a stage makes, which breaks a compiled "
                               "stage's graph at each node; with torch_compile= recompute whole stages "
                               "('always' or 'except_last', replayed inside the compiled graphs), or let "
                               "checkpoint='auto' choose among those")
        if config is not None and not config.splits_backward and self.schedule in W_SCHEDULES:
            raise CompileError(f"schedule={self.schedule!r} splits each backward into I and W, which fxpipe does with "
                               f"compiled stages for the backends {', '.join(map(repr, SPLIT_BACKENDS))}, not "
                               f"{config.name!r}; use one of them, or a schedule without W ('1f1b')")

    def check_layout(self) -> None:
        """Refuse a runtime, replicas or a saved plan that do not go together (after the world's size)."""
        if self.plan is not None and self.split_points is not None:
            raise ValueError("pass either plan= (a saved stage assignment) or split_points=, not both")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r}; use 'local' (one process) or 'distributed' "
                             "(one stage per rank)")
        replicated = self.data_parallel != 1 or self.mesh is not None or self.data_parallel_shard
        if replicated and not self.distributed:
            raise ValueError("data_parallel=, mesh= and data_parallel_shard= replicate the pipeline over processes; "
                             "use runtime='distributed' (launched with torchrun)")
        if not _count(self.data_parallel):
            hint = (" (True is not a count: the replicas are world size / (n_stages / stages_per_rank) / "
                    "tensor_parallel, e.g. data_parallel=2 for 2 stages on 4 ranks)"
                    if isinstance(self.data_parallel, bool) else "")
            raise ValueError(f"data_parallel={self.data_parallel!r}; use an integer of at least 1 (the replicas)"
                             + hint)
        if self.distributed and not self.has_inputs:
            raise ValueError("runtime='distributed' needs example_inputs= (the same on every rank) to "
                             "size the buffers it receives into")
        self.check_tensor_parallel()

    def check_tensor_parallel(self) -> None:
        """Refuse a tensor-parallel size or plan that cannot work with the other options."""
        t = self.tensor_parallel
        if not _count(t):
            raise ValueError(f"tensor_parallel={t!r}; use an integer of at least 1 (the ranks each stage is "
                             "split over)")
        plan = self.tp_plan
        if plan is not None and plan != "auto" and not (isinstance(plan, dict) and all(isinstance(k, str)
                                                                                      for k in plan)):
            raise TypeError(f"tp_plan must be 'auto' or a dict of module FQN patterns to parallel styles "
                            f"(ColwiseParallel(), RowwiseParallel(), ...), got {type(plan).__name__}")
        if t > 1 and isinstance(plan, dict) and not plan:
            raise TensorParallelError(f"tp_plan={{}} splits nothing: with tensor_parallel={t} every rank of a stage would hold "
                             "and compute all of it (a model's _tp_plan is empty where the model has none); pass "
                             "tp_plan='auto' (the default) or a dict naming the modules to split")
        if t > 1 and not self.distributed:  # tp_plan= with one rank per stage is a no-op
            raise ValueError(f"tensor_parallel={t} splits each stage's layers over {t} ranks; use "
                             "runtime='distributed' (launched with torchrun; world = data_parallel x "
                             "n_stages / stages_per_rank x tensor_parallel)")

