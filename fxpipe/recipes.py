"""What ``fxpipe.deferred_init()`` records, and its replay: only the ops a tensor's values depend on.

    record     the ops that create or write storage, in order; a tensor argument is a view of a
               storage group (one per storage made under the context): :class:`Ref`
    recipe     a meta tensor's storage group and its view of it (shape, strides, offset, dtype)
    slice      the ops that wrote that group, then, for each, the ops that wrote any group it read
               before it ran: the backward slice, in the recorded order
    replay     run the slice on a device (factories' devices replaced by it, constants moved to it),
               each storage made anew; the tensor is its view of its storage

Only the slice runs, so replaying a parameter allocates it and what its values were computed
from, not the rest of the model. A tensor whose slice reads a meta tensor made outside the
recording has no recipe (it is filled as any meta tensor: by ``init=`` or ``reset_parameters()``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import DeferredInitError

__all__ = ["Const", "Op", "Recipe", "Recording", "Ref", "group_of", "recipe_of", "ref_of", "replay", "replay_placed",
           "slice_ops"]

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Recipe:
    """How to compute one tensor: the recording that made its storage, and its view of that storage."""

    recording: Recording
    view: Ref


def slice_ops(recording: Recording, groups: Iterable[int]) -> list[int]:
    """Return the indices of the ops the final contents of ``groups`` depend on, in recorded order."""
    covered: dict[int, int] = {}  # group -> every writer before this op index is in the slice
    todo = [(g, len(recording.ops)) for g in groups]
    needed: set[int] = set()
    while todo:
        group, before = todo.pop()
        start = covered.get(group, 0)
        if before <= start:
            continue
        covered[group] = before
        writers = recording.writers.get(group, [])
        for i in writers[bisect.bisect_left(writers, start):bisect.bisect_left(writers, before)]:
            if i not in needed:
                needed.add(i)
                todo.extend((g, i) for g in recording.ops[i].reads)
    return sorted(needed)


def recipe_of(tensor: torch.Tensor) -> Recipe | None:
    """Return the recipe of a meta tensor made under ``deferred_init()``, or ``None`` if it has none."""
    found = group_of(tensor)
    if found is None:
        return None
    recording, group = found
    ops = slice_ops(recording, [group])
    if any(g in recording.foreign for i in ops for g in recording.ops[i].reads):
        log.debug("a tensor of shape %s was computed from a meta tensor made outside deferred_init(): no recipe",
                  tuple(tensor.shape))
        return None
    return Recipe(recording, ref_of(tensor, group))


def _view(base: torch.Tensor, ref: Ref) -> torch.Tensor:
    """Return the view ``ref`` describes of the storage ``base`` holds."""
    if base.dtype != ref.dtype:  # a view under another dtype (Tensor.view(dtype)): go through the storage
        return torch.empty(0, dtype=ref.dtype, device=base.device).set_(
            base.untyped_storage(), ref.offset, ref.size, ref.stride)
    if (tuple(base.shape), tuple(base.stride()), base.storage_offset()) == (ref.size, ref.stride, ref.offset):
        return base
    return base.as_strided(ref.size, ref.stride, ref.offset)


def _argument(leaf: object, env: dict[int, torch.Tensor], device: torch.device, func: object) -> object:
    """Return the value an op's recorded argument has in this replay."""
    if isinstance(leaf, Ref):
        return _view(env[leaf.group], leaf)
    if isinstance(leaf, Const):
        if leaf.tensor._version != leaf.version:
            raise DeferredInitError(f"a real tensor that {func} read while fxpipe.deferred_init() recorded has been "
                                    "written since, so the recording no longer computes what it did; leave "
                                    "tensors used to build the model unchanged until it is materialized")
        return leaf.tensor.to(device, copy=True)  # a write to it or a view of it must not reach the original
    if isinstance(leaf, torch.device):
        return device
    if isinstance(leaf, torch.Generator):
        return None  # the generator seeded for this replay
    return leaf


def _run(recording: Recording, recipes: Sequence[Recipe], device: torch.device) -> list[torch.Tensor]:
    """Replay the slice of ``recipes`` (all of ``recording``) on ``device``; return their values."""
    env: dict[int, torch.Tensor] = {}
    for i in slice_ops(recording, {r.view.group for r in recipes}):
        op = recording.ops[i]
        args, kwargs = tree_unflatten([_argument(x, env, device, op.func) for x in op.leaves], op.spec)
        outs = tree_flatten(op.func(*args, **kwargs))[0]
        for j, ref in op.creates:
            made = outs[j]
            if ref_of(made, ref.group) != ref:
                raise DeferredInitError(f"{op.func} replayed on {device} (recorded for {op.device}) made a tensor of "
                                        f"shape {tuple(made.shape)}, strides {tuple(made.stride())}, where meta made "
                                        f"{ref.size}, {ref.stride}; it cannot be replayed there: pass init=, or build "
                                        "the model on a real device")
            env[ref.group] = made
    return [_view(env[r.view.group], r.view) for r in recipes]


def replay(recipes: Sequence[Recipe], device: torch.device) -> list[torch.Tensor]:
    """Compute the tensors of ``recipes`` on ``device``, their slices together in recorded order."""
    values: dict[int, torch.Tensor] = {}
    by_recording: dict[int, list[int]] = {}
    for i, r in enumerate(recipes):
        by_recording.setdefault(r.recording.serial, []).append(i)
    with torch.no_grad():
        for serial in sorted(by_recording):
            mine = [recipes[i] for i in by_recording[serial]]
            values.update(zip(by_recording[serial], _run(mine[0].recording, mine, device)))
    return [values[i] for i in range(len(recipes))]


def replay_placed(table: Mapping[int, object], recipes: Mapping[int, Recipe],
                  modules: Sequence[tuple[str, object, list[int]]], placement: Mapping[int, torch.device],
                  seed_of: Callable[[str], int]) -> set[int]:
    """Fill the placed tensors that have recipes, module by module; return the ids filled.

    A tensor belongs to the first module holding it (a tied one is replayed once). Each module's
    recorded tensors are replayed together under ``torch.manual_seed(seed_of(module FQN))``, the
    unplaced ones as temporaries, so a tensor's values do not depend on which others are placed.
    """
    owner: dict[int, str] = {}
    groups: list[tuple[str, list[int]]] = []
    for fqn, _, keys in modules:
        mine = [k for k in keys if k in recipes and k not in owner]
        owner.update((k, fqn) for k in mine)
        if any(k in placement for k in mine):
            groups.append((fqn, mine))
    if not groups:
        return set()
    filled: set[int] = set()
    cuda = sorted({d.index or 0 for d in placement.values() if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        for fqn, keys in groups:
            device = next(placement[k] for k in keys if k in placement)
            torch.manual_seed(seed_of(fqn))
            values = replay([recipes[k] for k in keys], device)
            with torch.no_grad():
                for key, value in zip(keys, values):
                    if key in placement:
                        table[key].tensor.copy_(value)  # type: ignore[attr-defined]
                        filled.add(key)
    log.debug("replayed %d recorded tensor(s) in %d module(s)", len(filled), len(groups))
    return filled
