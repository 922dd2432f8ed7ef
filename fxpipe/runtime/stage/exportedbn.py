"""Deferred batch norm in graphs that hold batch norm calls instead of modules.

An exported training graph updates each batch norm's running statistics inside
``aten.batch_norm`` and counts ``num_batches_tracked`` in an ``add_`` beside it::

    add_(bn.num_batches_tracked, 1)          erased: the commit counts once per mini-batch
    batch_norm(x, w, b, rm, rv, True, ...)   deferred_batch_norm(x, w, b, rm, rv, True, ..., key)

:func:`defer_exported` rewrites them so; the new call normalizes by the micro-batch's statistics
and accumulates its sums into an :class:`ExportedBatchNorm` (found by ``key``), which
:func:`fxpipe.runtime.stage.batchnorm.commit_batch_norm` commits like a module's. An fx graph
holds such a call where fx traced through a batch norm subclass's own ``forward`` (timm's
``BatchNormAct2d``): ``F.batch_norm(x, bn.running_mean, ...)`` beside ``bn.num_batches_tracked.add_(1)``;
:func:`defer_traced` rewrites those the same way.

Reads the stage graphs; rewrites their batch norm calls in place (and recompiles them).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fxpipe.passes.modes import When, pick
from fxpipe.passes.mutates import unwrapped
from fxpipe.runtime.stage.batchnorm import accumulate

__all__ = ["ExportedBatchNorm", "defer_exported", "defer_traced", "deferred_batch_norm", "deferred_functional",
           "share_counters"]

# key -> record; a record lives as long as its runtime's list of deferred batch norms holds it
_BY_KEY: weakref.WeakValueDictionary[str, ExportedBatchNorm] = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


class ExportedBatchNorm:
    """The running statistics of one ``aten.batch_norm`` call of an exported stage, and its sums."""

    def __init__(self, gm: torch.fx.GraphModule, prefix: str, momentum: float | None) -> None:
        self.gm, self.prefix, self.momentum = gm, prefix, momentum
        self.fqn = prefix.rstrip(".")  # the batch norm module's name in the model
        self._fxpipe_sum: torch.Tensor | None = None
        self._fxpipe_sum_squares: torch.Tensor | None = None
        self._fxpipe_count = 0
        self.counted_by: ExportedBatchNorm | None = None  # the record of a call whose stage holds the counter

    def _buffer(self, name: str) -> torch.Tensor:
        """Return the stage's buffer ``<prefix>.name`` (looked up each time: a load may replace it)."""
        return self.gm.get_buffer(f"{self.prefix}{name}")

    @property
    def running_mean(self) -> torch.Tensor:
        """Return the running mean buffer."""
        return self._buffer("running_mean")

    @property
    def running_var(self) -> torch.Tensor:
        """Return the running variance buffer."""
        return self._buffer("running_var")

    @property
    def num_features(self) -> int:
        """Return the number of channels."""
        return self.running_mean.numel()

    @property
    def num_batches_tracked(self) -> torch.Tensor | None:
        """Return the update counter buffer (None where the graph never reads it: a subclass that does not count)."""
        try:
            return self._buffer("num_batches_tracked")
        except AttributeError:
            return None if self.counted_by is None else self.counted_by.num_batches_tracked


def deferred_batch_norm(x: torch.Tensor, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                        training: bool, momentum: float, eps: float, cudnn: bool, key: str) -> torch.Tensor:
    """Normalize as ``aten.batch_norm``; in training accumulate the statistics instead of updating them."""
    if not training:
        return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, False, momentum,
                                                 eps, cudnn)
    accumulate(_BY_KEY[key], x)
    return torch.ops.aten.batch_norm.default(x, weight, bias, None, None, True, 0.0, eps, cudnn)


def deferred_functional(x: torch.Tensor, running_mean: Any, running_var: Any, weight: Any, bias: Any,
                        training: bool, momentum: float, eps: float, key: str) -> torch.Tensor:
    """Normalize as ``F.batch_norm``; in training accumulate the statistics instead of updating them."""
    if not training:
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    accumulate(_BY_KEY[key], x)
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def _counters(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Map each tensor a graph adds to in place (``add_``, seen through a guard of training mode) to the adds."""
    calls = {n: unwrapped(n) for n in gm.graph.nodes}  # a counter of training mode only runs through a guard
    adds: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n, c in calls.items():
        if c.args and isinstance(c.args[0], torch.fx.Node) and (
                (c.op == "call_function" and c.target is torch.ops.aten.add_.Tensor)
                or (c.op == "call_method" and c.target == "add_")):
            adds.setdefault(c.args[0], []).append(n)  # a module called twice adds twice
    return adds


def _record(gm: torch.fx.GraphModule, adds: dict, stats: Any, momentum: Any) -> tuple[str, ExportedBatchNorm] | None:
    """Make the record of a call whose running mean is ``stats`` (a buffer), erasing its counter's add; or None."""
    while isinstance(stats, torch.fx.Node) and stats.op == "call_function" and stats.target is pick:
        stats = stats.args[1]  # the buffer the training graph reads, where the modes merged out of step
    if not (isinstance(stats, torch.fx.Node) and stats.op == "get_attr" and str(stats.target).endswith("running_mean")):
        return None
    prefix = str(stats.target)[: -len("running_mean")]
    for counter in [n for n in adds if n.op == "get_attr" and n.target == f"{prefix}num_batches_tracked"]:
        chain = [counter]  # a second call adds to the first add's result
        while chain:
            for add in adds.pop(chain.pop(), []):
                chain.append(add)
                add.replace_all_uses_with(counter)
                gm.graph.erase_node(add)
    key = f"{id(gm)}:{prefix}:{next(_SERIAL)}"  # one per call: a module called twice updates twice
    _BY_KEY[key] = record = ExportedBatchNorm(gm, prefix, momentum)
    return key, record


def defer_exported(gm: torch.fx.GraphModule) -> list[ExportedBatchNorm]:
    """Rewrite the training batch norm calls of an exported stage to defer their updates; return their records."""
    found = []
    adds = _counters(gm)
    for node in list(gm.graph.nodes):
        call = unwrapped(node)  # a call of training mode only too (the modes merged out of step)
        guarded = call is not node
        if call.op != "call_function" or call.target is not torch.ops.aten.batch_norm.default or not call.args[5] \
                or (guarded and not (isinstance(node.target, When) and node.target.expected
                                     and node.target.fn is call.target)):  # one guard, of training mode
            continue
        made = _record(gm, adds, call.args[3], call.args[6])
        if made is None:
            continue
        args = (*call.args[:9], made[0])
        if guarded:
            node.target, node.args = When(deferred_batch_norm, True), (node.args[0], *args)
        else:
            node.target, node.args = deferred_batch_norm, args
        found.append(made[1])
    if found:
        gm.recompile()
    return found


def defer_traced(gm: torch.fx.GraphModule) -> list[ExportedBatchNorm]:
    """Rewrite the ``F.batch_norm`` calls of an fx stage that read a buffer's running mean; return their records."""
    found = []
    adds = _counters(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.batch_norm:
            continue
        bound = inspect.signature(F.batch_norm).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["training"] is False:
            continue
        made = _record(gm, adds, a["running_mean"], a["momentum"])
        if made is not None:
            node.target, node.kwargs = deferred_functional, {}
            node.args = (a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"], a["training"],
                         a["momentum"], a["eps"], made[0])
            found.append(made[1])
    if found:
        gm.recompile()
    return found


def share_counters(records: list[ExportedBatchNorm]) -> None:
    """Let a call whose stage does not hold its module's counter count on the one of a call that does."""
    holders = {id(r.running_mean): r for r in records if r.num_batches_tracked is not None}
    for r in records:
        if r.num_batches_tracked is None and id(r.running_mean) in holders:
            r.counted_by = holders[id(r.running_mean)]
