"""Find the values and parameters whose gradient depends on which outputs the loss reads.

Reads:  ``node.meta["fxpipe.value"]`` (from :func:`fxpipe.passes.annotate`: which values carry
        a gradient).
Writes: nothing; returns names.

A model with several outputs (a dict of logits and auxiliary values, CLIP's embeddings and
logits) may be trained on some of them only. A value that reaches only the outputs the loss
ignores then gets no gradient at all, and neither do the parameters only it depends on:
eager PyTorch leaves their ``.grad`` at ``None``. The runtime must not turn that absence into
zeros (AdamW would still decay such a parameter). Which outputs the loss reads is known only
at the step, so this pass names the values and parameters for which it *may* matter: those
that do not reach, along values carrying a gradient, every output that carries one::

    x ─▶ a ─▶ h ─▶ b ─▶ main ───────────▶ output["main"]   (read by the loss)
              └──▶ * scale ─▶ side ─────▶ output["side"]   (maybe not: side, scale named)

A value reaching no output at all (read only through a comparison, say) is named too. Missing
a path (an in-place write the graph does not show as a use) names more than needed, which
costs the runtime a check, never a wrong gradient.
"""

from __future__ import annotations

import torch.fx
from fxpipe.passes.annotate import TensorSpec
from fxpipe.passes.mutates import unwrapped
from fxpipe.passes.records import built_record
from fxpipe.passes.spec import differentiable
from torch.utils._pytree import tree_flatten

__all__ = ["maybe_without_grad"]


def _carries(node: torch.fx.Node) -> bool:
    """Tell whether ``node``'s value carries a gradient (assumed so where not annotated)."""
    spec = node.meta.get("fxpipe.value")
    if spec is None:
        return node.op not in ("placeholder", "output")
    return any(isinstance(t, TensorSpec) and t.requires_grad and differentiable(t.dtype) for t in tree_flatten(spec)[0])


def _made_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Return the nodes an output node is made of: itself, or what a container it builds holds.

    A namedtuple built in the forward (torchvision's ``GoogLeNetOutputs(logits, aux)``) is one
    node whose arguments are the outputs; so is a mode's choice between two (``pick(training,
    Out(logits, aux), logits)``, where only training returns the auxiliary head).
    """
    call = unwrapped(node)
    if call.op != "call_function":
        return [node]
    positions = getattr(call.target, "returns_an_argument", ())
    if positions:
        held = [call.args[k] for k in positions if k < len(call.args)]
    elif built_record(call.target) is not None:  # a container class (or a record's builder): its fields are the outputs
        held = list(call.args) + list(call.kwargs.values())
    else:
        return [node]
    return [leaf for value in tree_flatten(held)[0] if isinstance(value, torch.fx.Node) for leaf in _made_of(value)]


def maybe_without_grad(gm: torch.fx.GraphModule) -> set[str]:
    """Return the names of the nodes that do not reach every gradient-carrying output leaf."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    direct: dict[torch.fx.Node, set[int]] = {}
    leaves = [part for leaf in tree_flatten(output.args[0])[0] if isinstance(leaf, torch.fx.Node)
              for part in _made_of(leaf)]
    for k, leaf in enumerate(leaves):
        if _carries(leaf):
            direct.setdefault(leaf, set()).add(k)
    every = set().union(*direct.values()) if direct else set()
    reach: dict[torch.fx.Node, set[int]] = {}
    for n in reversed(gm.graph.nodes):
        if n.op == "output":
            continue
        r = set(direct.get(n, ()))
        for u in n.users:
            if u.op != "output" and _carries(u):
                r |= reach.get(u, set())
        reach[n] = r
    return {n.name for n, r in reach.items() if not r >= every}
