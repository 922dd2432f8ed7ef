"""Pause Python's cyclic garbage collector while a pass makes many small objects.

Reads and writes no ``node.meta``. A pass over a large graph allocates nodes, fake tensors
and meta dicts by the hundred thousand; each allocation burst triggers collections that scan
the whole (large) heap. Reference counting still frees what a pass drops; the collector runs
again when the pass returns. On a 16k-node graph this saves about a third of the passes' time.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

__all__ = ["gc_paused"]

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    """Wrap ``fn`` so that the cyclic collector is paused while it runs (and restored after)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]
