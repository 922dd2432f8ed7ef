"""Split a backward graph into its input-gradient part (``I``) and its weight-gradient part (``W``).

Reads:  a backward GraphModule (AOT autograd's: placeholders are the saved values, symbolic
        sizes and tangents; the output is one tuple of gradients) and the positions of that
        tuple that hold weight gradients.
Writes: nothing in the given graph; returns two new GraphModules (their nodes keep ``meta``).

Zero bubble runs a stage's backward in two steps: ``I`` computes the gradients of the stage's
inputs, which the previous stage waits for, and ``W`` the gradients of its weights, which
nobody waits for. In one backward graph the split is a cut of the nodes::

    saved values, tangents ──▶ [ nodes the input gradients need ] ──▶ input gradients   (I)
                      │                       │ carried values
                      └──────────────────▶ [ the other nodes ] ──▶ weight gradients     (W)

``I`` holds every node an input gradient depends on (the chain of ``dx = dy @ Wᵀ`` GEMMs and
the pointwise backward between them); ``W`` holds the rest (the ``dW = dyᵀ x`` GEMMs, the bias
and norm-weight reductions). ``I`` returns the input gradients and the *carried* values: the
ones it computed that ``W`` reads (``dy`` of each linear). Saved values and symbolic sizes that
only ``W`` reads are handed to it from the backward's own arguments, never passed through ``I``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

__all__ = ["GradSplit", "split_weight_grads"]


@dataclass
class GradSplit:
    """The two halves of a backward graph and how their values map back to its output tuple."""

    inputs: torch.fx.GraphModule  # I: the backward's arguments -> input-grad outputs + carried values
    weights: torch.fx.GraphModule  # W: taken arguments + carried values -> weight-grad outputs
    input_positions: list[int]  # where each of I's first outputs goes in the backward's output tuple
    weight_positions: list[int]  # where each of W's outputs goes
    taken: list[int]  # the backward's argument positions W reads directly (before the carried values)
    n_outputs: int  # the length of the backward's output tuple

    @property
    def carried(self) -> int:
        """Return how many values I hands to W (the outputs after the input gradients)."""
        return len(_outputs(self.inputs.graph)) - len(self.input_positions)


def _outputs(graph: torch.fx.Graph) -> list:
    """Return the output tuple of ``graph`` as a list."""
    node = next(n for n in reversed(graph.nodes) if n.op == "output")
    out = node.args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _ancestors(roots: Iterable) -> set[torch.fx.Node]:
    """Return the nodes the given values depend on, themselves included."""
    seen: set[torch.fx.Node] = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def split_weight_grads(backward: torch.fx.GraphModule, weight_outputs: Iterable[int]) -> GradSplit:
    """Cut ``backward`` into ``I`` and ``W``: the outputs at ``weight_outputs`` are computed by ``W``.

    An output at one of those positions that ``I`` computes anyway (a value an input gradient
    needs too) is carried to ``W`` and returned from there. Nothing is recomputed: each node
    runs in exactly one of the two graphs.
    """
    graph = backward.graph
    outs = _outputs(graph)
    wanted = set(weight_outputs)
    weight_pos = [k for k, v in enumerate(outs) if k in wanted and isinstance(v, torch.fx.Node)]
    input_pos = [k for k in range(len(outs)) if k not in weight_pos]
    for_inputs = _ancestors(outs[k] for k in input_pos)
    only_weights = _ancestors(outs[k] for k in weight_pos) - for_inputs
    # An element of a tuple I computes (a batch norm's backward: the input's, the weight's and the bias's
    # gradients) is taken in I, so that I hands W tensors, never the tuple (inductor returns tensors only).
    for_inputs |= {n for n in only_weights if n.op == "call_function" and n.target is operator.getitem
                   and n.args[0] in for_inputs}
    only_weights -= for_inputs
    w_nodes = [n for n in graph.nodes if n in only_weights and n.op != "placeholder"]
    in_w = set(w_nodes)
    w_results = {outs[k] for k in weight_pos}
    boundary = [n for n in graph.nodes if n not in in_w and n.op != "output"
                and (n in w_results or any(u in in_w for u in n.users))]
    taken = [n for n in boundary if n.op == "placeholder"]
    # and the backward's size arguments: a symbol of W's input shapes (8*s4) needs its source, which
    # inductor's generated code binds from them (aot_eager ran without; inductor failed "expected [s4]")
    taken += [n for n in graph.nodes if n.op == "placeholder" and n not in taken
              and isinstance(n.meta.get("val"), torch.SymInt)]
    carried = [n for n in boundary if n.op != "placeholder"]

    i_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or (node in for_inputs and node.op != "output"):
            env[node] = i_graph.node_copy(node, env.__getitem__)
    i_graph.output(tuple([env[outs[k]] if isinstance(outs[k], torch.fx.Node) else outs[k] for k in input_pos]
                         + [env[n] for n in carried]))

    w_graph = torch.fx.Graph()
    w_env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in taken + carried:
        w_env[node] = w_graph.placeholder(node.name)
        w_env[node].meta = dict(node.meta)
    for node in w_nodes:
        w_env[node] = w_graph.node_copy(node, w_env.__getitem__)
    w_graph.output(tuple(w_env[outs[k]] for k in weight_pos))

    position = {n: k for k, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    return GradSplit(torch.fx.GraphModule(backward, i_graph), torch.fx.GraphModule(backward, w_graph),
                     input_pos, weight_pos, [position[n] for n in taken], len(outs))
