"""Record a forward's assignments to module attributes while torch.fx traces it.

torch.fx records calls, not attribute assignment. A forward that assigns a computed value to
a buffer (``self.steps = self.steps + 1``, or ``self.steps += 1``, which Python runs as that)
would leave the tracer's ``Proxy`` in the model as the buffer, and the graph would compute
the new value and drop it: the model broken after the trace, the update never made. Under
:func:`recording_assignments`::

    self.steps = self.steps + 1      get_attr steps ─▶ add ─▶ copy_(steps, add)   the buffer,
                                     updated in place each step; the model keeps its tensor
    self.cache = h                   the trace reads h back from self.cache; afterwards the
                                     attribute is put back as it was (the graph keeps no Python
                                     state), and a warning names it

Reads and writes no ``node.meta``; adds ``copy_`` nodes to the graph being traced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["recording_assignments"]

log = logging.getLogger(__name__)

_MISSING = object()


@contextmanager
def recording_assignments(tracer: torch.fx.Tracer) -> Iterator[None]:
    """Record buffer assignments as in-place copies; put other assigned attributes back afterwards."""
    original: Any = nn.Module.__setattr__
    put_back: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}

    def assign(module: nn.Module, name: str, value: Any) -> None:
        """Turn ``module.name = proxy`` into what the graph can keep; run any other assignment as is."""
        if not (isinstance(value, torch.fx.Proxy) and value.tracer is tracer):
            original(module, name, value)
            return
        buffers = module.__dict__.get("_buffers", {})
        if buffers.get(name) is not None:
            path = _path(tracer, module)
            if path is not None:
                held = tracer.create_proxy("get_attr", f"{path}.{name}" if path else name, (), {})
                tracer.create_proxy("call_method", "copy_", (held, value), {})
                return
        before = _current(module, name)
        original(module, name, value)  # raises for a parameter's or a child module's name, as in eager
        put_back.setdefault((id(module), name), (module, name, before))

    nn.Module.__setattr__ = assign  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]
        for module, name, before in put_back.values():
            log.warning("%s.forward assigns self.%s a value computed from its inputs: the traced graph "
                        "keeps no Python state, so the attribute is put back as it was (register it as a "
                        "buffer, or update a buffer in place, to keep it updated)", type(module).__name__, name)
            _restore(module, name, before)


def _path(tracer: torch.fx.Tracer, module: nn.Module) -> str | None:
    """Return ``module``'s qualified name under the traced root, or None if it is not under it."""
    try:
        return tracer.path_of_module(module)
    except NameError:
        return None


def _current(module: nn.Module, name: str) -> Any:
    """Return what ``module.name`` holds now as a buffer or plain attribute (_MISSING if nothing)."""
    for store in (module.__dict__.get("_buffers", {}), module.__dict__):
        if name in store:
            return store[name]
    return _MISSING


def _restore(module: nn.Module, name: str, before: Any) -> None:
    """Give ``module.name`` back the value it held before the trace (or remove it)."""
    buffers = module.__dict__.get("_buffers", {})
    if before is _MISSING:
        buffers.pop(name, None)
        module.__dict__.pop(name, None)
    elif name in buffers:
        buffers[name] = before
    else:
        buffers.pop(name, None)
        module.__dict__[name] = before
