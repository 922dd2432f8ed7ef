"""Replay what ``fxpipe.deferred_init()`` recorded (:mod:`fxpipe.recording`): only the ops a tensor needs.

    recipe     a meta tensor's storage group and its view of it (shape, strides, offset, dtype)
    slice      the ops that wrote that group, then, for each, the ops that wrote any group it read
               before it ran: the backward slice, in the recorded order
    replay     run the slice on a device (factories' devices replaced by it, constants moved to it),
               each storage made anew; the tensor is its view of its storage

Only the slice runs, so replaying a parameter allocates it and what its values were computed
from, not the rest of the model; a tensor whose storage an ``empty`` made is replayed straight
into the tensor the stage allocated (no second copy). A tensor whose slice reads a meta tensor made outside the
recording has no recipe (it is filled as any meta tensor: by ``init=`` or ``reset_parameters()``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import DeferredInitError
from fxpipe.recording import Const, Recording, Ref, group_of, ref_of

__all__ = ["Recipe", "recipe_of", "replay", "replay_placed", "slice_ops"]

log = logging.getLogger(__name__)

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                          torch.ops.aten.new_empty_strided.default})  # make storage, write no values


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


def _run(recording: Recording, recipes: Sequence[Recipe], device: torch.device,
         into: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """Replay the slice of ``recipes`` (all of ``recording``) on ``device``; return their values.

    A recipe whose storage an ``empty`` made, and which is that whole storage, is replayed into its
    tensor in ``into`` (allocated already), so no second copy of it is made.
    """
    env: dict[int, torch.Tensor] = {}
    targets = {r.view.group: t for r, t in zip(recipes, into) if t is not None and t.device == device}
    for i in slice_ops(recording, {r.view.group for r in recipes}):
        op = recording.ops[i]
        if op.func in _ALLOCATIONS and len(op.creates) == 1 and op.creates[0][1].group in targets:
            ref = op.creates[0][1]
            if ref_of(targets[ref.group], ref.group) == ref:
                env[ref.group] = targets[ref.group]
                continue
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


def replay(recipes: Sequence[Recipe], device: torch.device,
           into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Compute the tensors of ``recipes`` on ``device``, their slices together in recorded order.

    ``into`` may give, for each recipe, a tensor on ``device`` of its shape to compute it in.
    """
    into = list(into) if into is not None else [None] * len(recipes)
    values: dict[int, torch.Tensor] = {}
    by_recording: dict[int, list[int]] = {}
    for i, r in enumerate(recipes):
        by_recording.setdefault(r.recording.serial, []).append(i)
    with torch.no_grad():
        for serial in sorted(by_recording):
            mine = by_recording[serial]
            values.update(zip(mine, _run(recipes[mine[0]].recording, [recipes[i] for i in mine], device,
                                         [into[i] for i in mine])))
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
            into = [table[k].tensor if k in placement else None for k in keys]  # type: ignore[attr-defined]
            values = replay([recipes[k] for k in keys], device, into)
            with torch.no_grad():
                for key, value, tensor in zip(keys, values, into):
                    if tensor is not None:
                        if value is not tensor:
                            tensor.copy_(value)
                        filled.add(key)
    log.debug("replayed %d recorded tensor(s) in %d module(s)", len(filled), len(groups))
    return filled
