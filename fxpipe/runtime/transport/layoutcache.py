"""The crossing values' specs per micro-batch layout, kept for the layouts used most recently.

A job whose sequence length changes at every step (dynamic padding) meets a new layout at
almost every step; kept for ever, their specs grew a rank's memory without bound (about 57 kB
per layout measured on a 2-layer decoder). The cache keeps the ``limit`` used last. A layout
dropped on one rank and not on another costs nothing but a propagation: a rank missing the
specs of a layout the first rank did not send propagates them itself
(:func:`fxpipe.runtime.transport.steplayout.specs_for`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["LAYOUTS_KEPT", "LayoutCache"]

LAYOUTS_KEPT = 256  # far above the two layouts of a step (full micro-batches and a smaller last one)


class LayoutCache(OrderedDict):
    """A dict of layout key -> specs that drops the least recently used entry past ``limit``."""

    def __init__(self, limit: int = LAYOUTS_KEPT) -> None:
        super().__init__()
        self.limit = limit

    def __getitem__(self, key: str) -> Any:
        """Return the specs of ``key`` and mark it used."""
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        """Keep ``value`` for ``key``; drop the least recently used past the limit."""
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
