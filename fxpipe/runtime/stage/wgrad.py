"""Deferred weight gradients: a backward that computes input gradients now, weights' later.

The zero-bubble schedule splits each stage's backward into ``B`` (gradients of the stage's
inputs, which the previous stage waits for) and ``W`` (gradients of its weights, which
nobody waits for). fxpipe makes the split where nearly all of a model's weight-gradient
work is: every ``nn.Linear`` and ``F.linear`` of a stage becomes :func:`linear`, whose
backward computes only ``dx = dy @ W`` and queues ``dW = dyᵀ x`` (and ``db = Σ dy``) in
the store that was active when its forward ran::

    forward (store S active)           B: autograd                 W: run(S)
    x ──▶ linear(x, W, b) ──▶ y        dy ──▶ dx = dy @ W ──▶ ...   W.grad += dyᵀ x
                                              └─ S.append((x, dy))  b.grad += Σ dy

Without an active store (``pipe(x)`` followed by ``loss.backward()``, or a forward under
``no_grad``) :func:`linear` is ``F.linear``. Weights that are not leaves (a parameter
copied to another device per call), autocast and other layers (convolutions, norms,
embeddings) keep their gradients in ``B``. A deferred gradient is added to ``.grad``
directly, where no hook could see it: a parameter with gradient hooks (``register_hook``,
``register_post_accumulate_grad_hook``) keeps its gradient in ``B`` too, so its hooks run as in eager.

A tensor-parallel linear (its weight a DTensor, ``parallelize_module``'s hooks around its call)
keeps its module call, so the hooks still turn its input and output into DTensors and back;
its ``forward`` is :func:`linear` instead, which defers the same way on the DTensors (``dW``
comes out sharded like ``W``, with no communication in ``W``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.fx
import torch.nn.functional as F

from fxpipe.passes.linears import defers_weight_grad, tensor_hooked
from fxpipe.runtime.stage.owned import owned

__all__ = ["active", "collecting", "defer_weight_grads", "linear", "run"]

_local = threading.local()


@contextmanager
def collecting(store: list) -> Iterator[list]:
    """Queue the weight gradients of linears whose forward runs in the block into ``store``."""
    before = getattr(_local, "store", None)
    _local.store = store
    try:
        yield store
    finally:
        _local.store = before


def active() -> bool:
    """Tell whether a store is collecting on this thread (the linears' weight gradients are deferred)."""
    return getattr(_local, "store", None) is not None


def run(store: list) -> None:
    """Compute and accumulate every weight gradient queued in ``store``, emptying it.

    An entry is a linear's ``(x, dy, weight, bias)``, or a callable that does its own (a
    compiled stage's W graph, :mod:`fxpipe.runtime.stage.aotsplit`).
    """
    queued, store[:] = list(store), []
    for entry in queued:
        if callable(entry):
            entry()
        else:
            _weight_grad(*entry)


@torch.no_grad()
def _weight_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Add one linear's ``dW = dyᵀ x`` (and ``db = Σ dy``) to its parameters' ``.grad``."""
    if dy.dim() != 2:
        dy = dy.reshape(-1, dy.shape[-1])
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    g = weight.grad
    if g is not None and g.dtype == dy.dtype and g.layout == torch.strided and g.is_contiguous() \
            and g.device == dy.device and not g.requires_grad:
        g.addmm_(dy.t(), x)  # one GEMM adds into .grad: no temporary, no add pass
    else:
        _accumulate(weight, dy.t().mm(x))
    if bias is not None:
        _accumulate(bias, dy.sum(0))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as autograd would."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    elif param.grad.layout != torch.strided:  # a sparse gradient (an embedding's) cannot add in place
        param.grad = grad + param.grad
    else:
        param.grad.add_(grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``F.linear(x, weight, bias)``, its weight gradients deferred when a store is active.

    The common case (plain tensors, an input that needs its gradient, no saved-tensor hooks) runs
    ``F.linear`` on detached parameters, which gives autograd ``dx = dy @ W`` alone, and a hook on
    the output queues ``dy`` with ``x`` (cheaper than a Python autograd function). Otherwise, with
    selective recomputation's or offload's hooks (which must see ``x`` saved), on DTensors, or for
    an input without a gradient, :class:`_Linear` does the same.
    """
    store = getattr(_local, "store", None)
    if (store is None or not torch.is_grad_enabled() or not _deferrable(weight)
            or (bias is not None and not _deferrable(bias)) or weight.dim() != 2
            or (torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(x.device.type))):
        return F.linear(x, weight, bias)
    if x.requires_grad and type(weight) is torch.nn.Parameter and _no_saved_tensor_hooks():
        # a 3-D input flattened here: F.linear's own output would be a view, and an in-place op on it
        # (ReLU(inplace=True), Wav2Vec2's h[~mask] = 0) rebases its history past the hook, which then
        # never fires (the weight's gradient stayed None). The view made here leaves the hook on its base.
        flat = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x
        y = F.linear(flat, weight.detach(), None if bias is None else bias.detach())
        y.register_hook(_Queue(store, flat, weight, bias))
        return y.view(*x.shape[:-1], y.shape[-1]) if x.dim() > 2 else y
    if x.dim() > 2 and type(x) is torch.Tensor:
        # F.linear of a 3-D input returns a view; made inside the Function, autograd would refuse
        # an in-place op on it (Swinv2's ReLU(inplace=True) after a linear of a buffer): view outside
        y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, store)
        return y.view(*x.shape[:-1], y.shape[-1])
    return _Linear.apply(x, weight, bias, store)


def _no_saved_tensor_hooks() -> bool:
    """Tell whether no saved-tensor hooks are active (they must see what backward keeps)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _Queue:
    """A linear output's gradient hook: queue ``(x, dy, weight, bias)`` for the W step.

    ``x`` is held here, not saved by autograd, so its version is checked as autograd would.
    """

    __slots__ = ("bias", "store", "version", "weight", "x")

    def __init__(self, store: list, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.store, self.x, self.weight, self.bias = store, x.detach(), weight, bias
        self.version = x._version

    def __call__(self, dy: torch.Tensor) -> None:
        """Queue this linear's weight gradients (called by autograd with the output's gradient)."""
        if self.x._version != self.version:
            raise RuntimeError("the input of a linear whose weight gradient is deferred was modified in place "
                               "after the linear ran (autograd would refuse this too); compute the update "
                               "out of place (x = x + h rather than x += h)")
        self.store.append((self.x, _kept(dy), self.weight, self.bias))


def _kept(dy: torch.Tensor) -> torch.Tensor:
    """Return the output gradient ``dy`` to queue for ``W``, safe from later backwards.

    Autograd may give a parameter's ``.grad`` the memory of ``dy`` (a table broadcast-added to
    the linear's output, with a micro-batch of one row), and the next backward would add into
    it before ``W`` reads it: a view sharing memory is copied (:func:`~fxpipe.runtime.stage.owned.owned`),
    and ``dy`` itself is queued, not a detached alias, so that ``AccumulateGrad`` sees it held
    and copies rather than keeps it.
    """
    return owned(dy.detach() if dy.requires_grad else dy)


def _deferrable(p: torch.Tensor) -> bool:
    """Return whether ``p``'s gradient can be added to ``p.grad`` later: a leaf that wants one, with no hooks to run."""
    return isinstance(p, torch.Tensor) and p.is_leaf and p.requires_grad and p.layout == torch.strided \
        and not tensor_hooked(p)


class _Linear(torch.autograd.Function):
    """``F.linear`` whose backward returns ``dx`` and queues the weight gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):  # type: ignore[override]
        """Compute ``x Wᵀ + b``; keep what both halves of backward need."""
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        """Return ``dy @ W`` for ``x``; queue ``dW`` and ``db`` for the W step."""
        x, weight = ctx.saved_tensors
        if weight.dtype != dy.dtype:
            weight = weight.to(dy.dtype)
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.store.append((x.detach(), _kept(dy), ctx.params[0], ctx.params[1]))
        return dx, None, None, None


def _module_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear module's forward through :func:`linear`."""
    return linear(x, self.weight, self.bias)


def _defer_module(mod: torch.nn.Module) -> None:
    """Make a tensor-parallel linear module defer its weight gradients (``F.linear`` without a store)."""
    mod.forward = types.MethodType(_module_forward, mod)  # type: ignore[method-assign]


def defer_weight_grads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Return a copy of ``gm`` calling :func:`linear` for every node whose weight gradient W computes.

    Reads the nodes :func:`fxpipe.passes.linears.defers_weight_grad` selects (the simulator
    counts the same ones); the copy keeps node names and ``meta`` and shares ``gm``'s modules
    and parameters.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    replaced: list[tuple[str, torch.nn.Module]] = []  # module calls the copy makes as calls of linear
    for node in gm.graph.nodes:
        deferred = defers_weight_grad(gm, node)
        if deferred and node.op == "call_module" and hasattr(gm.get_submodule(node.target).weight, "to_local"):
            _defer_module(gm.get_submodule(node.target))
            env[node] = graph.node_copy(node, env.__getitem__)
        elif deferred and node.op == "call_module":
            mod = gm.get_submodule(node.target)
            replaced.append((str(node.target), mod))
            x = env[node.args[0]]
            w = graph.get_attr(f"{node.target}.weight")
            b = graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
            env[node] = graph.create_node("call_function", linear, (x, w, b), name=node.name)
        elif deferred:
            env[node] = graph.create_node("call_function", linear, torch.fx.map_arg(node.args, env.__getitem__),
                                          torch.fx.map_arg(node.kwargs, env.__getitem__), name=node.name)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = node.meta
    copy = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta["fxpipe.replaced_modules"] = replaced  # a hook or parametrization added later is refused
    return copy
