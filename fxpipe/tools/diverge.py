"""Find the first stage and node where a pipeline's values leave the eager model's.

Three runs see the same micro-batch (the pipe's first) with the same random seed:

    eager model ─────────────────────────────────────────▶ output          (the reference)
    traced graph (torch.fx Interpreter) ── node by node ─▶ output          (the tracer's view)
    stage 0 ─▶ stage 1 ─▶ ... (Interpreters, values handed ─▶ output       (the split)
               on as the plan routes them, copied to each stage's device)

Forward values are compared node by node in graph order; when they all agree, gradients are
compared node by node from the output back. The report names the first node that differs,
its stage and the module it came from; if the traced graph already differs from eager, the
tracer is to blame; if nothing differs on one micro-batch, the runtime is (micro-batching,
checkpointing, copies). The diagnostic runs forward and backward once more, so batch norm
running statistics in training mode move again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.passes.order import draws_random
from fxpipe.runtime.microbatch import to_device
from fxpipe.runtime.observe.blame import describe_node

__all__ = ["divergence"]


class _Recorder(torch.fx.Interpreter):
    """Run a GraphModule and keep every node's value, retaining gradients of float tensors."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict[str, Any]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values = values

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run one node and keep its value."""
        result = super().run_node(n)
        if n.op not in ("output", "get_attr"):
            for t in _floats(result):
                if t.requires_grad and not t.is_leaf:
                    t.retain_grad()
            self.values[n.name] = result
        return result


class _Runner(nn.Module):
    """Hold a GraphModule so that ``functional_call`` can swap in per-device copies of its state."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict[str, Any]) -> None:
        super().__init__()
        self.gm = gm
        self.values = values

    def forward(self, *args: Any) -> Any:
        return _Recorder(self.gm, self.values).run(*args)


def _floats(value: Any) -> list[torch.Tensor]:
    """Return the floating-point tensors among the leaves of ``value``."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _error(a: Any, b: Any) -> float:
    """Return the largest relative error between the float tensors of two values (to b's scale)."""
    worst = 0.0
    for x, y in zip(_floats(a), _floats(b)):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().cpu().double(), y.detach().cpu().double()
        scale = y.abs().max().item() if y.numel() else 0.0
        diff = (x - y).abs().max().item() if y.numel() else 0.0
        worst = max(worst, diff / scale if scale else diff)
    return worst


def _run_stages(pipe, mb: list, values: dict[str, Any]) -> Any:
    """Run the stage graphs one after another on one micro-batch, recording every value."""
    plan = pipe.plan
    store: dict[str, Any] = {}
    out = None
    for j, stage in enumerate(pipe.stages):
        device = pipe.devices[j]
        inputs = mb if j == 0 else [store[v] for v in plan.stages[j].inputs]
        inputs = to_device(list(inputs), device)
        runner = _Runner(stage, values)
        state = {"gm." + k: v.to(device) for k, v in stage.named_parameters()}
        state.update({"gm." + k: v.to(device) for k, v in stage.named_buffers()})
        out = torch.func.functional_call(runner, state, tuple(inputs))
        if j < len(pipe.stages) - 1:
            store.update(zip(plan.stages[j].outputs, out))
    return out


def divergence(pipe, reference: nn.Module, args: tuple, kwargs: dict, rtol: float, atol: float,
               loss: Callable[[Any], torch.Tensor], seed: int = 0) -> str:
    """Return a report naming the first stage and node where ``pipe`` departs from ``reference``."""
    mbs, _ = pipe.runtime.binding.split(args, kwargs, pipe.plan.chunks, pipe.training, pipe.devices[0])
    mb = mbs[0]
    gm = pipe._gm
    stage_of = {name: s.index for s in pipe.plan.stages for name in s.nodes}
    nodes = {n.name: n for n in gm.graph.nodes}

    # eager on micro-batch 0: rebuild the call from the graph's placeholders
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        eager_out = _call_eager(reference, gm, names, mb, args, kwargs)
    traced: dict[str, Any] = {}
    split: dict[str, Any] = {}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            traced_out = _Recorder(gm, traced).run(*mb)
        except Exception as exc:  # noqa: BLE001 - e.g. its parameters sit on several devices
            return f"could not run the traced graph in one piece to compare with ({exc})"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        split_out = _run_stages(pipe, mb, split)

    def where(name: str) -> str:
        return f"stage {stage_of.get(name, '?')}, node {describe_node(gm, nodes[name])}"

    lines = []
    if eager_out is not None and _error(_finish(pipe, traced_out), eager_out) > rtol:
        lines.append(f"the traced graph's output differs from eager on micro-batch 0 (relative "
                     f"{_error(_finish(pipe, traced_out), eager_out):.2e}): the tracer changed the model, "
                     "before any split")
    order = [n.name for n in gm.graph.nodes if n.name in traced and n.name in split]
    for name in order:
        err = _error(split[name], traced[name])
        if err > max(rtol, atol):
            lines.append(f"forward first diverges at {where(name)}: relative error {err:.2e} "
                         f"against the traced graph on micro-batch 0")
            return "\n".join(lines)

    # forward agrees: compare gradients from the output back
    for out in (traced_out, split_out):
        value = loss(_finish(pipe, out))
        if value.requires_grad:
            value.backward()
    for name in reversed(order):
        grads_t = [t.grad for t in _floats(traced[name]) if t.grad is not None]
        grads_s = [t.grad for t in _floats(split[name]) if t.grad is not None]
        if len(grads_t) != len(grads_s) or _error(grads_s, grads_t) > max(rtol, atol):
            err = _error(grads_s, grads_t) if len(grads_t) == len(grads_s) else float("inf")
            users = ", ".join(repr(u.name) for u in nodes[name].users)
            lines.append(f"backward first diverges (from the output) at {where(name)}: the gradient "
                         f"flowing back into it from {users} has relative error {err:.2e} against "
                         f"the traced graph on micro-batch 0")
            return "\n".join(lines)
    if lines:  # the tracer changed the model: the split and the runtime reproduce what it traced
        lines.append("the stage graphs reproduce the traced graph node by node, forward and backward, on "
                     "micro-batch 0: the difference is the tracer's (above), not the pipeline's")
        return "\n".join(lines)
    lines.append("the stage graphs reproduce the traced graph node by node, forward and backward, "
                 "on micro-batch 0: the difference comes from the runtime (math that depends on the "
                 "batch composition, such as batch norm in training mode; checkpointing; copies), or from "
                 "float32 rounding on both sides: a gradient summing many terms that cancel (a convolution's "
                 "bias over every position of the batch) can carry more rounding in eager than the tolerance "
                 "allows. The float64 line above, where the report has one, tells which; else compare in float64 "
                 "(model.double() and double inputs)")
    random = [n.name for n in gm.graph.nodes if draws_random(gm, n)]
    if pipe.training and random and pipe.plan.chunks > 1:
        lines.append(f"the model draws random numbers in training mode ({', '.join(map(repr, random[:3]))}"
                     f"{', ...' if len(random) > 3 else ''}): each micro-batch draws its own (a dropout mask "
                     "of its rows), not the rows' share of the whole batch's draw, so outputs differ from "
                     "eager by design; compare in eval mode (model.eval()) or with chunks=1")
    return "\n".join(lines)


def _finish(pipe, output: Any) -> Any:
    """Rebuild the model's output structure from a graph's flat output."""
    return pipe.runtime.binding.finish(output)


def _call_eager(reference: nn.Module, gm, names: list[str], mb: list, args: tuple, kwargs: dict) -> Any:
    """Call the eager reference on micro-batch 0 (its inputs; under torch.export, rebuilt from the flat ones)."""
    device = next((t.device for t in reference.parameters()), torch.device("cpu"))
    mb = to_device(list(mb), device)
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None:  # flattened inputs (torch.export): the call's structure is the graph's input spec
        if info.in_spec is None:
            return None
        try:
            call_args, call_kwargs = tree_unflatten(mb, info.in_spec)
        except Exception:  # noqa: BLE001 - a diagnostic; the caller still fails on the real comparison
            return None
    else:
        n_args = len(args)
        call_args = mb[:n_args]
        call_kwargs = {name: value for name, value in zip(names[n_args:], mb[n_args:]) if name in kwargs}
    try:
        with torch.no_grad():
            return reference(*call_args, **call_kwargs)
    except Exception:  # noqa: BLE001 - a diagnostic; the caller still fails on the real comparison
        return None
