"""Which nodes zero bubble splits: linears whose weight gradients can wait for a ``W`` step.

Reads:  call_module nodes of modules of exactly type ``nn.Linear`` and call_function nodes of
        ``F.linear`` (``aten.linear`` from ``torch.export``), and their weights.
Writes: ``node.meta["fxpipe.needs_grad"]`` on every node, the first time :func:`model_defers`
        asks (whether its value reaches back to a parameter that wants a gradient).

The runtime rewrites exactly these nodes to defer their weight gradients
(``fxpipe.runtime.stage.wgrad``), and the simulator gives exactly these a ``W`` share of their
backward, so both agree: a frozen weight (no gradient wanted) and a run under autocast (the
runtime then computes the gradients at once) defer nothing. A rewritten linear defers only when
its input requires a gradient, which a stage's inputs from other stages do and the model's own
inputs do not: :func:`model_defers` says which linears of the whole model defer.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["HOOK_KINDS", "LINEARS", "defers_weight_grad", "hooked", "model_defers", "tensor_hooked"]

LINEARS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)


def _wants_grad(gm: torch.fx.GraphModule, value: object) -> bool:
    """Tell whether a linear's weight or bias argument is a parameter that wants a gradient (None: yes)."""
    if value is None:
        return True
    if isinstance(value, torch.fx.Node):
        if value.op != "get_attr":
            return False  # computed: not a leaf whose .grad could take the gradient later
        try:
            value = gm.get_parameter(str(value.target))
        except AttributeError:
            return False
    return isinstance(value, torch.Tensor) and value.requires_grad and not tensor_hooked(value)


def tensor_hooked(p: torch.Tensor) -> bool:
    """Tell whether a parameter has gradient hooks (``register_hook``, post-accumulate), which a ``W`` step skips."""
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def defers_weight_grad(gm: torch.fx.GraphModule, node: torch.fx.Node, autocast: bool = False) -> bool:
    """Tell whether zero bubble defers ``node``'s weight gradient to ``W`` (never under ``autocast``)."""
    if autocast:
        return False
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return type(mod) is nn.Linear and not node.kwargs and _wants_grad(gm, mod.weight) \
            and (mod.bias is None or _wants_grad(gm, mod.bias)) and not hooked(mod) \
            and "forward" not in vars(mod)  # a forward replaced on the instance: linear() would skip it
    if node.op == "call_function" and node.target in LINEARS:
        args = list(node.args) + [None] * 3
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        return _wants_grad(gm, weight) and _wants_grad(gm, bias)
    return False


#: A module's own hook dictionaries, and what each holds (the front end names them in its warning).
HOOK_KINDS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
              ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))


def hooked(mod: nn.Module) -> bool:
    """Tell whether a module has hooks of its own, which a call of ``linear`` in its place would skip."""
    return any(getattr(mod, attr, None) for attr, _ in HOOK_KINDS)


def model_defers(gm: torch.fx.GraphModule, node: torch.fx.Node, autocast: bool = False) -> bool:
    """Tell whether ``node`` of the whole model defers its weight gradient: its input must need a gradient too."""
    return defers_weight_grad(gm, node, autocast) and bool(node.args) and _needs_grad(gm, node.args[0])


def _needs_grad(gm: torch.fx.GraphModule, value: object) -> bool:
    """Tell whether ``value`` (a linear's input) reaches back to a parameter that wants a gradient."""
    if not isinstance(value, torch.fx.Node):
        return False
    if "fxpipe.needs_grad" not in value.meta:  # once per graph, in its (topological) order
        for n in gm.graph.nodes:
            n.meta["fxpipe.needs_grad"] = (
                n.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(n.target)).parameters())
                or n.op == "get_attr" and _wants_grad(gm, n)
                or any(a.meta["fxpipe.needs_grad"] for a in n.all_input_nodes))
    return bool(value.meta["fxpipe.needs_grad"])
