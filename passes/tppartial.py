"""Find the whole parameters whose gradient each tensor-parallel rank computes only in part.

Reads:  ``node.meta["fxpipe.tp"]`` (:func:`fxpipe.passes.tplayout.propagate` with ``record=True``)
        and ``node.meta["fxpipe.value"]`` (whether a value requires grad).
Writes: nothing.

A parameter left whole (not a DTensor) that an op combines with a shard, such as Qwen3's
per-head ``q_norm`` weight on the heads one rank holds, gets from each rank the gradient of
that rank's heads only::

    q (b,s,h,d) shard of h ─▶ rms_norm ─▶ * q_norm.weight (d) whole ─▶ shard of h
    backward on rank r:  q_norm.weight.grad = Σ over rank r's heads   (eager: over all heads)

Hugging Face marks these ``replicated_with_grad_allreduce``; the runtime sums their gradients
over the group after each step (:mod:`fxpipe.runtime.tppartial`). A whole value computed from
activations that carries a gradient, beside a shard, would leave a partial gradient in the
activations upstream instead; :func:`activation_beside_shard` finds it and the layout refuses it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["activation_beside_shard", "mixed_params", "params_only", "partial_params"]


def _sharded(layout: Any) -> bool:
    """Tell whether a layout holds a shard of some dim."""
    if isinstance(layout, tuple):
        return any(_sharded(v) for v in layout)
    return isinstance(layout, int) and not isinstance(layout, bool)


def _requires_grad(node: torch.fx.Node) -> bool:
    """Tell whether the value a node made (any tensor of it) requires grad."""
    value = node.meta.get("fxpipe.value")
    values = value if isinstance(value, (tuple, list)) else [value]
    return any(getattr(v, "requires_grad", False) for v in values)


def params_only(node: torch.fx.Node) -> bool:
    """Tell whether a value is computed from parameters, buffers and constants alone (no model input)."""
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "call_module"):
            return False
        todo.extend(n.all_input_nodes)
    return True


def activation_beside_shard(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` (a whole operand beside a shard) is an activation that carries a gradient."""
    return _requires_grad(node) and not params_only(node)


def partial_params(gm: torch.fx.GraphModule) -> list[str]:
    """Return the names of ``gm``'s parameters left whole that an op combines with a shard.

    Both a ``get_attr`` read into an op with a sharded result (directly or through ops on
    parameters alone) and the parameters of a module called on a shard (a norm that is not a
    styled site). A styled site's weights may be among the names: they are DTensors at run
    time, whose gradients PyTorch reduces itself, and the runtime skips them.
    """
    return list(_uses(gm)[0])


def mixed_params(gm: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    """Return the parameters used both beside a shard and on whole values: name -> (a sharded use, a whole one).

    Summing such a gradient over the group would count its whole part once per rank; the plan refuses them.
    """
    beside, whole = _uses(gm)
    return {name: (beside[name], whole[name]) for name in beside if name in whole}


def _uses(gm: torch.fx.GraphModule) -> tuple[dict[str, str], dict[str, str]]:
    """Return, per trainable parameter left whole, a node that uses it beside a shard, and one that uses it whole."""
    beside: dict[str, str] = {}
    whole: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op != "call_module" and params_only(node)):
            continue  # ops on parameters alone: their users decide
        sharded = _sharded(node.meta.get("fxpipe.tp"))
        if node.op == "call_module":
            on_shard = any(_sharded(a.meta.get("fxpipe.tp")) for a in node.all_input_nodes)
            mine = beside if sharded and on_shard else whole
            for name, p in gm.get_submodule(str(node.target)).named_parameters():
                if p.requires_grad:
                    mine.setdefault(f"{node.target}.{name}", node.name)
        mine = beside if sharded else whole
        for a in node.all_input_nodes:
            if a.meta.get("fxpipe.tp") is None and params_only(a):
                for name in _params_under(gm, a):
                    mine.setdefault(name, node.name)
    return beside, whole


def _params_under(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[str]:
    """Return the trainable parameters a value computed from parameters alone reads."""
    out, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            try:
                p = gm.get_parameter(str(n.target))
            except AttributeError:  # a buffer or a constant
                continue
            if p.requires_grad:
                out.append(str(n.target))
        todo.extend(n.all_input_nodes)
    return out
