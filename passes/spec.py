"""Describe tensors by shape and dtype: the values :mod:`fxpipe.passes.annotate` records in ``node.meta``.

Reads and writes no ``node.meta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fxpipe.passes.records import register_records
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["TensorSpec", "differentiable", "spec_of", "value_bytes"]


@dataclass(frozen=True)
class TensorSpec:
    """Describe one tensor by shape, dtype and whether it requires grad (a pytree leaf)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        """Return the tensor's size in bytes."""
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * _itemsize(self.dtype)


def differentiable(dtype: torch.dtype) -> bool:
    """Tell whether tensors of ``dtype`` can carry a gradient (floating and complex ones)."""
    return dtype.is_floating_point or dtype.is_complex


def _itemsize(dtype: torch.dtype) -> int:
    """Return the bytes per element of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits // 8 * (2 if dtype.is_complex else 1)
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).bits // 8


def spec_of(value: Any) -> Any:
    """Replace every tensor in ``value`` by its :class:`TensorSpec` (a dataclass's too: see :mod:`.records`)."""
    register_records(value)
    return tree_map(
        lambda v: TensorSpec(tuple(int(d) for d in v.shape), v.dtype, bool(v.requires_grad))
        if isinstance(v, torch.Tensor)
        else v,
        value,
    )


def value_bytes(spec: Any) -> int:
    """Sum the bytes of the :class:`TensorSpec` leaves in ``spec``."""
    leaves, _ = tree_flatten(spec)
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, TensorSpec))
