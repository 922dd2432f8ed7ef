"""Warn, at compile and on every rank, where the ranks built the model with different weights.

Each rank keeps its own stages' weights from the model it built: ranks that built it from
different random states (``torch.manual_seed(base + rank)`` before building, for data
augmentation) run a mix of weights no rank built, silently. One ``all_gather_object`` of a
fingerprint per tensor (the sum of 16 of its entries, spread over it) tells them apart; the
tensors on meta are left out (built there, loaded later).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.errors import user_stacklevel

__all__ = ["fingerprints", "warn_other_weights"]

log = logging.getLogger(__name__)


def fingerprints(model: nn.Module) -> dict[str, float]:
    """Return a number per real floating parameter and buffer of ``model`` that differs where its values differ."""
    sums: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if t.is_meta or not t.is_floating_point() or t.numel() == 0:
                continue
            if t.layout != torch.strided:  # a sparse buffer (a graph's adjacency): the values it stores
                t = t._values() if t.layout == torch.sparse_coo else t.values()
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 16)][:16].double()  # NaN and inf as numbers: one NaN hid the rest
            sums.setdefault(t.device, []).append((name, torch.nan_to_num(sample, nan=0.5, posinf=1e300,
                                                                         neginf=-1e300).sum()))
    found: dict[str, float] = {}
    for pairs in sums.values():  # one copy to the host per device, not one per tensor
        found.update(zip([n for n, _ in pairs], torch.stack([v for _, v in pairs]).tolist()))
    return found


def warn_other_weights(model: nn.Module) -> None:
    """Compare this rank's weights' fingerprints with every other rank's; warn naming those that differ."""
    mine = fingerprints(model)
    told: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(told, mine)
    differ = {rank: [k for k, v in (theirs or {}).items() if k in mine and not _same(v, mine[k])]
              for rank, theirs in enumerate(told) if rank != dist.get_rank()}
    differ = {rank: names for rank, names in differ.items() if names}
    if not differ:
        return
    rank, names = next(iter(differ.items()))
    warnings.warn(
        f"rank {dist.get_rank()} built the model with other weights than rank {rank} ({', '.join(names[:3])}"
        f"{' ...' if len(names) > 3 else ''} differ; ranks {sorted(differ)} in all): each rank keeps its own stages' "
        "weights, so the pipe would run a mix no rank built. Seed every rank alike before building the model "
        "(torch.manual_seed(0) on each; seed per rank after compile, for data or dropout), or load the weights after "
        "compile (fxpipe.load, or weights=); ignore this if you do", stacklevel=user_stacklevel())


def _same(a: float, b: float) -> bool:
    """Tell whether two fingerprints agree (a buffer holding NaN, as every rank built it, agrees with itself)."""
    return a == b or (math.isnan(a) and math.isnan(b))
