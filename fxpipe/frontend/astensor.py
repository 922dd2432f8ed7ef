"""Trace ``torch.as_tensor`` of a traced value as a call, where torch.fx fails on it.

``torch.as_tensor(x)`` of a tensor returns it (cast or moved where ``dtype=``/``device=`` say);
models wrap values in it defensively (MONAI's HighResNet: ``torch.as_tensor(self.blocks(x))``).
torch.fx's Proxy does not reach ``__torch_function__`` there: ``as_tensor`` reads the Proxy's
``__cuda_array_interface__`` and fails with "``__cuda_array_interface__`` must be a dict", a
message that names neither the call nor a fix, and no leaf can hold it in the top-level forward.
While fxpipe traces, :func:`tracing_as_tensor` records such a call as a ``call_function`` node
(its data a Proxy); any other call runs torch's own.

Reads and writes no ``node.meta``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["tracing_as_tensor"]


@contextlib.contextmanager
def tracing_as_tensor() -> Iterator[None]:
    """Record ``torch.as_tensor(proxy, ...)`` as a node while inside; leave other calls to torch."""
    original = torch.as_tensor

    def as_tensor(data: Any, *args: Any, **kwargs: Any) -> Any:
        """Record the call on a Proxy; run torch's otherwise."""
        if isinstance(data, torch.fx.Proxy):
            return data.tracer.create_proxy("call_function", original, (data, *args), kwargs)
        return original(data, *args, **kwargs)

    torch.as_tensor = as_tensor
    try:
        yield
    finally:
        torch.as_tensor = original
