"""Which partition stashes each skip and which pops it, read from the layers' declarations.

Reads only the ``@skippable`` declarations of each partition's layers (their direct
children), in order; nothing runs. A skip stashed and popped in the same partition stays
inside it (the partition's own skip tracker hands it over); one popped by a later partition
becomes an edge of the pipeline graph (:mod:`fxpipe.compat.torchgpipe.lowering`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fxpipe.compat.torchgpipe.skip.namespace import Namespace, namespace_key
from fxpipe.compat.torchgpipe.skip.skippable import Skippable

__all__ = ["SkipLayout", "inspect_skip_layout"]

Key = tuple[Namespace | None, str]


def _order(item: tuple[int, Namespace | None, str]) -> tuple[int, str, str]:
    """Sort key of a ``(partition, namespace, name)`` triple."""
    return item[0], namespace_key(item[1]), item[2]


class SkipLayout:
    """The route ``(stashing partition, popping partition)`` of every skip, by ``(namespace, name)``."""

    def __init__(self, num_partitions: int, skip_routes: dict[Key, tuple[int, int]]) -> None:
        self.num_partitions = num_partitions
        self.skip_routes = dict(skip_routes)

    def copy_policy(self, j: int) -> list[tuple[int, Namespace | None, str]]:
        """Return ``(source partition, namespace, name)`` of each skip partition ``j`` pops from earlier ones."""
        return sorted(((src, ns, name) for (ns, name), (src, dst) in self.skip_routes.items()
                       if dst == j and src != j), key=_order)

    def pops(self, j: int) -> list[Key]:
        """Return the skips partition ``j`` receives from earlier partitions, in :meth:`copy_policy` order."""
        return [(ns, name) for _, ns, name in self.copy_policy(j)]

    def stashes(self, j: int) -> list[Key]:
        """Return the skips partition ``j`` stashes for later partitions, by popping partition."""
        out = sorted(((dst, ns, name) for (ns, name), (src, dst) in self.skip_routes.items()
                      if src == j and dst != j), key=_order)
        return [(ns, name) for _, ns, name in out]


def inspect_skip_layout(partitions: Iterable[Any]) -> SkipLayout:
    """Return the skip routes between ``partitions`` (each an iterable of layers, e.g. nn.Sequential)."""
    stashed_at: dict[Key, int] = {}
    routes: dict[Key, tuple[int, int]] = {}
    count = 0
    for j, partition in enumerate(partitions):
        count += 1
        for layer in partition:
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                stashed_at[key] = j
            for key in layer.poppable():
                if key in stashed_at:
                    routes[key] = (stashed_at.pop(key), j)
    return SkipLayout(count, routes)
