"""Batch norm running statistics kept equal across data-parallel replicas, once per training run.

Each replica normalizes its micro-batches by their own statistics (as DDP does), but the
running mean and variance are state every replica must agree on: ``fxpipe.save`` writes one
copy, and evaluation on any replica must give the same outputs. The gradient engines do not
keep them equal here (DDP broadcasts buffers in its forward, which the pipeline never calls;
FSDP2 leaves buffers alone), so after each training run of the pipeline:

- deferred batch norms (``deferred_batch_norm=True``): their accumulated sums and counts are
  summed over the replicas before the commit, so the running statistics are those of the
  global batch, equal to eager training on all the replicas' rows at once;
- the other batch norms: their running statistics (and ``num_batches_tracked``) are broadcast
  from the first replica, as DDP's ``broadcast_buffers=True`` does;
- the other buffers a stage's graph writes (MoCo's queue of keys, DINO's centre, a step
  counter), and the parameters it writes in place (a centre kept as a frozen parameter):
  broadcast from the first replica too, as DDP does with buffers before each forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.runtime.stage.batchnorm import fold_staged
from fxpipe.runtime.stage.keepstate import norm_statistics, state, written_buffers

__all__ = ["norms_of", "sync_norms", "written_of"]


def norms_of(modules: Iterable[nn.Module]) -> list[Any]:
    """Return the batch norms tracking running statistics in ``modules`` and their submodules, once each.

    A norm the graph calls as a function on buffers (exported, or a subclass whose forward fx
    traced through, timm's ``BatchNormAct2d``) has no module in a stage: it is returned as a
    record of its buffers (``running_mean``, ``running_var``, ``num_batches_tracked``).
    """
    found: dict[int, Any] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None:
                found.setdefault(id(m.running_mean), m)
        if isinstance(module, torch.fx.GraphModule):
            for record in _called_norms(module):
                found.setdefault(id(record.running_mean), record)
    return list(found.values())


def written_of(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Return the buffers (and frozen parameters: a DINO centre) the graphs in ``modules`` write in place, once each.

    Not the norms' statistics, which :func:`sync_norms` handles as such.
    """
    found: dict[int, torch.Tensor] = {}
    for module in modules:
        if not isinstance(module, torch.fx.GraphModule):
            continue
        statistics, buffers = norm_statistics(module), state(module)
        for name in written_buffers(module):  # one order on every replica: they hold the same graphs
            b = buffers.get(name)
            if b is not None and name not in statistics and not b.is_meta and not hasattr(b, "to_local"):
                found.setdefault(id(b), b)
    return list(found.values())


def _called_norms(gm: torch.fx.GraphModule) -> list[SimpleNamespace]:
    """Return a record of the buffers of each batch norm ``gm`` calls as a function (by the buffers' module path)."""
    buffers = dict(gm.named_buffers())
    by_path: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(norm_statistics(gm)):  # one order on every replica: the broadcast is one flat tensor
        path, _, field = name.rpartition(".")
        if name in buffers:
            by_path.setdefault(path, {})[field] = buffers[name]
    return [SimpleNamespace(running_mean=held["running_mean"], running_var=held.get("running_var"),
                            num_batches_tracked=held.get("num_batches_tracked"))
            for held in by_path.values() if held.get("running_mean") is not None]


def sync_norms(norms: Sequence[Any], deferred: Sequence[_BatchNorm], group: Any,
               wait: Callable[[list, str], None], written: Sequence[torch.Tensor] = ()) -> None:
    """Sum the deferred norms' sums over ``group`` (the replicas); broadcast the others' statistics from its first rank.

    The ``written`` buffers (:func:`written_of`) are broadcast with them. ``wait(works, what)``
    waits for the collectives, bounded by the pipe's timeout.
    """
    mine = {id(bn.running_mean) for bn in deferred}  # a module, or the record of a call reading its buffers
    if deferred:
        _sum_deferred(list(deferred), group, wait)
    others = [bn for bn in norms if id(bn.running_mean) not in mine]
    buffers = [b for bn in others for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
               if b is not None and not hasattr(b, "to_local")]
    seen = {id(b) for b in buffers}
    buffers += [b for b in written if id(b) not in seen]
    if buffers:
        _broadcast(buffers, group, wait)


def _sum_deferred(deferred: list[_BatchNorm], group: Any, wait: Callable[[list, str], None]) -> None:
    """Replace each deferred norm's sums and count by their totals over the replicas."""
    fold_staged(deferred)
    parts = []
    for bn in deferred:
        sums = vars(bn)
        assert bn.running_mean is not None  # deferred batch norms track running statistics
        zeros = torch.zeros(bn.num_features, dtype=torch.float64, device=bn.running_mean.device)
        total, squares = sums.get("_fxpipe_sum"), sums.get("_fxpipe_sum_squares")
        parts.append(torch.cat([zeros if total is None else total, zeros if squares is None else squares,
                                zeros[:1] + sums.get("_fxpipe_count", 0)]))
    flat = torch.cat(parts)
    wait([dist.all_reduce(flat, group=group, async_op=True)], "summing batch norm statistics over the replicas")
    for bn, part in zip(deferred, flat.split([2 * bn.num_features + 1 for bn in deferred])):
        c = bn.num_features
        count = int(part[2 * c].item())
        vars(bn).update(_fxpipe_sum=part[:c].clone() if count else None,
                        _fxpipe_sum_squares=part[c:2 * c].clone() if count else None, _fxpipe_count=count)


def _broadcast(buffers: list[torch.Tensor], group: Any, wait: Callable[[list, str], None]) -> None:
    """Copy the first replica's running statistics and written buffers to every replica: one broadcast per dtype."""
    src = dist.get_global_rank(group, 0)
    for dtype in dict.fromkeys(b.dtype for b in buffers):
        same = [b for b in buffers if b.dtype == dtype]
        flat = torch.cat([b.reshape(-1) for b in same])
        wait([dist.broadcast(flat, src=src, group=group, async_op=True)],
             "copying the first replica's batch norm statistics and written buffers")
        with torch.no_grad():
            for b, part in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(part.view_as(b))
