"""Functorch transforms inside a graph: ``torch.vmap`` in a forward that ``torch.export`` traced.

Reads:  the graph's ``call_function`` nodes.
Writes: nothing.

An exported ``torch.vmap`` (``flex_attention``'s ``create_block_mask`` calls one) is a region::

    _vmap_increment_nesting   <- a functorch level opens: values inside are BatchedTensors
    _add_batch_dim(x)
    ...                       <- ops on batched values
    _remove_batch_dim(y)
    _vmap_decrement_nesting   <- the level closes

The two ends have no users, so nothing but their order ties them to the region: a stage
beginning inside it would close a level it never opened, or leave one open in the process
(every later ``requires_grad_`` and export then fails). :func:`nesting_regions` gives the
regions (no stage begins inside one); :func:`levels_restored` closes the levels a run that
stopped inside one left open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.fx

__all__ = ["is_nesting", "levels_restored", "nesting_regions"]


def _end(node: torch.fx.Node) -> str | None:
    """Return ``"open"`` or ``"close"`` for a node opening or closing a functorch level, else ``None``."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if name.endswith("_increment_nesting"):
        return "open"
    if name.endswith("_decrement_nesting"):
        return "close"
    return None


def is_nesting(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` opens or closes a functorch level (an exported ``torch.vmap``'s ends)."""
    return _end(node) is not None


def nesting_regions(order: Sequence[torch.fx.Node]) -> list[tuple[int, int]]:
    """Return the ``(open, close)`` positions in ``order`` of each outermost functorch region."""
    regions: list[tuple[int, int]] = []
    depth, start = 0, 0
    for i, node in enumerate(order):
        end = _end(node)
        if end == "open":
            start = i if depth == 0 else start
            depth += 1
        elif end == "close" and depth:
            depth -= 1
            if depth == 0:
                regions.append((start, i))
    return regions


@contextlib.contextmanager
def levels_restored() -> Iterator[None]:
    """Close, when the block raises, the functorch levels it opened and left open."""
    functorch = torch._C._functorch
    before = functorch.maybe_current_level()
    try:
        yield
    except BaseException:
        level = functorch.maybe_current_level()
        while level is not None and (before is None or level > before):
            functorch._vmap_decrement_nesting()
            level, last = functorch.maybe_current_level(), level
            if level == last:  # not a vmap level: leave it
                break
        raise
