"""The ``torch.export`` front end: a flat graph over the model's own named parameters.

``torch.export`` traces the whole program (Python control flow on shapes included) down to
ATen ops. fxpipe exports with dim 0 of every batched input dynamic, since micro-batches change
the batch size, and takes ``ExportedProgram.module()``: one flat GraphModule whose parameters
and buffers sit under the model's own qualified names (``layer1.0.conv1.weight``) and are
the model's own tensor objects, and whose nodes keep the module they came from in
``nn_module_stack`` (so ``split_points=["layer3"]`` names modules as with the fx front end)::

    model ──torch.export──▶ ExportedProgram ──.module()──▶ GraphModule
      │                                                        │ get_attr "layer1.0.conv1.weight"
      └── Parameter objects ◀──────── the same objects ◀───────┘

So gradients land in the model's ``Parameter`` objects and ``pipe.state_dict()`` has the
model's keys. The graph is fixed to the mode (train or eval) the model was in when exported,
and to the example's non-batch shapes.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.errors import TraceError

__all__ = ["export_trace"]

log = logging.getLogger(__name__)


def _batched(x: Any) -> bool:
    """Tell whether ``x`` is a tensor split into micro-batches on dim 0."""
    return isinstance(x, torch.Tensor) and x.dim() > 0


def export_trace(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """Export ``model`` with a dynamic batch dim; return the flat GraphModule over its own state."""
    if not any(_batched(t) for t in tree_flatten((args, kwargs))[0]):
        raise ValueError("tracer='export' needs example_inputs= (or example_kwargs=) holding at "
                         "least one tensor with a batch dimension: torch.export traces with them")
    # A batch of one would be specialised to the constant 1; export with two rows instead.
    if any(_batched(t) and t.shape[0] == 1 for t in tree_flatten((args, kwargs))[0]):
        args, kwargs = tree_map(lambda t: torch.cat([t, t]) if _batched(t) else t, (args, kwargs))
    batch = torch.export.Dim("batch", min=1)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"the example inputs do not match {type(model).__name__}.forward: {exc}") from None
    dynamic = {name: tree_map(lambda t: {0: batch} if _batched(t) else None, value)
               for name, value in bound.arguments.items()}
    try:
        program = torch.export.export(model, tuple(args), dict(kwargs), dynamic_shapes=dynamic)
    except Exception as exc:  # noqa: BLE001 - re-raised with the cause and the fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"torch.export could not trace {type(model).__name__} with a dynamic batch dimension: "
            f"{first}\nfxpipe splits dim 0 of every input into micro-batches, so the model must "
            "not depend on the batch size; otherwise use the fx front end (tracer='fx'), whose "
            "graph is shape-generic. The full torch.export error is chained below.") from exc
    gm = program.module()
    _share_state(gm, model)
    gm.meta["fxpipe.tracer"] = "export"
    gm.meta["fxpipe.training"] = model.training
    log.debug("exported %s: %d nodes", type(model).__name__, len(gm.graph.nodes))
    return gm


def _share_state(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter and buffer of ``gm`` the model's own object of the same name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for registry, own in (("_parameters", params), ("_buffers", buffers)):
        for name, t in list(getattr(gm, "named_" + registry[1:])(remove_duplicate=False)):
            if name in own and own[name] is not t:
                prefix, _, leaf = name.rpartition(".")
                getattr(gm.get_submodule(prefix), registry)[leaf] = own[name]
