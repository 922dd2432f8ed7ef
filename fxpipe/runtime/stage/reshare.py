"""Point the stages' own tensor attributes at the model's tensors again, after the model's were replaced.

A stage GraphModule reads the tensors its graph fetches (``get_attr``: a parameter the forward
uses directly, ``self.gain``; under zero bubble every deferred linear's weight) through
attributes of its own, copied from the model when it was made. Operations that replace the
model's tensors with new objects leave those attributes on the old ones, silently::

    pipe.load_state_dict(sd, assign=True)     model.gain -> a new Parameter
    pipe.double(), pipe.to_empty(...)         model buffers -> new tensors
    stage.gain                                 still the old one: outputs and gradients go there

After such an operation the Pipe calls :func:`reshare` on every GraphModule it runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx
from torch import nn

__all__ = ["held_tensor", "reshare", "tensor_place"]


def reshare(model: nn.Module, modules: Iterable[torch.fx.GraphModule]) -> int:
    """Make each ``get_attr`` of ``modules`` read the model's tensor of that name; return how many moved."""
    moved = 0
    for gm in modules:
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            want = _tensor(model, str(node.target))
            prefix, _, field = str(node.target).rpartition(".")
            try:
                owner = gm.get_submodule(prefix) if prefix else gm
            except AttributeError:
                continue
            if want is None or getattr(owner, field, None) is want:
                continue
            if isinstance(want, nn.Parameter):
                owner._parameters[field] = want
                owner._buffers.pop(field, None)
            else:
                owner._buffers[field] = want
                owner._parameters.pop(field, None)
            moved += 1
    return moved


def _tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    """Return the model's parameter or buffer ``name`` (None: the model has no tensor of that name)."""
    place = tensor_place(model, name)
    return None if place is None else held_tensor(*place)


def tensor_place(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """Return the module holding the tensor ``name`` (a dotted path) and its field (None: no such module)."""
    prefix, _, field = name.rpartition(".")
    try:
        return (model.get_submodule(prefix) if prefix else model), field
    except AttributeError:
        return None


def held_tensor(owner: nn.Module, field: str) -> torch.Tensor | None:
    """Return ``owner``'s parameter or buffer ``field`` (None where it has neither)."""
    for registry in (owner._parameters, owner._buffers):
        try:  # a ScriptModule's registries have no get
            tensor = registry[field]
        except KeyError:
            continue
        if tensor is not None:
            return tensor
    return None
