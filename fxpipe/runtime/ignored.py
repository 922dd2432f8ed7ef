"""Warn when a target's ignored entries (``-100``) are shared unequally by the micro-batches.

``pipe.step`` weights each micro-batch's loss by its share of the rows, which gives the
batch's mean for a loss averaged over rows. A cross-entropy that skips ``ignore_index=-100``
averages over the entries that count instead: when the micro-batches hold different shares of
them (padded rows of several lengths), the weighted means are not the batch's mean, and
nothing else would say so. Checked once per pipe, on the first step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from fxpipe.plan.batches import micro_sizes
from fxpipe.runtime.microbatch import is_summed

__all__ = ["IGNORE_INDEX", "check_targets_once", "warn_uneven_ignored"]

IGNORE_INDEX = -100  # torch's and transformers' ignore_index


def warn_uneven_ignored(values: dict[str, Any], batch: int | None, m: int, loss_fn: Callable) -> bool:
    """Warn if an integer target in ``values`` counts unequal shares of its entries per micro-batch.

    Return whether the targets were looked at (not for one micro-batch or a summed loss).
    """
    if batch is None or m < 2 or is_summed(loss_fn):
        return False
    sizes = micro_sizes(batch, m)
    for name, value in values.items():
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() < 1 \
                or value.shape[0] != batch or value.dtype == torch.bool:
            continue
        counted = (value != IGNORE_INDEX).reshape(batch, -1).sum(1)
        shares = [float(part.sum()) / (part.numel() * value[0].numel()) for part in counted.split(sizes)]
        if max(shares) - min(shares) < 1e-9:  # every micro-batch's mean weighs as its rows: eager's mean
            continue
        warnings.warn(
            f"{name} marks entries {IGNORE_INDEX} (ignore_index) in unequal shares of the micro-batches "
            f"({min(shares):.0%} to {max(shares):.0%} of each micro-batch's entries count): a loss_fn averaging over "
            "the entries that count gives each micro-batch's mean, which pipe.step weights by rows, so the step's "
            "loss and gradients differ from eager's. Pass loss_reduction='sum' with a loss_fn dividing a sum by "
            "the whole batch's count (docs/guide/using-it.md, 'What loss_fn receives'); ignore this if -100 is a "
            "class your loss counts (said once per pipe)", stacklevel=4)
        break
    return True


def check_targets_once(binding: Any, target: Any, kwargs: dict, batch: int | None, m: int, loss_fn: Callable) -> None:
    """Look at the step's target and ``labels=`` input until one step of a mean loss was looked at (per pipe)."""
    if not binding.targets_checked:
        binding.targets_checked = warn_uneven_ignored({"target": target, "labels": kwargs.get("labels")}, batch, m,
                                                      loss_fn)
