"""Tell which 0-dim outputs of a graph are not a mean (or sum) of per-row terms.

Reads:  ``fxpipe.value`` of every node (the example batch's specs), and the graph, which it
        runs once more on fake tensors for a micro-batch's rows (:mod:`fxpipe.passes.infer`).
Writes: nothing; :func:`classify_outputs` returns one description per such output, the 0-dim
        outputs that are sums or means over the rows, and the outputs the batch does not change.

``pipe.step`` averages a loss over the micro-batches, weighted by their rows: the batch's value
when the loss is a mean over rows of terms each row makes alone (a cross-entropy, a
mean-squared error). A 0-dim output that combines values reduced over the batch is not: a
mixture-of-experts load-balancing loss multiplies each expert's share of the batch's tokens
by its mean router probability; per micro-batch that product is another number. Shapes
cannot tell (both are 0-dim), so the nodes are classed by what they do with the batch::

    R  rows: its shape follows the batch (it changes for a micro-batch's rows)
    M  a mean over rows: mean / a mean-reduced loss over R, then sums and constant scalings of M
    S  a sum over rows: sum / a sum-reduced loss over R, then sums and constant scalings of S
    L  linear in the rows otherwise: M and S mixed, or scaled by a size of the batch's values
       (scaled by a value every micro-batch has alike, a parameter or an input given whole such as
       Hugging Face's ``num_items_in_batch``, M and S stay what they are)
    C  coupled: two reductions multiplied or divided, a non-linear function of one, a row
       picked out (x[0]), a max over the batch; or rows compared with one another: a value
       with two dims following the batch (in-batch negatives' scores ``q @ d.T``, ``(B, B)``)
    K  independent of the batch: parameters, constants, sizes

A 0-dim output of class C is reported, and one of class S: ``pipe.step`` must add its
micro-batches' values, not average them (M under ``loss_reduction="sum"`` is the converse). An
output of class K (a learned temperature, an input every micro-batch gets whole) is every
micro-batch's alike: ``pipe(x)`` takes the first's. A value whose shape follows the batch is R even where
a reduction feeds back into it (batch norm's statistics, a mixture of experts' token counts
used to dispatch the rows): such coupling is batch norm's, documented on its own, and the
rows a router dispatches stay each its own (unless a capacity drops some: which, depends on the
micro-batch's rows, and is documented rather than found). Ops this pass does not know are C when they take
an L or R input and keep their shape, so an unknown op warns rather than passes silently.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any, NamedTuple

import torch
import torch.fx
from fxpipe.passes.batchrows import _leaves, micro_specs
from fxpipe.passes.modes import When
from fxpipe.passes.spec import TensorSpec
from torch.utils._pytree import tree_flatten

__all__ = ["Outputs", "classify_outputs", "coupled_scalars"]

# Ops taking L (and K) values to an L value: sums, scalings by a constant, casts and views.
_LINEAR = {"add", "sub", "rsub", "neg", "mul", "div", "truediv", "true_divide", "iadd", "isub", "imul", "itruediv",
           "clone", "detach", "alias", "to", "_to_copy", "float", "double", "half", "bfloat16", "type_as", "contiguous",
           "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "flatten", "expand", "getitem", "stack", "cat",
           "sum", "mean", "nansum", "lift_fresh_copy", "copy", "pick", "positive", "add_", "sub_", "mul_", "div_"}
_MEANS, _SUMS = {"mean", "nanmean"}, {"sum", "nansum"}  # of rows, linear (a loss: any op named *loss*, *entropy*)
_SCALINGS = {"mul", "imul", "mul_", "div", "truediv", "true_divide", "itruediv", "div_"}
_SIZED = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "size", "dim", "numel"}  # take dtype, device

class Outputs(NamedTuple):
    """What :func:`classify_outputs` found: each list empty where nothing could be told."""

    coupled: list[str]  # a description of each 0-dim output of class C
    summed: list[str]  # the names of the 0-dim outputs of class S
    means: list[str]  # the names of the 0-dim outputs of class M
    independent: list[tuple[int, str]]  # (leaf position, name) of each tensor output of class K
    coupled_names: list[str]  # the names of the 0-dim outputs of class C


def classify_outputs(gm: torch.fx.GraphModule, batch: int, rows: int, unbatched: Collection[str] = (),
                     part: dict[str, Any] | None = None) -> Outputs:
    """Class the graph's outputs by what they do with the batch (one walk of the graph; see above).

    ``part`` holds :func:`~fxpipe.passes.batchrows.micro_specs`' answer when the caller has it
    (computed here otherwise). Nothing is found when ``rows == batch``, and when the graph
    cannot run for ``rows`` rows on fake tensors.
    """
    none = Outputs([], [], [], [], [])
    leaves = _leaves(gm)
    if rows == batch or not leaves:
        return none
    part = part if part is not None else micro_specs(gm, batch, rows, unbatched)
    if part is None:
        return none
    kinds: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "output":
            kinds[node] = _kind(node, kinds, part)
    scalars = [(name, node, kinds[node]) for name, node in leaves
               if isinstance(spec := node.meta.get("fxpipe.value"), TensorSpec) and len(spec.shape) == 0]
    return Outputs(
        [f"{name} (node '{node.name}'): a 0-dim output that is not a mean over the rows (it combines values "
         "reduced over the batch, as a load-balancing loss does, or compares rows with one another, as an "
         "in-batch-negatives loss over a (B, B) score matrix does)" for name, node, kind in scalars if kind == "C"],
        [name for name, _, kind in scalars if kind == "S"],
        [name for name, _, kind in scalars if kind == "M"],
        _independent(gm, kinds, leaves, part),
        [name for name, _, kind in scalars if kind == "C"])


def coupled_scalars(gm: torch.fx.GraphModule, batch: int, rows: int, unbatched: Collection[str] = (),
                    part: dict[str, Any] | None = None) -> list[str]:
    """Return a description of each 0-dim output that couples the rows of a batch (class C above)."""
    return classify_outputs(gm, batch, rows, unbatched, part).coupled


def _independent(gm: torch.fx.GraphModule, kinds: dict[torch.fx.Node, str],
                 leaves: list[tuple[str, torch.fx.Node]], part: dict[str, Any]) -> list[tuple[int, str]]:
    """Return ``(position, name)`` of each tensor output the batch does not change (class K above).

    An output made of sizes alone but shaped by the batch (position ids expanded to it, a mask of
    ones: ``x.new_ones(x.shape[0], t)``) is K for the reductions above, yet each micro-batch has
    its own rows of it: it is not returned.

    The position is the output's leaf in ``tree_flatten`` of the graph's output, which is where
    it lies among the micro-batch's output leaves while every output node holds one value. Where
    one holds several (a record, a module's tuple), nothing is returned: positions would shift.
    """
    flat = tree_flatten(gm.graph.output_node().args[0])[0]
    nodes = [leaf for leaf in flat if isinstance(leaf, torch.fx.Node)]
    if any(tree_flatten(n.meta.get("fxpipe.value"))[0] != [n.meta.get("fxpipe.value")] for n in nodes):
        return []
    by_node = {id(node): name for name, node in leaves}
    return [(k, by_node.get(id(leaf), f"output {k}")) for k, leaf in enumerate(flat)
            if isinstance(leaf, torch.fx.Node) and isinstance(leaf.meta.get("fxpipe.value"), TensorSpec)
            and kinds.get(leaf) == "K" and not _follows(leaf.meta["fxpipe.value"], part.get(leaf.name))]


def _kind(node: torch.fx.Node, kinds: dict[torch.fx.Node, str], part: dict[str, Any]) -> str:
    """Class one node from its inputs' classes and whether its shape follows the batch."""
    if node.op == "get_attr":
        return "K"
    follows = _follows(node.meta.get("fxpipe.value"), part.get(node.name))
    if node.op == "placeholder":
        return "R" if follows else "K"
    if follows is None:  # no tensor (a size, a flag, None): scales at most
        return "K"
    name = _name(node)
    deps = [a for a in node.all_input_nodes if kinds.get(a, "K") != "K"]
    classes = {kinds[a] for a in deps}
    if not deps or name in _SIZED:
        return "K"
    if follows:  # rows, even where a reduction feeds back (batch norm, a router's counts): not this pass's
        return "C" if _compares_rows(node.meta.get("fxpipe.value"), part.get(node.name)) else "R"
    if "C" in classes:
        return "C"
    if "R" in classes:  # the batch reduced away
        reduced = _reduction(node, name)
        return reduced if reduced is not None and classes == {"R"} else "C"
    if name not in _LINEAR:
        return "C"
    if name in ("mul", "imul", "mul_") and len(deps) > 1:
        return "C"
    if name in ("div", "truediv", "true_divide", "itruediv", "div_") and len(node.args) > 1 and node.args[1] in deps:
        return "C"
    if len(classes) > 1 or (name in _SCALINGS and not all(a in deps or _fixed(a, kinds) for a in node.all_input_nodes)):
        return "L"  # a mean and a sum added, or scaled by a size of the batch's values
    return classes.pop()  # scaled by a value every micro-batch has alike too (num_items_in_batch, a parameter)


def _fixed(node: torch.fx.Node, kinds: dict[torch.fx.Node, str]) -> bool:
    """Tell whether a value of class K is every micro-batch's alike: made of no value of the batch's rows.

    A size of a row value (``x.shape[0]``, a token count) is K but changes per micro-batch; an
    input given whole (HF's ``num_items_in_batch``), a parameter or a constant does not.
    """
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if kinds.get(n, "K") != "K":
            return False
        todo.extend(n.all_input_nodes)
    return True


def _reduction(node: torch.fx.Node, name: str) -> str | None:
    """Class a reduction of rows: M for a mean, S for a sum, None for an op that is not linear in them."""
    if name in _MEANS:
        return "M"
    if name in _SUMS:
        return "S"
    if "loss" not in name.lower() and "entropy" not in name.lower():
        return None
    how = _loss_reduction(node)
    return "S" if how in ("sum", 2) else "M" if how in ("mean", 1, None) else None


def _loss_reduction(node: torch.fx.Node) -> Any:
    """Return a loss's ``reduction`` (a name, aten's enum, or None for the default mean)."""
    if node.op == "call_module" and (owner := node.graph.owning_module) is not None:
        try:
            return getattr(owner.get_submodule(str(node.target)), "reduction", None)
        except AttributeError:
            return None
    if "reduction" in node.kwargs:
        return node.kwargs["reduction"]
    if isinstance(node.target, torch._ops.OpOverload):
        names = [a.name for a in node.target._schema.arguments]
        if "reduction" in names and names.index("reduction") < len(node.args):
            return node.args[names.index("reduction")]
    return None


def _follows(whole: Any, part: Any) -> bool | None:
    """Tell whether a value's tensor shapes differ between the batch and a micro-batch (None: no tensor)."""
    a = [t for t in tree_flatten(whole)[0] if isinstance(t, TensorSpec)]
    b = [t for t in tree_flatten(part)[0] if isinstance(t, TensorSpec)]
    if not a:
        return None
    return len(a) != len(b) or any(tuple(x.shape) != tuple(y.shape) for x, y in zip(a, b))


def _compares_rows(whole: Any, part: Any) -> bool:
    """Tell whether a tensor of the value has two dims that change for a micro-batch (``q @ d.T``: ``(B, B)``)."""
    pairs = zip([t for t in tree_flatten(whole)[0] if isinstance(t, TensorSpec)],
                [t for t in tree_flatten(part)[0] if isinstance(t, TensorSpec)])
    return any(len(x.shape) == len(y.shape) and sum(a != b for a, b in zip(x.shape, y.shape)) > 1 for x, y in pairs)


def _name(node: torch.fx.Node) -> str:
    """Return an op's bare name: ``sum`` for ``torch.sum``, ``aten.sum.dim_IntList`` and ``x.sum()``."""
    op, target = node.op, node.target
    if isinstance(target, When):  # a node of one mode only: the call it guards
        op, target, _, _ = target.inner_call(node)
    if op == "call_module":
        owner = node.graph.owning_module
        try:
            return type(owner.get_submodule(str(target))).__name__ if owner is not None else str(target)
        except AttributeError:
            return str(target)
    if op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target)).split(".")[-1]
