"""Trace ``torch.as_tensor``, ``torch.asarray`` and ``torch.tensor`` of traced values as calls, where torch.fx fails.

``torch.as_tensor(x)`` of a tensor returns it (cast or moved where ``dtype=``/``device=`` say);
models wrap values in it defensively (MONAI's HighResNet: ``torch.as_tensor(self.blocks(x))``),
or build a tensor of a size (``torch.tensor(h.shape[0])``). torch.fx's Proxy does not reach
``__torch_function__`` there: the call reads the Proxy's ``__cuda_array_interface__`` and fails
with "``__cuda_array_interface__`` must be a dict", a message that names neither the call nor a
fix, and no leaf can hold it in the top-level forward. While fxpipe traces,
:func:`tracing_tensor_makers` records a call whose arguments hold a Proxy as a ``call_function``
node, called as ``torch.as_tensor`` and, through the tracer's ``autowrap_functions=``
(:data:`TENSOR_MAKERS`), by a name imported from torch (``from torch import as_tensor``); any
other call runs torch's own.

Writes: drops torch.fx's ``node.meta["is_wrapped"]`` from those calls (:func:`unmark_wrapped`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_aggregate

__all__ = ["TENSOR_MAKERS", "tracing_tensor_makers", "unmark_wrapped"]

TENSOR_MAKERS = (torch.as_tensor, torch.asarray, torch.tensor)


def _proxy_in(args: tuple, kwargs: dict) -> torch.fx.Proxy | None:
    """Return a Proxy given as an argument itself (``device=x.device`` too); None if none, or one inside a list.

    A list of traced tensors (``torch.tensor([h.mean(), h.std()])``) is left to torch: its values
    are read as the call is made, which no recorded call of data-less tensors can do.
    """
    found: list[torch.fx.Proxy] = []
    map_aggregate((args, kwargs), lambda a: found.append(a) if isinstance(a, torch.fx.Proxy) else None)
    direct = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)]
    return direct[0] if direct and len(direct) == len(found) else None


@contextlib.contextmanager
def tracing_tensor_makers() -> Iterator[None]:
    """Record ``torch.as_tensor(proxy, ...)`` (``asarray``, ``tensor``) as a node while inside; leave others to torch."""
    def recording(original: Any) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            """Record the call on a Proxy; run torch's otherwise."""
            proxy = _proxy_in(args, kwargs)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)
        return made

    for fn in TENSOR_MAKERS:
        setattr(torch, fn.__name__, recording(fn))
    try:
        yield
    finally:
        for fn in TENSOR_MAKERS:
            setattr(torch, fn.__name__, fn)


def unmark_wrapped(graph: torch.fx.Graph) -> None:
    """Drop torch.fx's ``is_wrapped`` mark from the calls ``autowrap_functions=`` recorded of :data:`TENSOR_MAKERS`.

    Marked, the generated code registers ``wrap("torch.as_tensor")`` in its module, a dotted
    name every later trace of any model then fails to look up (``KeyError: 'torch.as_tensor'``).
    """
    for node in graph.nodes:
        if node.op == "call_function" and node.target in TENSOR_MAKERS:
            node.meta.pop("is_wrapped", None)
