"""Describe tensors by shape and dtype: the values :mod:`fxpipe.passes.annotate` records in ``node.meta``.

Reads and writes no ``node.meta``.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fxpipe.passes.records import register_records
from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten, tree_map

__all__ = ["TensorSpec", "differentiable", "map_leaves", "spec_of", "unflatten", "value_bytes"]


@dataclass(frozen=True)
class TensorSpec:
    """Describe one tensor by shape, dtype, whether it requires grad and whether it is channels-last (a pytree leaf).

    ``channels_last`` marks a 4-D or 5-D tensor laid out channels-last and not also contiguous
    (a convolution's activation of a ``channels_last`` model): a value crossing ranks keeps it.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    channels_last: bool = False

    @property
    def memory_format(self) -> torch.memory_format:
        """Return the memory format a tensor of this spec is laid out in."""
        if not self.channels_last:
            return torch.contiguous_format
        return torch.channels_last if len(self.shape) == 4 else torch.channels_last_3d

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
    return map_leaves(_spec, value)


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """Map ``fn`` over the leaves of ``value`` (``tree_map``), also where a container's constructor reads its fields.

    A named tuple such as ``PackedSequence`` checks its fields in ``__new__`` (its
    ``batch_sizes.device``), which a spec does not have: such a tuple is built without it.
    """
    try:
        return tree_map(fn, value)
    except Exception:  # noqa: BLE001 - rebuilt by hand below; a failing fn fails there again
        return _raw(fn, value)


def unflatten(spec: TreeSpec, leaves: list[Any]) -> Any:
    """Build ``spec``'s structure from ``leaves`` (``spec.unflatten``), a named tuple without its ``__new__`` if need be.

    A value of another kind in a ``PackedSequence`` (its gradient: ``None`` for ``batch_sizes``)
    fails its ``__new__``'s checks.
    """
    try:
        return spec.unflatten(leaves)
    except Exception:  # noqa: BLE001 - rebuilt by hand below
        it = iter(leaves)
        return _build(spec, it)


def _build(spec: TreeSpec, it: Iterator[Any]) -> Any:
    """Build one node of ``spec`` from the leaves left in ``it``."""
    if spec.is_leaf():
        return next(it)
    children = [_build(spec.child(k), it) for k in range(spec.num_children)]
    if spec.type is namedtuple:
        return tuple.__new__(spec.context, children)
    return SUPPORTED_NODES[spec.type].unflatten_fn(children, spec.context)


def _spec(v: Any) -> Any:
    """Return the spec of a tensor; any other value as it is."""
    if not isinstance(v, torch.Tensor):
        return v
    return TensorSpec(tuple(int(d) for d in v.shape), v.dtype, bool(v.requires_grad), channels_last(v))


def channels_last(t: torch.Tensor) -> bool:
    """Tell whether a 4-D or 5-D tensor is laid out channels-last and not also contiguous."""
    try:
        if t.dim() not in (4, 5) or t.layout != torch.strided or t.is_nested or t.is_contiguous():
            return False
        return t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    except (RuntimeError, NotImplementedError):  # a tensor subclass without strides
        return False


def _raw(fn: Callable[[Any], Any], value: Any) -> Any:
    """Map ``fn`` over lists, tuples, dicts and named tuples, building a named tuple without its ``__new__``."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return tuple.__new__(type(value), [_raw(fn, v) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_raw(fn, v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _raw(fn, v)) for k, v in value.items())
    return tree_map(fn, value)  # a leaf, or a registered record (a dataclass): as tree_map maps it


def value_bytes(spec: Any) -> int:
    """Sum the bytes of the :class:`TensorSpec` leaves in ``spec``."""
    leaves, _ = tree_flatten(spec)
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, TensorSpec))
