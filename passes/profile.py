"""Measure each node's forward and backward time on a device by running the whole graph.

Reads:  the graph, the module's parameters and buffers (copied, never changed), and
        ``fxpipe.value`` (from :func:`fxpipe.passes.annotate`) to know which inputs need a gradient.
Writes: ``node.meta`` keys

    fxpipe.time_fwd   median forward milliseconds of the node on ``device``
    fxpipe.time_bwd   median milliseconds of its backward (gradients of the inputs that need
                      them and of its parameters); estimated from the FLOP ratio when the
                      node's backward cannot run on its own
    fxpipe.time       their sum, the cost ``balance_by="time"`` balances

The graph runs node by node on the example inputs, each node fed by the real outputs of
the nodes before it: skip connections and shared values reach their consumers exactly as in
the model, which profiling layer by layer cannot do. Each node's state (parameters,
buffers) is copied to ``device`` for that node only; the random number generators are
restored afterwards. When profiling takes more than ``progress_after`` seconds a progress
line goes to stderr (redrawn in place on a terminal).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx
from fxpipe.passes.annotate import bind_placeholders
from fxpipe.passes.mutates import is_mutating
from fxpipe.passes.propagate import PlainArgs, fetch_stand_in
from fxpipe.passes.spec import TensorSpec, differentiable
from fxpipe.passes.timing import median_seconds
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Profiler", "profile"]

log = logging.getLogger(__name__)


class _Progress:
    """A progress line on stderr, shown once the work has taken longer than ``after`` seconds."""

    def __init__(self, total: int, after: float, stream: Any = None) -> None:
        self.total, self.after = total, after
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.shown = False
        self.last = 0.0
        self.last_tenth = -1

    def update(self, done: int, name: str) -> None:
        """Report ``done`` of ``total`` nodes, ``name`` being the one now measured."""
        now = time.perf_counter()
        if now - self.start < self.after:
            return
        self.shown = True
        if self.tty:
            if now - self.last >= 0.1:
                self.stream.write(f"\rfxpipe: profiling node {done}/{self.total} ({name[:30]})\x1b[K")
                self.stream.flush()
                self.last = now
        elif done * 10 // self.total > self.last_tenth:
            self.last_tenth = done * 10 // self.total
            self.stream.write(f"fxpipe: profiling node {done}/{self.total}\n")
            self.stream.flush()

    def close(self) -> None:
        """End the line with the total time, if it was shown."""
        if self.shown:
            line = f"fxpipe: profiled {self.total} nodes in {time.perf_counter() - self.start:.1f} s"
            self.stream.write(f"\r{line}\x1b[K\n" if self.tty else line + "\n")
            self.stream.flush()


def _stand_in(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a parameter or buffer to ``device`` (a parameter copy is a leaf needing its gradient)."""
    copy = t.detach().to(device, copy=True)
    if isinstance(t, nn.Parameter) and t.requires_grad:
        copy.requires_grad_(True)
    return copy


def _runner(gm: torch.fx.GraphModule, node: torch.fx.Node, device: torch.device):
    """Return ``(call, params)``: a function running the node, and the leaves of its state."""
    if node.op == "call_module":
        module = gm.get_submodule(cast(str, node.target))  # a call_module target is the module's path
        state = {k: _stand_in(v, device) for k, v in
                 list(module.named_parameters(remove_duplicate=False))
                 + list(module.named_buffers(remove_duplicate=False))}
        params = [t for t in state.values() if t.requires_grad]
        return (lambda args, kwargs: torch.func.functional_call(module, state, tuple(args), kwargs)), params
    if node.op == "call_method":
        method = cast(str, node.target)  # a call_method target is the method's name
        return (lambda args, kwargs: getattr(args[0], method)(*args[1:], **kwargs)), []
    fn = cast(Callable[..., Any], node.target)  # a call_function target is the function
    return (lambda args, kwargs: fn(*args, **kwargs)), []


def _needs_grad(node: torch.fx.Node, value: Any) -> bool:
    """Tell whether a node's value needs a gradient in training (from its annotation)."""
    spec = node.meta.get("fxpipe.value")
    if isinstance(spec, TensorSpec):
        return spec.requires_grad
    return isinstance(value, torch.Tensor) and differentiable(value.dtype) and node.op == "get_attr"


def _backward_ms(node: torch.fx.Node, call, params: list, env: dict, device: torch.device,
                 repeats: int, warmup: int) -> float:
    """Time the gradients of the node's inputs that need them and of its parameters."""
    leaves = []

    def leaf(a: torch.fx.Node) -> Any:
        v = env[a]
        if isinstance(v, torch.Tensor) and differentiable(v.dtype) and _needs_grad(a, v):
            v = v.detach().requires_grad_(True)
            leaves.append(v)
        return v

    fed = {a: leaf(a) for a in node.all_input_nodes}
    if not leaves + params:
        return 0.0
    if is_mutating(node):  # an in-place op must not write into a leaf
        fed = {a: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v for a, v in fed.items()}
    args = torch.fx.node.map_arg(node.args, fed.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, fed.__getitem__)
    with torch.enable_grad():
        out = call(args, kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return 0.0
    grads = [torch.ones_like(o) for o in outs]
    wrt = leaves + params
    return 1e3 * median_seconds(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True),
                      device, repeats, warmup)


def _backward_or_estimate(node, call, params, env, device, repeats, warmup, fwd: float) -> float:
    """Measure the node's backward; if it cannot run alone, scale ``fwd`` by the FLOP ratio."""
    try:
        return _backward_ms(node, call, params, env, device, repeats, warmup)
    except (RuntimeError, TypeError, ValueError) as exc:
        flops = node.meta.get("fxpipe.flops", 0) or 0
        ratio = (node.meta.get("fxpipe.flops_bwd", 0) or 0) / flops if flops else 1.0
        log.debug("no separate backward for %s (%s); estimating %.2f x forward", node.name, exc, ratio)
        return fwd * ratio


class Profiler(PlainArgs):
    """Run a GraphModule on real values, timing each node's forward and backward (ShapeProp-style).

    :meth:`run_node` runs every call node ``warmup + repeats`` times on ``device`` with its
    state copied there, then its backward, and records the medians in ``node.meta``; values
    are freed after their last use.
    """

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, repeats: int, warmup: int,
                 bar: _Progress) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.gm, self.device, self.repeats, self.warmup, self.bar = gm, device, repeats, warmup, bar
        self.done = 0

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Fetch an attribute; a tensor as a copy on the device (a module as one calling on copies)."""
        return fetch_stand_in(self.gm, target, lambda t: _stand_in(t, self.device))

    def run_node(self, node: torch.fx.Node) -> Any:
        """Run a node; time a call node's forward and backward into ``node.meta``."""
        self.done += 1
        self.bar.update(self.done, node.name)
        fwd = bwd = 0.0
        if node.op in ("placeholder", "get_attr", "output"):
            value = super().run_node(node)
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            call, params = _runner(self.gm, node, self.device)
            result: list = []
            with torch.no_grad():
                fwd = 1e3 * median_seconds(lambda: result.append(call(args, kwargs)), self.device, self.repeats, self.warmup)
            bwd = _backward_or_estimate(node, call, params, self.env, self.device, self.repeats, self.warmup, fwd)
            value = result[-1]
        node.meta["fxpipe.time_fwd"] = fwd
        node.meta["fxpipe.time_bwd"] = bwd
        node.meta["fxpipe.time"] = fwd + bwd
        return value


def profile(gm: torch.fx.GraphModule, example_args: tuple, example_kwargs: dict | None = None, *,
            device: str | torch.device = "cpu", repeats: int = 3, warmup: int = 1,
            progress_after: float = 1.0, stream: Any = None) -> torch.fx.GraphModule:
    """Record ``fxpipe.time_fwd/time_bwd/time`` (milliseconds) on every node; return ``gm``.

    Runs each compute node ``warmup + repeats`` times forward and backward on ``device``
    with the values the graph computes from ``example_args`` and ``example_kwargs``.
    """
    device = torch.device(device)
    flat = bind_placeholders(gm, example_args, example_kwargs or {})
    flat = tree_map(lambda v: v.detach().to(device) if isinstance(v, torch.Tensor) else v, flat)
    bar = _Progress(len(gm.graph.nodes), progress_after, stream)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        Profiler(gm, device, repeats, warmup, bar).run(*flat, enable_io_processing=False)
    bar.close()
    return gm
