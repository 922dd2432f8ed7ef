"""What ``fxpipe.deferred_init()`` records: the ops that create or write storage, in order.

A tensor argument is kept as a :class:`Ref`, a view of a storage group (one group per storage
made under the context: shape, strides, offset, dtype); a real tensor from outside as a
:class:`Const`. Each storage a recording made maps to (recording, group) while the storage lives,
so a parameter is found by its storage (:func:`group_of`), whatever Python object wraps it.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Const", "Op", "Recording", "Ref", "group_of", "ref_of"]

_SERIAL = itertools.count()
# the storages a recording created -> (that recording, its group); an entry goes with its storage
_OWNER: weakref.WeakKeyDictionary[Any, tuple[Recording, int]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Ref:
    """A tensor argument: a view of recorded storage ``group`` (shape, strides, offset, dtype)."""

    group: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Const:
    """A real tensor from outside the recording used as an argument, and its version then."""

    tensor: torch.Tensor
    version: int


@dataclass
class Op:
    """One recorded op: its arguments flattened (tensors as :class:`Ref`), what it creates, writes, reads."""

    func: Any  # torch._ops.OpOverload
    spec: Any  # the pytree spec of (args, kwargs)
    leaves: list
    creates: list[tuple[int, Ref]]  # (index among the flattened outputs, the storage it makes)
    writes: frozenset[int]
    reads: frozenset[int]
    device: torch.device | None  # the device its factory named (default or explicit), replaced by meta


class Recording:
    """The ops of one ``deferred_init()`` context, in order, and which ops write each storage group."""

    def __init__(self) -> None:
        self.serial = next(_SERIAL)
        self.default_dtype = torch.get_default_dtype()  # factories without dtype= replay with it, not with the replay's
        self.ops: list[Op] = []
        self.writers: dict[int, list[int]] = {}
        self.foreign: set[int] = set()  # groups of meta storages made elsewhere: nothing can replay them
        self._groups: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._count = 0

    def group(self, tensor: torch.Tensor, *, new: bool) -> int:
        """Return the group of ``tensor``'s storage, giving a storage seen first its own."""
        storage = tensor.untyped_storage()
        gid = self._groups.get(storage)
        if gid is None:
            gid = self._groups[storage] = self._count
            self._count += 1
            if new and storage not in _OWNER:
                _OWNER[storage] = (self, gid)
            else:
                self.foreign.add(gid)
        return gid

    def knows(self, tensor: torch.Tensor) -> bool:
        """Tell whether ``tensor``'s storage has a group here already."""
        return tensor.untyped_storage() in self._groups

    def add(self, op: Op) -> None:
        """Keep ``op`` and note it among the writers of the groups it writes."""
        for g in op.writes:
            self.writers.setdefault(g, []).append(len(self.ops))
        self.ops.append(op)


def group_of(tensor: torch.Tensor) -> tuple[Recording, int] | None:
    """Return the recording and group that made ``tensor``'s storage, or ``None``."""
    if not tensor.is_meta:
        return None
    return _OWNER.get(tensor.untyped_storage())


def ref_of(tensor: torch.Tensor, group: int) -> Ref:
    """Describe ``tensor`` as a view of storage ``group``."""
    return Ref(group, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()), tensor.dtype)
