"""Follow a tensor-parallel plan through a graph: which values each rank holds a shard of, on which dim.

Reads:  ``node.meta["fxpipe.value"]`` (global shapes, :func:`fxpipe.passes.annotate`) and a
        :class:`Rule` per styled site (a linear, an embedding or another leaf module call the
        plan parallelizes), keyed by node name.
Writes: ``node.meta["fxpipe.tp"]`` with ``record=True``: the layout of the node's value on a rank.

A layout is what one rank holds, the graph's shapes being the global ones::

    None   the whole value (replicated), or no tensor       "D"    a DTensor (global semantics)
    d      a local shard: 1/t of dim d                       "L"    a sharded dim's local size (an int)
    (..)   per element of a tuple (``split``, ``size()``)

Megatron's MLP at t=2, hidden 768 (the colwise linear's output is a local shard of its last dim;
the rowwise one all-reduces its partial sums into the whole)::

    x (b,s,768) None ─▶ fc1 colwise ─▶ (b,s,3072) 2 ─▶ gelu ─▶ 2 ─▶ fc2 rowwise ─▶ (b,s,768) None

A node whose inputs cannot run on a shard (a norm over the sharded dim, a replicated operand
of full size beside a shard, a linear not in the plan reading a shard) is a :class:`Conflict`;
the automatic pairing (:mod:`fxpipe.passes.tpauto`) grows its pairs from these, a written plan
is refused on the first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from fxpipe.passes.spec import TensorSpec
from fxpipe.passes.tpops import ndim_of, shape_of
from fxpipe.passes.tprules import Refusal, through
from torch.utils._pytree import tree_flatten

__all__ = ["Conflict", "Rule", "local_shape", "localize", "module_of", "propagate", "site_input"]


@dataclass(frozen=True)
class Rule:
    """What a styled site reads (``takes``) and gives: ``R`` whole, ``S<d>`` a local shard, ``D`` a DTensor.

    ``takes`` may list alternatives (``"S-1|D"``) or be ``"*"``; ``style`` names the style in messages.
    """

    takes: str
    gives: str
    style: str = ""


@dataclass
class Conflict:
    """A node that cannot run under the plan: its kind, why, and the values in the way."""

    node: str
    kind: str  # "mixed" | "input" | "indivisible" | "unsupported" | "dtensor" | "output"
    message: str
    module: str | None = None  # the module the node was traced in
    replicated: list[str] = field(default_factory=list)  # "mixed": the whole operands beside a shard
    size: int | None = None  # "indivisible": the size t does not divide


def module_of(node: torch.fx.Node) -> str | None:
    """Return the innermost module a node was traced in (its target for a module call)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else None


def site_input(node: torch.fx.Node) -> Any:
    """Return the value a site reads: a module's first input, a linear's input, an embedding's indices."""
    target = node.target
    if node.op == "call_function" and target is torch.ops.aten.embedding.default:
        return node.args[1]
    return node.args[0] if node.args else next(iter(node.kwargs.values()), None)


def _accepts(takes: str, got: Any, nd: int | None) -> bool:
    """Tell whether a site expecting ``takes`` can read a value of layout ``got``."""
    for token in takes.split("|"):
        if token == "*" or (token == "R" and got is None) or (token == "D" and got == "D"):
            return True
        if token.startswith("S") and isinstance(got, int) and nd and int(token[1:]) % nd == got:
            return True
    return False


def _gives(token: str, nd: int | None) -> Any:
    """Return the layout a site's output token means for an output of ``nd`` dims."""
    if token == "R":
        return None
    if token == "D":
        return "D"
    return int(token[1:]) % (nd or 1)


def _describe(layout: Any) -> str:
    """Name a layout for a message."""
    if layout is None:
        return "the whole value"
    if layout == "D":
        return "a DTensor"
    return f"a shard of dim {layout}"


def propagate(gm: torch.fx.GraphModule, rules: Mapping[str, Rule], t: int, *, dtensors: frozenset[str] = frozenset(),
              record: bool = False) -> tuple[dict[str, Any], list[Conflict]]:
    """Return every node's layout under ``rules`` (only those not ``None``) and the conflicts, in graph order.

    ``dtensors`` are the ``get_attr`` targets the plan makes DTensors (sharded parameters read
    directly). After a conflict the node's value counts as whole, so propagation goes on.
    """
    lay: dict[torch.fx.Node, Any] = {}
    conflicts: list[Conflict] = []
    modules = dict(gm.named_modules())

    def layout(a: Any) -> Any:
        return lay.get(a) if isinstance(a, torch.fx.Node) else None

    for node in gm.graph.nodes:
        if node.name in rules:
            _site(node, rules[node.name], layout, lay, conflicts)
        elif node.op == "get_attr":
            if node.target in dtensors:
                lay[node] = "D"
        elif node.op == "output":
            leaves = [a for a in tree_flatten(node.args)[0] if isinstance(a, torch.fx.Node) and layout(a) is not None]
            for a in leaves:
                conflicts.append(Conflict(a.name, "output", f"the model returns '{a.name}' as {_describe(layout(a))}, "
                                          "not whole; end its region with a rowwise (or output-gathering) style",
                                          module_of(a)))
        elif node.op != "placeholder" and any(layout(a) is not None for a in node.all_input_nodes):
            try:
                value = through(node, layout, t, modules.__getitem__)
            except Refusal as exc:
                conflicts.append(Conflict(node.name, exc.kind, str(exc), module_of(node),
                                          [a.name for a in exc.replicated], exc.size))
                value = None
            if value is not None and not (isinstance(value, tuple) and all(v is None for v in value)):
                lay[node] = value
    if record:
        for node in gm.graph.nodes:
            node.meta.pop("fxpipe.tp", None)
            if node in lay:
                node.meta["fxpipe.tp"] = lay[node]
    return {n.name: v for n, v in lay.items()}, conflicts


def _site(node: torch.fx.Node, rule: Rule, layout: Callable, lay: dict, conflicts: list[Conflict]) -> None:
    """Check what a styled site reads; set what it gives."""
    x = site_input(node)
    got = layout(x)
    if not _accepts(rule.takes, got, ndim_of(x)):
        conflicts.append(Conflict(node.name, "input", f"{rule.style} on '{module_of(node)}' reads {_describe(got)} "
                                  f"(from '{getattr(x, 'name', x)}') but expects "
                                  f"{' or '.join(_describe(_gives(k, ndim_of(x))) for k in rule.takes.split('|'))}",
                                  module_of(node), [] if got is not None else [getattr(x, "name", "")]))
    value = _gives(rule.gives, ndim_of(node))
    if value is not None:
        lay[node] = value


def localize(spec: Any, layout: Any, t: int) -> Any:
    """Return the spec a rank holds of a value of global ``spec`` and ``layout`` (its receive buffer)."""
    if isinstance(layout, tuple) and isinstance(spec, (tuple, list)):
        return type(spec)(localize(s, lo, t) for s, lo in zip(spec, layout))
    if isinstance(layout, int) and isinstance(spec, TensorSpec):
        shape = list(spec.shape)
        shape[layout] //= t
        return replace(spec, shape=tuple(shape))
    return spec


def local_shape(node: torch.fx.Node, t: int) -> tuple[int, ...] | None:
    """Return the shape a rank holds of a node's value (recorded layouts)."""
    shape = shape_of(node)
    d = node.meta.get("fxpipe.tp")
    if shape is None or not isinstance(d, int):
        return shape
    return tuple(s // t if k == d else s for k, s in enumerate(shape))

