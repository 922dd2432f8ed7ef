"""Find the ``torch.autocast`` blocks of a forward while torch.fx traces it.

torch.fx records calls, not autocast state: ``with torch.autocast("cuda", enabled=False):``
around a softmax kept in float32 runs at trace time and leaves nothing in the graph, so under
an outer ``torch.autocast`` the pipeline would run that block in the outer dtype where eager
does not. While fxpipe traces, each block entered is noted by its source line; the graph keeps
them in ``gm.meta["fxpipe.autocast_blocks"]``, and a step under an outer autocast is refused,
naming them and the fixes (:func:`fxpipe.runtime.validate.check_inputs`). Without an outer
autocast the blocks change nothing (disabling) or are refused as well (enabling one).

Reads and writes no ``node.meta``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpipe.frontend.source import model_line

__all__ = ["recording_autocast_blocks"]


@contextmanager
def recording_autocast_blocks(blocks: list[tuple[str, bool]]) -> Iterator[None]:
    """Append to ``blocks`` the source line of each ``torch.autocast`` block entered inside, and whether it enables."""
    cls: Any = torch.amp.autocast_mode.autocast
    original = cls.__enter__

    def enter(self: Any) -> Any:
        """Note where the forward enters this block; then enter it."""
        blocks.append((model_line() or "a torch.autocast block", bool(getattr(self, "_enabled", True))))
        return original(self)

    cls.__enter__ = enter
    try:
        yield
    finally:
        cls.__enter__ = original
