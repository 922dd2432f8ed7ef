"""Lower a sequence of layer groups with ``@skippable`` layers to a torch.fx graph fxpipe can split.

torch.fx cannot trace a generator ``forward``, and torchgpipe's layers are black boxes anyway
(it only ever calls them). So the graph is built, not traced: one ``call_module`` node per
group (a partition of a :class:`GPipe`, or a single layer when balancing), which runs the
group under a skip tracker of its own (:class:`GroupCall`). The skips a group pops from
earlier groups are extra inputs of its node; those it stashes for later groups are extra
outputs, taken apart by ``getitem`` nodes. Skips stashed and popped inside one group never
leave it::

    input ─▶ partition_0 ─[0]─▶ partition_1 ─[0]─▶ partition_2 ─[0]─▶ output
                  │ [1] "1to3"                          ▲
                  └─────────────────────────────────────┘   (an fxpipe skip route)

fxpipe's split pass then makes each such edge a boundary value (next group) or a stash/pop
skip route (a later group), sent straight from the stage that makes it to the stage that
uses it. Within a group, the layer order, hooks and checkpointing are exactly those of
calling the group as a module.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe.compat.torchgpipe.skip.layout import Key, SkipLayout
from fxpipe.compat.torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["GroupCall", "check_tensors", "lower"]


def check_tensors(value: Any, what: str) -> None:
    """Raise TypeError unless ``value`` is a tensor or a tuple of tensors (GPipe's contract)."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return
    bad = type(value).__name__ if not isinstance(value, tuple) else (
        "a tuple holding " + ", ".join(sorted({type(v).__name__ for v in value if not isinstance(v, torch.Tensor)})))
    raise TypeError(f"expected Tensor or Tensors as {what}, but got {bad}; GPipe passes a tensor or "
                    "a tuple of tensors into, between and out of its partitions")


class GroupCall(nn.Module):
    """Call a group of layers under its own skip tracker; return its output and outgoing skips."""

    def __init__(self, group: nn.Module, what: str, pops: Sequence[Key], stashes: Sequence[Key]) -> None:
        super().__init__()
        self.group = group
        self.what = what
        self.pops = list(pops)
        self.stashes = list(stashes)

    def forward(self, input: Any, *popped: Any) -> tuple:
        """Run the group with ``popped`` ready for its pops; return ``(output, *stashed skips)``."""
        tracker = SkipTracker(dict(zip(self.pops, popped)))
        with use_skip_tracker(tracker):
            output = self.group(input)
        check_tensors(output, f"the output of {self.what}")
        return (output, *(tracker.tensors[key] for key in self.stashes))

    def extra_repr(self) -> str:
        """Show the group and its skips."""
        return (f"{self.what}, pops={[name for _, name in self.pops]}, "
                f"stashes={[name for _, name in self.stashes]}")


def lower(groups: Sequence[nn.Module], layout: SkipLayout, prefix: str = "partition",
          name: str = "GPipe") -> tuple[torch.fx.GraphModule, list[str]]:
    """Build the graph running ``groups`` in order with ``layout``'s skips as edges.

    Returns the GraphModule (its submodule ``groups.j`` is the :class:`GroupCall` of group
    ``j``) and the name of each group's node, ``f"{prefix}_{j}"``: the split points where
    stages begin.
    """
    calls = [GroupCall(g, f"{prefix} {j}", layout.pops(j), layout.stashes(j)) for j, g in enumerate(groups)]
    root = nn.Module()
    root.groups = nn.ModuleList(calls)
    graph = torch.fx.Graph()
    value: torch.fx.Node = graph.placeholder("input")
    skips: dict[Key, torch.fx.Node] = {}
    names = []
    for j, call in enumerate(calls):
        node = graph.create_node("call_module", f"groups.{j}", (value, *(skips[k] for k in call.pops)),
                                 name=f"{prefix}_{j}")
        names.append(node.name)
        value = graph.create_node("call_function", operator.getitem, (node, 0), name=f"{prefix}_{j}_out")
        for k, key in enumerate(call.stashes, 1):
            skips[key] = graph.create_node("call_function", operator.getitem, (node, k),
                                           name=f"skip_{key[1]}")
    graph.output(value)
    return torch.fx.GraphModule(root, graph, name), names
