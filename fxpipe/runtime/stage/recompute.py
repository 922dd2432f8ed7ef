"""Activation checkpointing with recomputation on a side branch and replayed RNG state.

:class:`Checkpoint` runs a stage under ``no_grad`` and saves the RNG state. :class:`Recompute`
hangs off the stage's output through a fork/join pair, so that in backward it runs *before*
the checkpoint's own backward, as soon as the output's gradient is due (torchgpipe, 3.2.3)::

           ┌──────── Checkpoint (no_grad forward) ──▶ y ──Fork──▶ y' ──Join──▶ y''
    inputs ┤                                                │          ▲
           └──────── Recompute (identity in forward) ◀──phony┘   phony─┘

    backward: Join ─▶ Recompute (replay forward with grad, same RNG) ─▶ Fork ─▶ Checkpoint
              (backward through the recomputed graph, gradients to the inputs)

Both passes run through the stage call (:class:`fxpipe.runtime.stage.stagecall.StageCall`), which
restores the CPU RNG state and that of the stage's CUDA device for the recomputation, so
dropout draws the same mask. :func:`is_checkpointing` and :func:`is_recomputing` tell a module which
pass it is in (in a compiled stage, at the cost of a graph break where they are read).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import RecomputationError
from fxpipe.passes.mutates import aliases
from fxpipe.runtime.stage.dependency import fork, get_phony, join
from fxpipe.runtime.stage.owned import owned, unshare_grads

__all__ = [
    "checkpointed",
    "guarded",
    "in_pass",
    "is_checkpointing",
    "is_recomputing",
]

class _State(threading.local):
    """Per-thread flags telling which pass a stage's forward is in."""

    checkpointing = False
    recomputing = False


_state = _State()


def is_checkpointing() -> bool:
    """Tell whether the current forward runs under checkpointing (its activations are dropped)."""
    if torch.compiler.is_compiling():
        return _read("checkpointing")
    return _state.checkpointing


def is_recomputing() -> bool:
    """Tell whether the current forward is a recomputation for backward."""
    if torch.compiler.is_compiling():
        return _read("recomputing")
    return _state.recomputing


@torch.compiler.disable
def _read(flag: str) -> bool:
    """Read a pass flag outside the compiled graph.

    Inside ``torch.compile`` the flags are read here, past a graph break, so that the graph
    after it is guarded on the value: without it, torch.compile would bake in the flag of the
    first pass it traced (a per-thread value, which it does not guard).
    """
    return bool(getattr(_state, flag))


@contextmanager
def in_pass(name: str) -> Iterator[None]:
    """Set the per-thread pass flag ``name`` (``checkpointing`` or ``recomputing``) for the block."""
    previous = getattr(_state, name)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


class _Record:
    """What a checkpointed call shares between its Checkpoint and Recompute nodes."""

    def __init__(self, call: Any, i: int, rebuild: Callable[[tuple], tuple],
                 flatten: Callable[[Any], tuple]) -> None:
        self.call = call  # the stage call (:class:`fxpipe.runtime.stage.stagecall.StageCall`)
        self.i = i
        self.rebuild = rebuild  # input tensors -> the stage's arguments
        self.flatten = flatten  # the stage's outputs -> their tensors
        self.replay_point: Any = None
        self.recomputed: deque = deque(maxlen=1)

    def replay(self, inputs: tuple) -> None:
        """Recompute the forward with grad and the saved RNG state; keep the result."""
        _check_served(self.call.index)
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        try:
            outputs = self.flatten(self.call.run(self.i, self.rebuild(leaves), "recompute", self.replay_point))
        except RuntimeError as exc:
            if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
                raise
            raise RecomputationError(
                f"stage {self.call.index} writes one of its inputs in place (an nn.ReLU(inplace=True) or x.add_(...) "
                "as the first thing it does), which its recomputation in backward cannot replay: the inputs it "
                "recomputes from are leaves that require grad. Make that op out of place (inplace=False), "
                "compile with checkpoint='never', or cut the model with fxpipe.compile, which copies an input "
                "a stage writes") from exc
        self.recomputed.append((outputs, leaves))


class Checkpoint(torch.autograd.Function):
    """Run the function without keeping activations; backpropagate through its recomputation."""

    @staticmethod
    def forward(ctx, phony, record: _Record, *inputs):  # type: ignore[override]
        ctx.record = record
        ctx.set_materialize_grads(False)  # an output the loss does not reach passes None, not zeros
        ctx.save_for_backward(*inputs)
        rebuilt = record.rebuild(inputs)
        record.replay_point = record.call.replay_point(rebuilt)
        outputs = record.flatten(record.call.run(record.i, rebuilt, "checkpoint"))
        # A tensor this call did not make (a parameter or buffer returned as is, a graph constant)
        # is one object shared by every call: autograd would set its grad_fn to this node, turning
        # a Parameter into a non-leaf and chaining every micro-batch's Checkpoint through it. Return
        # an alias instead (inputs returned as is are aliased by autograd itself).
        if not _returns_held(record.call.gm):
            return outputs
        held = _held(record.call.gm)
        return tuple(o.view_as(o) if id(o) in held else o for o in outputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        record: _Record = ctx.record
        if not record.recomputed:  # the side branch was not reached: recompute here (replay checks the backward)
            record.replay(ctx.saved_tensors)
        outputs, leaves = record.recomputed.pop()
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            # a gradient of another micro-batch may still be pending in the outer graph, sharing
            # memory with a parameter's .grad that this backward adds into (stage.owned)
            unshare_grads(_trained(record.call.gm))
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        # autograd holds these until the previous stage runs; a later Checkpoint's backward must
        # not change them through a parameter's .grad (stage.owned)
        return (None, None) + tuple(owned(x.grad) if x.requires_grad else None for x in leaves)


def _check_served(stage: int) -> None:
    """Refuse a backward a recomputed stage cannot serve: gradients of chosen tensors, or of gradients.

    The recomputation backpropagates inside the backward (torchgpipe's, and
    ``torch.utils.checkpoint``'s reentrant variant): it can only add into ``.grad``, so
    ``torch.autograd.grad`` would miss the parameters' share of every recomputed micro-batch,
    and ``create_graph=True`` would get no graph through them.
    """
    if torch.is_grad_enabled():  # the engine runs a backward with grad mode on under create_graph=True
        what = "create_graph=True (a gradient of a gradient, a gradient penalty)"
    elif not torch.autograd._is_checkpoint_valid():  # torch.autograd.grad, or backward(inputs=...)
        what = "torch.autograd.grad or backward(inputs=...)"
    else:
        return
    raise RecomputationError(
        f"stage {stage} is checkpointed (recomputed in backward), which cannot serve {what}: the recomputation "
        "backpropagates inside the backward and can only add its parameters' gradients into .grad, so the "
        "result would silently leave out every recomputed micro-batch's share. Call loss.backward() with no "
        "inputs= and read .grad, or compile with checkpoint='never' (every stage keeps its activations)")


def guarded(output: Any, stage: int) -> None:
    """Hook each tensor of ``output`` that requires grad with a check of the backward's kind.

    ``torch.autograd.grad(loss, params)`` runs only the nodes on a path to ``params``, and a
    checkpointed stage's parameters are on none (they are read inside its recomputation), so
    its backward never runs to refuse: the result would just lack those micro-batches. This
    hook, on ``pipe(x)``'s output, is on every path, and refuses for ``stage`` (the first
    checkpointed one). A hook rather than a node: the output stays the tensor the stages made,
    which the caller may still change in place.
    """
    def check(grad: torch.Tensor) -> None:
        _check_served(stage)

    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.register_hook(check)


_TRAINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage graph -> its parameters that train


def _trained(gm: Any) -> list[torch.Tensor]:
    """Return the parameters of a stage graph that require grad (once per graph)."""
    params = _TRAINED.get(gm)
    if params is None:
        params = _TRAINED[gm] = [p for p in gm.parameters() if p.requires_grad]
    return params


_RETURNS_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage graph -> _returns_held's answer


def _returns_held(gm: Any) -> bool:
    """Tell whether the stage graph may return a tensor it holds: an output read straight off an attribute.

    Read once per graph; most return none, and :func:`_held` (a walk of every parameter) is
    then skipped on this path, which runs once per micro-batch and stage.
    """
    if gm not in _RETURNS_HELD:
        graph = getattr(gm, "graph", None)
        leaves = tree_flatten(graph.output_node().args[0])[0] if graph is not None else []
        # what an output may be: itself, or what it aliases (an in-place op returns the tensor it wrote,
        # a buffer's add_ the buffer; fxpipe's pick one of its arguments), followed to the end
        todo, seen = [leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)], set()
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += aliases(n)
        _RETURNS_HELD[gm] = graph is None or any(n.op == "get_attr" for n in seen)
    return _RETURNS_HELD[gm]


def _held(gm: torch.nn.Module) -> set[int]:
    """The ids of the tensors ``gm`` holds: parameters, buffers and graph constants (``_tensor_constant0``)."""
    held = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    return held | {id(v) for v in vars(gm).values() if isinstance(v, torch.Tensor)}


class Recompute(torch.autograd.Function):
    """Pass a phony through in forward; recompute the checkpointed function in backward."""

    @staticmethod
    def forward(ctx, phony, record: _Record, *inputs):  # type: ignore[override]
        ctx.record = record
        ctx.save_for_backward(*inputs)
        return phony.detach()

    @staticmethod
    def backward(ctx, grad_phony):  # type: ignore[override]
        ctx.record.replay(ctx.saved_tensors)
        return (None, None) + (None,) * len(ctx.saved_tensors)


def _flatten(value: Any) -> tuple[list, Any]:
    """Flatten a value into leaves; a plain tuple of tensors (the common case) skips pytree."""
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), None
    return tree_flatten(value)


def _unflatten(leaves: list, spec: Any) -> Any:
    """Invert :func:`_flatten`."""
    return tuple(leaves) if spec is None else tree_unflatten(leaves, spec)


def checkpointed(call: Any, i: int, inputs: tuple) -> Any:
    """Run stage ``call`` on micro-batch ``i`` without keeping activations; recompute them in backward.

    ``call`` is the stage's :class:`~fxpipe.runtime.stage.stagecall.StageCall`, which runs both
    passes. ``inputs`` and the result may hold any structure of tensors and other values;
    only the tensors pass through autograd.
    """
    in_leaves, in_spec = _flatten(inputs)
    in_idx = [k for k, v in enumerate(in_leaves) if isinstance(v, torch.Tensor)]
    tensors = tuple(in_leaves[k] for k in in_idx)
    # Keep only the structure and the non-tensor values: the tensors reach the stage as
    # arguments (saved by autograd), and holding them here would keep every micro-batch's
    # inputs and outputs alive as long as the autograd graph.
    frame = [None if isinstance(v, torch.Tensor) else v for v in in_leaves]
    shape: dict[str, Any] = {}

    def rebuild(args: tuple) -> tuple:
        leaves = list(frame)
        for k, t in zip(in_idx, args):
            leaves[k] = t
        return _unflatten(leaves, in_spec)

    def flatten(out: Any) -> tuple:
        out_leaves, out_spec = _flatten(out)
        shape["spec"] = out_spec
        shape["tensor_at"] = {k for k, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)}
        shape["frame"] = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        return tuple(v for v in out_leaves if isinstance(v, torch.Tensor))

    record = _Record(call, i, rebuild, flatten)
    phony = get_phony(call.device, requires_grad=True)
    outputs = list(Checkpoint.apply(phony, record, *tensors))
    # Hang the recomputation off the first output that requires grad.
    for k, y in enumerate(outputs):
        if y.requires_grad:
            outputs[k], branch = fork(y)
            branch = Recompute.apply(branch, record, *tensors)
            outputs[k] = join(outputs[k], branch)
            break
    it = iter(outputs)
    leaves = [next(it) if k in shape["tensor_at"] else v for k, v in enumerate(shape["frame"])]
    return _unflatten(leaves, shape["spec"])
