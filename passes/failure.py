"""Explain a graph node that fails on the example inputs while its values are propagated.

Reads:  ``node.meta["nn_module_stack"]`` (the modules a node was traced in) and
        ``gm.meta["fxpipe.tracer"]``.
Writes: nothing.

A model can run eagerly on its example inputs and still fail here: a symbolic tracer runs the
model's Python on ``torch.fx`` Proxies, and a check on a traced value (``torch.jit.isinstance(x,
torch.Tensor)``, ``isinstance(x, torch.Tensor)``, ``x is None``) is False for a Proxy, so a
branch silently disappears from the graph (MONAI's ``BasicUNet`` loses every skip this way).
The first node that sees wrong shapes then raises, far from the cause::

    eager:  x_e is a Tensor ──▶ conv(cat([x_e, up(x)]))        16 channels
    fx:     x_e is a Proxy  ──▶ conv(up(x))                      8 channels: conv fails

So the error names the failing node and the module it came from, and suggests
``tracer="export"``, which traces the code the model really runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx

__all__ = ["PropagationError", "explain", "refuse_not_dense"]


class PropagationError(RuntimeError):
    """A node of the traced graph failed on the example inputs; names the node and its module."""

    def __init__(self, message: str, node: str, module: str | None) -> None:
        super().__init__(message)
        self.node = node
        self.module = module


_NOT_DENSE = ("fxpipe can neither measure it on fake tensors, send it between stages nor split it into "
              "micro-batches by rows: make it dense where it is made (sparse: .to_dense(), or its indices and "
              "values as dense tensors aggregated with index_add_; nested: nt.to_padded_tensor(0) with each "
              "sample's length or a mask)")


def refuse_not_dense(gm: torch.fx.GraphModule, node: torch.fx.Node, tensors: list[torch.Tensor]) -> None:
    """Raise a PropagationError naming ``node`` if one of the ``tensors`` of its value is sparse or nested."""
    for t in tensors:
        if t.is_nested or t.layout != torch.strided:
            where, module, _ = _where(gm, node)
            kind = "a nested tensor (torch.nested)" if t.is_nested else f"a sparse tensor ({t.layout})"
            raise PropagationError(f"{where} makes {kind}: {_NOT_DENSE}", node.name, module)


def _where(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[str, str | None, list]:
    """Return how messages name ``node`` (with its module), the module's path, and the node's module stack."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
    what = f"{node.op} {target}"
    if node.op == "call_module":
        what += f": {type(gm.get_submodule(str(node.target))).__name__}"
    stack = [(path, kind) for path, kind in (node.meta.get("nn_module_stack") or {}).values()
             if path and not (node.op == "call_module" and path == node.target)]
    module = stack[-1][0] if stack else None
    return f"node '{node.name}' ({what})" + (f" in module '{module}' ({_name(stack[-1][1])})" if stack else ""), \
        module, stack


def _fixed_nones(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[str]:
    """Return the inputs the trace fixed to ``None`` (``concrete_args``) if ``node`` takes a literal ``None``."""
    leaves: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
    if not any(a is None for a in leaves):
        return []
    return [str(p.target).rsplit("_", 1)[0] for p in gm.graph.nodes
            if p.op == "placeholder" and "fxpipe.fixed" in p.meta and p.meta["fxpipe.fixed"] is None]


def explain(gm: torch.fx.GraphModule, node: torch.fx.Node, exc: Exception, on: str = "the example inputs",
            advise: bool = True, nones: Sequence[str] = ()) -> PropagationError:
    """Name the node that raised ``exc`` on inputs ``on``, its module, and (``advise``) the likely cause.

    ``nones``: the node's inputs that are placeholders holding None (named first in the advice).
    """
    where, module, stack = _where(gm, node)
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    message = f"{where} fails on {on}: {type(exc).__name__}: {first}"
    if "shape_env must not be None" in str(exc):  # a jagged nested tensor made on fake tensors
        return PropagationError(f"{message}\nThis is how a nested (jagged) tensor made in the node fails: "
                                f"{_NOT_DENSE}", node.name, module)
    inputs = [a.target for a in node.all_input_nodes if a.op == "placeholder"]
    fixed = _fixed_nones(gm, node) if advise and "NoneType" in str(exc) and not nones else []
    if fixed:  # traced with the input fixed to None (eager's path), and still used as a value
        message += (f"\nInput '{fixed[0]}' is None here (fixed to None, its example's value, so the graph runs the "
                    f"code eager runs for None), and this node uses it as a value: eager fails the same way. Pass "
                    f"{fixed[0]}= a tensor (in the example too), or guard the code using it with "
                    f"`if {fixed[0]} is not None:`.")
        return PropagationError(message, node.name, module)
    if advise and "NoneType" in str(exc) and inputs and getattr(gm, "meta", {}).get("fxpipe.tracer") != "export":
        name = nones[0] if nones else inputs[0]
        message += (
            f"\nInput '{name}' is None here, but torch.fx traced it as a value: a check such as `{name} is not None` "
            f"holds for a traced value, so the code using it was kept. Pass {name}= a tensor (in the example too), "
            f"fix it to None (gm = fxpipe.trace(model, concrete_args={{'{name}': None}}), then fxpipe.compile(gm, "
            f"...)), or use tracer='export', which traces the code the model runs on its example.")
        return PropagationError(message, node.name, module)
    if advise and type(exc).__module__.startswith("torch._dynamo"):  # torch.compile inside the node (flex_attention's)
        message += (
            "\nThe node runs torch.compile inside (flex_attention does, even called eagerly), which cannot run on the "
            "fake tensors fxpipe measures the graph with. Use tracer='export' (which traces flex_attention itself; "
            "build its block mask inside the forward), or compile without example_inputs= (balance_by='params').")
        return PropagationError(message, node.name, module)
    if advise and getattr(gm, "meta", {}).get("fxpipe.tracer") != "export":
        owners = list(dict.fromkeys(_name(kind) for _, kind in reversed(stack) if not _from_torch_nn(kind)))
        around = (f" (or, where the check is in a module around it, {' or '.join(f'[{o}]' for o in owners[1:])}: "
                  "the branch dropped may be one that feeds this node)") if len(owners) > 1 else ""
        leaf = (f", or keep the module that holds the check whole with leaf_modules="
                f"[{owners[0]}]{around}") if owners else ""
        message += (
            "\nIf the model runs on these inputs eagerly, tracing changed its data flow: a check "
            "on a traced value (torch.jit.isinstance(x, torch.Tensor), isinstance(x, torch.Tensor), "
            "x is None) sees a torch.fx Proxy instead of the tensor, so a branch was dropped. Use "
            f"tracer='export', which traces the code the model really runs{leaf}. If it does not, the "
            "example inputs do not fit the model (an image too small for its pooling, a channel count "
            "its first layer does not take): give inputs the model runs on.")
    return PropagationError(message, node.name, module)


def _from_torch_nn(kind: Any) -> bool:
    """Tell whether a module class (or its name, as torch.export records it) is torch.nn's own."""
    return (kind.__module__ if isinstance(kind, type) else str(kind)).startswith("torch.nn")


def _name(kind: Any) -> str:
    """Return a module class's name (torch.export records a qualified name as a string)."""
    return kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
