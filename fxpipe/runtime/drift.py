"""Tell when a model was changed after compile in a way the pipe does not follow.

The pipe runs the graph traced at compile. It follows what lives in tensors and in the
modules it calls (parameters' values, a replaced ``Parameter``, ``train()``/``eval()``,
``requires_grad``, a leaf module's own attributes such as ``Dropout.p`` under fx), but not:

    a submodule replaced or removed    the graph calls the module of compile (the new one's
                                       parameters get no gradient)
    a plain attribute the trace read   a flag or a scale (``self.use_relu``, ``self.scale``)
                                       keeps its value of compile

:func:`snapshot` records, at compile, each module's place in its parent and its plain
attributes (bools, numbers, strings); :func:`changes` names what differs at a call.
"""

from __future__ import annotations

import torch.fx
from torch import nn

__all__ = ["Snapshot", "changes", "describe", "snapshot"]

_PLAIN = (bool, int, float, str, type(None))
Snapshot = list[tuple[str, nn.Module, str, nn.Module, tuple]]  # (name, parent, key, module, attributes)


def _attributes(module: nn.Module, read: bool) -> tuple:
    """Return the module's plain public attributes that a trace read (none for a module the graph calls)."""
    if not read:
        return ()
    return tuple((k, v) for k, v in vars(module).items()
                 if type(v) in _PLAIN and not k.startswith("_") and k != "training")


def snapshot(model: nn.Module, gm: torch.fx.GraphModule) -> Snapshot:
    """Record each submodule's place and the plain attributes its traced code read, at compile."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    out: Snapshot = [("", model, "", model, _attributes(model, True))]
    for name, parent in model.named_modules():
        for key, child in parent._modules.items():
            if child is not None:
                full = f"{name}.{key}" if name else key
                out.append((full, parent, key, child, _attributes(child, full not in called)))
    return out


def changes(snap: Snapshot) -> list[str]:
    """Name each submodule replaced or removed, and each recorded attribute changed, since the snapshot."""
    found: list[str] = []
    for name, parent, key, module, attributes in snap:
        if key and (now := _child(parent, key)) is not module:
            found.append(f"{name} was {'replaced' if now is not None else 'removed'}")
            continue
        if attributes and _attributes(module, True) != attributes:
            current = dict(_attributes(module, True))
            found += [f"{name + '.' if name else ''}{k} was {v!r}, is {current.get(k, '(deleted)')!r}"
                      for k, v in attributes if current.get(k, _Missing) != v]
    return found


def _child(parent: nn.Module, key: str) -> nn.Module | None:
    """Return ``parent``'s submodule ``key`` (a ScriptModule's registry has no ``get``), or None."""
    try:
        return parent._modules[key]
    except KeyError:
        return None


class _Missing:
    """Stands for an attribute deleted since the snapshot."""


def describe(found: list[str]) -> str:
    """Return the warning for the changes ``found``."""
    return (f"the model changed after fxpipe.compile: {'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}. "
            "The pipe runs the graph traced at compile: a replaced submodule is not called (its parameters get no "
            "gradient), and an attribute the traced code read keeps its value of compile. Compile the model again "
            "after changing it (parameters' values, a replaced Parameter, train()/eval() and requires_grad are "
            "followed)")
