"""Keep a forward's own ``torch.autocast`` blocks in an fx trace: each node made inside runs under them.

torch.fx records calls, not autocast state: ``with torch.autocast("cpu", enabled=False):``
around a projection kept in float32 runs at trace time and leaves nothing in the graph, so
under an outer ``torch.autocast`` the pipeline would run that block in the outer dtype where
eager does not. While fxpipe traces, the blocks entered are kept on a stack, and each node made
inside is marked with it (``fxpipe.autocast``: ``(device_type, dtype, enabled, cache_enabled)``
per block, innermost last); afterwards each marked call runs under those blocks
(:func:`fxpipe.passes.amp.run_under_autocast`)::

    with torch.autocast("cpu", enabled=False):     a = proj(h)   ->   a = under_autocast_proj(proj, h)
        a = self.proj(h.float())

So the block sets the autocast of its device type for the ops it holds, inside whatever outer
autocast a step runs under, as eager's does; a stage boundary may fall inside it.

Reads no ``node.meta``; the tracer writes ``fxpipe.autocast`` through :func:`autocast_blocks`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["autocast_blocks", "recording_autocast_blocks"]

_local = threading.local()  # .stack: the blocks entered while tracing, innermost last


def autocast_blocks() -> tuple[tuple[str, torch.dtype, bool, bool], ...]:
    """Return the autocast blocks the forward being traced is inside (empty outside a recording)."""
    return tuple(getattr(_local, "stack", ()))


@contextmanager
def recording_autocast_blocks() -> Iterator[None]:
    """Keep the ``torch.autocast`` blocks a forward enters while traced inside, for :func:`autocast_blocks`."""
    cls: Any = torch.amp.autocast_mode.autocast
    enter, exit_ = cls.__enter__, cls.__exit__
    _local.stack = []

    def entered(self: Any) -> Any:
        """Note the block the forward enters; then enter it."""
        _local.stack.append((self.device, self.fast_dtype, bool(self._enabled), bool(self._cache_enabled)))
        return enter(self)

    def exited(self: Any, *exc: Any) -> Any:
        """Leave the block and forget it."""
        if _local.stack:
            _local.stack.pop()
        return exit_(self, *exc)

    cls.__enter__, cls.__exit__ = entered, exited
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_
        _local.stack = []
