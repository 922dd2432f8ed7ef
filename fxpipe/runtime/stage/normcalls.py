"""A deferred batch norm called more than once per forward: one update per call, in the calls' order.

Eager training on the whole batch updates a batch norm's running statistics once per call: a
module called twice (MONAI's ``SegResNetVAE`` runs its decoder's norms for the VAE branch too,
a recurrent block runs its norm once per step) gets two updates, each from the inputs of its
own call, and counts two batches. Deferral accumulates a module's sums; added into one set,
the two calls made one update of their mixed inputs, counted once. So each further call
accumulates into a :class:`Call` of its own, which reads and updates the module's buffers, and
the commit takes them in the order the graph calls them::

    stage 0: bn(x)   -> the module's own sums        commit: update from call 1, then
    stage 2: bn(h)   -> Call(bn) (stage 2, call 0)           update from call 2 (as eager)

A call is told apart by the stage that runs it and its place among that stage's calls of the
module in one forward, counted by :func:`counting` around each stage's forward.

Reads the stage graphs' ``call_module`` nodes; writes ``_fxpipe_calls`` on such a module.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fxpipe.errors import user_stacklevel

__all__ = ["Call", "called_more_than_once", "counting", "norms_in_several_stages", "per_call", "slot", "warn_spread"]

_HERE = threading.local()  # the stage whose forward runs on this thread, and its calls so far per module


class Call:
    """A further call of a deferred batch norm module: its own sums; the module's statistics."""

    def __init__(self, bn: Any) -> None:
        self.bn = bn
        self._fxpipe_sum: torch.Tensor | None = None
        self._fxpipe_sum_squares: torch.Tensor | None = None
        self._fxpipe_count = 0

    def __getattr__(self, name: str) -> Any:
        """Read the module's attributes (its buffers, momentum, number of features)."""
        if name == "bn":
            raise AttributeError(name)
        return getattr(self.bn, name)


@contextmanager
def counting(stage: int) -> Iterator[None]:
    """Count the batch norm calls of stage ``stage``'s forward run inside the block."""
    before = getattr(_HERE, "state", None)
    _HERE.state = (stage, {})
    try:
        yield
    finally:
        _HERE.state = before


def slot(bn: Any) -> Any:
    """Return what this call of ``bn`` accumulates into: the module, or the :class:`Call` of its place."""
    calls = vars(bn).get("_fxpipe_calls") if hasattr(bn, "__dict__") else None
    state = getattr(_HERE, "state", None)
    if not calls or state is None:
        return bn
    stage, seen = state
    k = seen.get(id(bn), 0)
    seen[id(bn)] = k + 1
    return calls.get((stage, k), bn)


def per_call(deferred: Sequence[Any], stages: Mapping[int, torch.fx.GraphModule]) -> list[Any]:
    """Give each module of ``deferred`` called more than once a :class:`Call` per further call; return all, in order.

    The module keeps the first call (the lowest stage, first in it); the list holds each
    module followed by its calls in the order the graph makes them, which the commit follows.
    """
    places: dict[int, list[tuple[int, int]]] = {}
    for j, k, _, m in _module_calls(stages):
        places.setdefault(id(m), []).append((j, k))
    ordered: list[Any] = []
    for bn in deferred:
        ordered.append(bn)
        where = places.get(id(bn), [])
        if len(where) > 1:
            calls = {where[0]: bn, **{w: Call(bn) for w in where[1:]}}
            vars(bn)["_fxpipe_calls"] = calls
            ordered += [calls[w] for w in where[1:]]
    return ordered


def called_more_than_once(deferred: Sequence[Any]) -> list[Any]:
    """Return the modules of ``deferred`` that :func:`per_call` found called more than once."""
    return [bn for bn in deferred if len(vars(bn).get("_fxpipe_calls", ())) > 1]


def norms_in_several_stages(stages: Sequence[torch.fx.GraphModule]) -> list[tuple[str, list[int]]]:
    """Return ``(name, stages)`` for each batch norm module tracking statistics that stages of ``stages`` call."""
    from torch.nn.modules.batchnorm import _BatchNorm

    found: dict[str, list[int]] = {}  # by name: across ranks each rank's stages hold their own module
    for j, _, name, m in _module_calls(dict(enumerate(stages))):
        if isinstance(m, _BatchNorm) and m.track_running_stats:
            where = found.setdefault(name, [])
            if j not in where:
                where.append(j)
    return [(name, where) for name, where in found.items() if len(where) > 1]


def _module_calls(stages: Mapping[int, torch.fx.GraphModule]) -> Iterator[tuple[int, int, str, Any]]:
    """Yield ``(stage, k, name, module)`` per ``call_module`` node, stage by stage: its ``k``-th call in that stage."""
    for j in sorted(stages):
        seen: dict[int, int] = {}
        for node in stages[j].graph.nodes:
            if node.op == "call_module":
                m = stages[j].get_submodule(node.target)
                k = seen[id(m)] = seen.get(id(m), -1) + 1
                yield j, k, str(node.target), m


def warn_spread(stages: Sequence[torch.fx.GraphModule], deferred: bool, rank_of: Sequence[int] | None = None) -> None:
    """Warn of a batch norm that several stages call, where its running statistics cannot be eager's.

    Across ranks each rank holds its own copy of the module, updated by its own calls only. In
    one process without deferral, each micro-batch's call in the earlier stage updates the
    statistics before any call in the later one, where eager alternates them.
    """
    for name, where in norms_in_several_stages(stages):
        ranks = sorted({rank_of[j] for j in where}) if rank_of is not None else []
        if len(ranks) > 1:
            message = (f"batch norm '{name}' is called by stages {where}, on ranks {ranks}: each rank keeps its own "
                       "running statistics, updated by its own calls only (fxpipe.save writes one rank's copy), so "
                       "they are not eager's. Keep its calls on one rank (split_points=) for statistics equal to "
                       "eager's")
        elif not deferred:
            message = (f"batch norm '{name}' is called by stages {where}: without deferral its running statistics "
                       f"get an update per call and micro-batch in the pipeline's order (every micro-batch's call "
                       f"in stage {where[0]} before any in stage {where[1]}), not in eager's; "
                       "deferred_batch_norm=True updates them once per call, from the whole batch, in the calls' order")
        else:
            continue
        warnings.warn(message, stacklevel=user_stacklevel())
