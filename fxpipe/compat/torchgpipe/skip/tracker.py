"""Where ``stash`` puts skip tensors and ``pop`` finds them: the current thread's skip tracker.

Run eagerly (no pipeline), a skippable model uses its thread's default tracker: a dict from
``(namespace, name)`` to the stashed tensor, emptied as the tensors are popped. Inside
:class:`~fxpipe.compat.torchgpipe.GPipe`, each partition runs under a tracker of its own that
starts with the skips the partition pops from earlier partitions (inputs of its graph node)
and ends with those that later partitions pop (outputs of its graph node); fxpipe's split pass
routes those values between the stages, so nothing crosses partitions through the tracker::

    partition 0 ──output──▶ partition 1 ──output──▶ partition 2
      tracker: stash "1to3"                          tracker: pop "1to3"
          └────────── graph edge, an fxpipe skip route ─────▲
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from fxpipe.compat.torchgpipe.skip.namespace import Namespace

__all__ = ["SkipTracker", "current_skip_tracker", "use_skip_tracker"]

Key = tuple[Namespace | None, str]


class SkipTracker:
    """The skip tensors stashed and not yet popped, by ``(namespace, name)``."""

    def __init__(self, tensors: Mapping[Key, torch.Tensor | None] | None = None) -> None:
        self.tensors: dict[Key, Any] = dict(tensors or {})

    def save(self, ns: Namespace | None, name: str, tensor: torch.Tensor | None) -> None:
        """Keep a stashed tensor until it is popped."""
        self.tensors[(ns, name)] = tensor

    def load(self, ns: Namespace | None, name: str) -> torch.Tensor | None:
        """Hand out a stashed tensor and forget it; raise KeyError if none was stashed."""
        return self.tensors.pop((ns, name))


class _Local(threading.local):
    """The skip tracker in use on this thread (None: the thread's default)."""

    current: SkipTracker | None = None
    default: SkipTracker | None = None


_local = _Local()


def current_skip_tracker() -> SkipTracker:
    """Return the skip tracker in use on this thread."""
    if _local.current is not None:
        return _local.current
    if _local.default is None:
        _local.default = SkipTracker()
    return _local.default


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Make ``tracker`` this thread's skip tracker for the block."""
    previous = _local.current
    _local.current = tracker
    try:
        yield
    finally:
        _local.current = previous
