"""A stage under ``torch.compile``: compiled once per stage, at most once more for new batch sizes, counted and logged.

``fxpipe.compile(..., torch_compile=True | {...})`` makes every stage call go through a
:class:`CompiledStage` (the :class:`~fxpipe.runtime.stage.stagecall.StageCall`'s function), in
every pass of every schedule::

    StageCall.run ─▶ CompiledStage(*inputs) ─▶ torch.compile(stage module) ─▶ compiled graph(s)
                      │ dim 0: static first, dynamic from a second size (unless dynamic= is given)
                      │ counts the graphs dynamo compiles, logs the first compile's cost once
                      └ names the node of a graph break (fullgraph=True: a CompileError)

A stage whose schedule has ``W`` steps compiles with its backward split into ``I`` and ``W``
(:mod:`fxpipe.runtime.stage.aotsplit`); while :meth:`CompiledStage.deferring` is active, its
backward queues the ``W`` work in the given store, which the stage's ``W`` step runs
(:func:`fxpipe.runtime.stage.wgrad.run`).

Shapes (``dynamic=None``, the default): a stage that never recomputes runs one graph, compiled
for static shapes at the first micro-batch size; a second size makes torch.compile compile it
again with dim 0 dynamic (its automatic dynamic shapes), and every later size reuses that
graph. Static kernels are faster (on the CPU benchmark 0.985x against 1.10x ``torch.compile``
of the model with dim 0 dynamic). A stage that recomputes runs two graphs, so there dim 0 of
each input is marked dynamic from the first call, and so is each input that is a Python int
(a batch size the stage before passes on, as exported Hugging Face models do): each graph
compiles once.

Recomputation replays the stage's random numbers as in eager: the RNG state is restored
around the call, and the compiled graphs draw from it as eager ops would (inductor draws its
seeds from the global generator). The checkpointed forward (no grad) and the recomputation
(grad) run two graphs of the stage: one compile more than without checkpointing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_map

from fxpipe.errors import CompileError
from fxpipe.options import TorchCompile
from fxpipe.runtime.observe.blame import call_wrapper_code, describe_node, node_in_stack
from fxpipe.runtime.stage.aotsplit import stage_backend
from fxpipe.runtime.stage.batchnorm import staging, unstaged
from fxpipe.runtime.stage.recompute import is_recomputing

__all__ = ["CompiledStage"]

log = logging.getLogger(__name__)

_FLAGS = os.path.join("fxpipe", "runtime", "stage", "recompute.py")  # where the pass flags are read


class CompiledStage:
    """Stage ``index``'s callable under torch.compile, with its compile counted and its backward split for W."""

    def __init__(self, fn: Callable, gm: torch.fx.GraphModule, index: int, config: TorchCompile,
                 defer: bool = False, static_first: bool = False) -> None:
        self.index = index
        self.static_first = static_first  # dim 0 static until a second size (dynamic=None)
        self.gm = gm  # where graph breaks are looked up (the stage's generated code)
        self.config = config
        self.defer = defer  # the backward is split into I and W
        self.store: list | None = None  # set by deferring(): where the backward queues its W work
        self.graphs = 0  # graphs dynamo compiled for this stage (each recompilation adds at least one)
        self.compiles = 0  # calls that compiled something: the first, then each recompilation
        self.seconds = 0.0  # wall time of the calls that compiled, and of backwards compiled later
        self.breaks: list[str] = []  # where and why a graph ended at a graph break
        self.split: list[tuple[int, int]] = []  # per split backward graph: nodes in I and in W
        self.norms: list | None = None  # the stage's deferred batch norms, found at the first call
        _room_for_stages(index + 1)
        _step_over(call_wrapper_code())
        if not isinstance(fn, torch.nn.Module) and hasattr(fn, "__code__"):
            _step_over(fn.__code__)  # a wrapper shared by stages (foreign parameters): compile what it calls
        self._fn = torch.compile(fn, backend=stage_backend(self, defer), dynamic=config.dynamic,
                                 fullgraph=config.fullgraph)

    def __call__(self, *inputs: Any) -> Any:
        """Run the compiled stage; the first call compiles (and so does a call dynamo's guards refuse)."""
        inputs = _at_offset_zero(inputs)
        if self.config.dynamic is None and not self.static_first:
            _mark_batch_dynamic(inputs)
        if self.norms is None:  # deferred batch norms stage their sums inside the graph
            self.norms = staging(self.gm.modules())
        sources = _int_sources(self.gm, inputs) if self.config.dynamic is None and not self.static_first else ""
        before, start = self.graphs, time.perf_counter()
        try:
            with unstaged(self.norms, bool(self.norms) and is_recomputing()), \
                    torch.compiler.config.patch(dynamic_sources=sources):  # type: ignore[attr-defined]
                out = self._fn(*inputs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise self._failure(exc, inputs) from exc
        if self.graphs > before:
            self._compiled(time.perf_counter() - start)
        return out

    @contextmanager
    def deferring(self, store: list) -> Iterator[list]:
        """Queue the weight-gradient work of backwards run in the block into ``store`` (an I step)."""
        previous, self.store = self.store, store
        try:
            yield store
        finally:
            self.store = previous

    @property
    def recompiles(self) -> int:
        """Return how many times the stage compiled again after its first compile."""
        return max(self.compiles - 1, 0)

    def stats(self) -> dict[str, Any]:
        """Return the stage's compile record: graphs, compiles, recompiles, seconds, breaks, I/W split."""
        return {"stage": self.index, "backend": self.config.name, "graphs": self.graphs, "compiles": self.compiles,
                "recompiles": self.recompiles, "seconds": self.seconds, "breaks": list(self.breaks),
                "split": list(self.split)}

    # -- what the backend calls (fxpipe.runtime.stage.aotsplit.Deferral) --------------------------
    def compiled_graph(self, gm: torch.fx.GraphModule) -> None:
        """Count a graph dynamo hands to the backend; note a graph break that ended it."""
        self.graphs += 1
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            stack = reason.user_stack or ()
            node = node_in_stack(self.gm, stack)
            at = f"node {describe_node(self.gm, node)}" if node is not None else "a call inside the stage"
            flag = any(getattr(f, "filename", "").endswith(_FLAGS) for f in stack)
            why = ("it reads fxpipe.is_recomputing() or is_checkpointing(), which a compiled stage reads past a "
                   "graph break so that the graph after it is guarded on the flag" if flag else
                   str(reason.reason).strip().splitlines()[0] if reason.reason else "unsupported code")
            note = f"{at}: {why}"
            if note not in self.breaks:
                self.breaks.append(note)
                log.log(logging.INFO if flag else logging.WARNING, "stage %d: torch.compile breaks the graph at %s; "
                        "the stage runs as several graphs (torch_compile={'fullgraph': True} refuses this)",
                        self.index, note)

    def spent(self, seconds: float) -> None:
        """Add compile time spent outside a compiling call (a backward compiled when it first runs)."""
        self.seconds += seconds

    # -- helpers ---------------------------------------------------------------------------------
    def _compiled(self, seconds: float) -> None:
        """Record a call that compiled; log the stage's first compile once, recompilations at debug."""
        self.compiles += 1
        self.seconds += seconds
        if self.compiles == 1:
            log.info("stage %d: torch.compile (%s) compiled it in %.1f s (%d graph%s); later calls reuse it",
                     self.index, self.config.name, seconds, self.graphs, "" if self.graphs == 1 else "s")
        else:
            log.debug("stage %d: torch.compile compiled again (%d graphs in all, %.1f s)", self.index,
                      self.graphs, seconds)

    def _failure(self, exc: BaseException, inputs: tuple) -> CompileError:
        """Return a CompileError naming the stage, the node torch.compile could not compile and a 1-row micro-batch."""
        stack = getattr(exc, "real_stack", None) or []
        node = node_in_stack(self.gm, stack) if stack else None
        at = f" at node {describe_node(self.gm, node)}" if node is not None else ""
        inner = getattr(exc, "inner_exception", None)  # a backend that raised: its own error says why
        text = f"{type(inner).__name__}: {inner}" if inner is not None else str(exc)
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
        fix = ("drop fullgraph=True to run the stage with a graph break there, or make that code traceable"
               if self.config.fullgraph else
               "try backend='aot_eager' to tell the graph from the backend, or torch_compile=False")
        return CompileError(f"stage {self.index}: torch.compile ({self.config.name}) cannot compile the stage{at}: "
                            f"{first}; {fix}{_one_row(inputs)}")


def _one_row(inputs: tuple) -> str:
    """Say that the micro-batch has one row, where it has: torch.compile compiles size 1 apart."""
    rows = {t.shape[0] for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if rows != {1}:
        return ""
    return (". This micro-batch has one row, and torch.compile compiles a size of 1 as a graph of its own (it "
            "specializes sizes 0 and 1), which some models' code does not survive (plain torch.compile(model) fails "
            "alike on a 1-row batch): give every micro-batch 2 rows or more (a batch of at least 2 * chunks rows, "
            "or drop an uneven last batch with DataLoader(..., drop_last=True))")


def _room_for_stages(stages: int) -> None:
    """Raise dynamo's recompile limit to hold ``stages`` stages' graphs on code they share.

    User code a graph break resumes in (a leaf module's forward after a ``.item()``) is one code
    object for every stage calling it, and each stage adds its own cache entries there (its
    backend, the no-grad and recomputed forwards, eval): past ``recompile_limit`` (8) dynamo
    runs that code eagerly, silently. Eight entries per stage leave room.
    """
    config = torch._dynamo.config
    wanted = 8 * stages
    if config.recompile_limit < wanted:
        log.info("raising torch._dynamo.config.recompile_limit from %d to %d for %d compiled stages",
                 config.recompile_limit, wanted, stages)
        config.recompile_limit = wanted
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * wanted)


def _step_over(code: Any) -> None:
    """Have torch.compile skip frames of ``code`` and compile the frames they call.

    torch.compile caches a frame's graphs on its code object, and a limited number of them
    (``torch._dynamo.config.recompile_limit``): a wrapper whose code every stage shares
    would hold every stage's graphs and soon fall back to eager. The stage's own generated
    forward has code of its own.
    """
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


def _at_offset_zero(inputs: tuple) -> tuple:
    """Copy the input tensors that start inside their storage (micro-batch slices of the batch).

    torch.compile specializes a storage offset of 0 (or 1) and guards on it: micro-batch 0 at
    offset 0 and the others further on would compile the stage twice (and, with static shapes,
    once per offset). A copy of one micro-batch's inputs costs less than a compile.
    """
    if not any(isinstance(t, torch.Tensor) and t.storage_offset() != 0 for t in tree_leaves(inputs)):
        return inputs
    return tuple(tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.storage_offset() != 0 else t,
                          inputs))


def _int_sources(gm: torch.fx.GraphModule, inputs: tuple) -> str:
    """Name, as dynamo's sources, the stage's inputs that are Python ints (a batch size crossing from the stage before).

    Dynamo specializes an int input at its first value; marked dynamic like dim 0 of the
    tensors, a new batch size reuses the graph instead of compiling it again.
    """
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return ",".join(f"L['{name}']" for name, v in zip(names, inputs)
                    if isinstance(v, int) and not isinstance(v, bool))


def _mark_batch_dynamic(inputs: tuple) -> None:
    """Mark dim 0 of every input tensor dynamic (where the model allows), so micro-batch sizes share a graph."""
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
