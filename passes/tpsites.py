"""Find the places a tensor-parallel plan can name: module calls, and linears and embeddings by their module.

Reads:  ``call_module`` nodes (their modules), ``call_function`` nodes of ``F.linear`` /
        ``aten.linear`` and ``F.embedding`` / ``aten.embedding`` whose weight is a ``get_attr``,
        and ``node.meta["nn_module_stack"]`` (the module a ``torch.export`` node came from).
Writes: nothing.

A plan names modules by FQN, as ``parallelize_module`` does. The ``torch.fx`` front end keeps
``nn.Linear`` and ``nn.Embedding`` calls as ``call_module`` nodes whose target is the FQN;
``torch.export`` flattens them to ATen calls that remember their module in ``nn_module_stack``
(``model.layers.0.self_attn.q_proj``). Either way a :class:`Site` gets the module's FQN, so one
plan serves both front ends. A functional call with no module of its own (``F.linear(h,
self.embed.weight)`` in the model's own forward) is named after its weight's module when no
module call has that name; otherwise it is no site (the plan cannot style it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from fxpipe.passes.linears import LINEARS
from fxpipe.passes.tplayout import module_of

__all__ = ["EMBEDDINGS", "Site", "find_sites"]

EMBEDDINGS = (F.embedding, torch.ops.aten.embedding.default)


@dataclass
class Site:
    """A module call a plan can style: its FQN, kind, the nodes calling it, its weight and sizes."""

    fqn: str
    kind: str  # "linear" | "embedding" | "module" (another leaf module)
    nodes: list[str] = field(default_factory=list)
    weight: Any = None  # the weight tensor (a linear's or an embedding's)
    bias: Any = None
    module_type: str = ""
    functional: bool = False  # a functional call (torch.export), made a module call at build

    @property
    def out_features(self) -> int:
        """Return a linear's output features or an embedding's vocabulary (rows of its weight)."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """Return a linear's input features or an embedding's width (columns of its weight)."""
        return int(self.weight.shape[1])


def _attr(gm: torch.fx.GraphModule, node: Any) -> Any:
    """Return the tensor a ``get_attr`` node reads (None for anything else)."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def find_sites(gm: torch.fx.GraphModule) -> dict[str, Site]:
    """Return every site of ``gm`` by FQN, in graph order."""
    sites: dict[str, Site] = {}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            kind = "linear" if isinstance(mod, torch.nn.Linear) else \
                "embedding" if isinstance(mod, torch.nn.Embedding) else "module"
            site = sites.setdefault(str(node.target), Site(str(node.target), kind, weight=getattr(mod, "weight", None),
                                                           bias=getattr(mod, "bias", None),
                                                           module_type=type(mod).__name__))
            site.nodes.append(node.name)
        elif node.op == "call_function" and (node.target in LINEARS or node.target in EMBEDDINGS):
            _functional(gm, node, sites, called)
    return sites


def _functional(gm: torch.fx.GraphModule, node: torch.fx.Node, sites: dict[str, Site], called: set[str]) -> None:
    """Add a functional linear or embedding whose weight is a parameter, under its module's FQN."""
    linear = node.target in LINEARS
    args: list[Any] = list(node.args) + [None] * 3
    w: Any
    b: Any
    if linear:
        w, b = node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    else:
        w, b = (args[0], None) if node.target is torch.ops.aten.embedding.default else \
            (node.kwargs.get("weight", args[1]), None)
    weight, bias = _attr(gm, w), _attr(gm, b)
    if weight is None or weight.dim() != 2 or (b is not None and bias is None):
        return
    fqn = module_of(node)
    if fqn is None or fqn in called:
        fqn = str(w.target).rpartition(".")[0]
        if not fqn or fqn in called:
            return
    kind = "linear" if linear else "embedding"
    site = sites.setdefault(fqn, Site(fqn, kind, weight=weight, bias=bias, functional=True,
                                      module_type="Linear" if linear else "Embedding"))
    if site.kind == kind and site.weight is weight:
        site.nodes.append(node.name)
