"""Replay what ``fxpipe.deferred_init()`` recorded (:mod:`fxpipe.materialize.recording`): only the ops a tensor needs.

    recipe     a meta tensor's storage group and its view of it (shape, strides, offset, dtype)
    slice      the ops that wrote that group, then, for each, the ops that wrote any group it read
               before it ran: the backward slice, in the recorded order
    replay     run the slice on a device (factories' devices replaced by it, constants moved to it),
               each storage made anew; the tensor is its view of its storage
    streams    each random op draws from the stream of the first module (model order) whose
               tensors depend on it, seeded by that module's FQN: the same numbers for any split

Only the slice runs, so replaying a parameter allocates it and what its values were computed
from, not the rest of the model; a tensor whose storage an ``empty`` made is replayed straight
into the tensor the stage allocated (no second copy). A tensor whose slice reads a meta tensor
made outside the recording has no recipe (it is filled as any meta tensor: by ``init=`` or
``reset_parameters()``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import DeferredInitError
from fxpipe.materialize.recording import Const, Recording, Ref, group_of, ref_of

__all__ = ["Recipe", "recipe_of", "replay_placed", "slice_ops"]

log = logging.getLogger(__name__)

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                          torch.ops.aten.new_empty_strided.default})  # make storage, write no values


@dataclass(frozen=True)
class Recipe:
    """How to compute one tensor: the recording that made its storage, and its view of that storage."""

    recording: Recording
    view: Ref


def slice_ops(recording: Recording, groups: Iterable[int], before: int | None = None) -> list[int]:
    """Return the indices of the ops the contents of ``groups`` depend on (before op ``before``), in order."""
    covered: dict[int, int] = {}  # group -> every writer before this op index is in the slice
    todo = [(g, len(recording.ops) if before is None else before) for g in groups]
    needed: set[int] = set()
    while todo:
        group, bound = todo.pop()
        start = covered.get(group, 0)
        if bound <= start:
            continue
        covered[group] = bound
        writers = recording.writers.get(group, [])
        for i in writers[bisect.bisect_left(writers, start):bisect.bisect_left(writers, bound)]:
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


class _Streams:
    """One random stream per owning module, seeded by its FQN, kept in the device's default generator."""

    def __init__(self, device: torch.device, seed_of: Callable[[str], int]) -> None:
        self.generator: torch.Generator | None = torch.default_generator if device.type == "cpu" else None
        if device.type == "cuda":
            self.generator = torch.cuda.default_generators[
                torch.cuda.current_device() if device.index is None else device.index]
        self.seed_of = seed_of
        self.states: dict[str, torch.Tensor] = {}
        self.current: str | None = None

    def use(self, fqn: str) -> None:
        """Make the generator continue module ``fqn``'s stream (a new stream starts at its seed)."""
        if fqn == self.current:
            return
        if self.generator is None:  # another device type: each stream starts at its seed, none resumes
            torch.manual_seed(self.seed_of(fqn))
        else:
            if self.current is not None:
                self.states[self.current] = self.generator.get_state()
            if fqn in self.states:
                self.generator.set_state(self.states.pop(fqn))
            else:
                self.generator.manual_seed(self.seed_of(fqn))
        self.current = fqn


def _run(recording: Recording, order: Sequence[int], recipes: Sequence[Recipe], device: torch.device,
         into: Sequence[torch.Tensor | None], streams: _Streams, stream_of: Callable[[int], str]) -> list[torch.Tensor]:
    """Replay ops ``order`` of ``recording`` on ``device``; return the values of ``recipes``.

    A random op draws from the stream of module ``stream_of(op index)``. A recipe whose storage
    an ``empty`` made, and which is that whole storage, is replayed into its tensor in ``into``
    (allocated already), so no second copy of it is made.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(recording.default_dtype)  # a factory without dtype= makes what it made on meta
    try:
        return _run_ops(recording, order, recipes, device, into, streams, stream_of)
    finally:
        torch.set_default_dtype(previous)


def _run_ops(recording: Recording, order: Sequence[int], recipes: Sequence[Recipe], device: torch.device,
             into: Sequence[torch.Tensor | None], streams: _Streams, stream_of: Callable[[int], str]) -> list[torch.Tensor]:
    """:func:`_run` under the default dtype of the recording."""
    env: dict[int, torch.Tensor] = {}
    targets = {r.view.group: t for r, t in zip(recipes, into) if t is not None and t.device == device}
    for i in order:
        op = recording.ops[i]
        if op.func in _ALLOCATIONS and len(op.creates) == 1 and op.creates[0][1].group in targets:
            ref = op.creates[0][1]
            if ref_of(targets[ref.group], ref.group) == ref:
                env[ref.group] = targets[ref.group]
                continue
        args, kwargs = tree_unflatten([_argument(x, env, device, op.func) for x in op.leaves], op.spec)
        if torch.Tag.nondeterministic_seeded in op.func.tags:
            streams.use(stream_of(i))
        outs = tree_flatten(op.func(*args, **kwargs))[0]
        for j, ref in op.creates:
            made = outs[j]
            if ref_of(made, ref.group) != ref:
                raise DeferredInitError(f"{op.func} replayed on {device} (recorded for {op.device}) made a tensor of "
                                        f"shape {tuple(made.shape)}, strides {tuple(made.stride())}, dtype {made.dtype}, "
                                        f"where meta made {ref.size}, {ref.stride}, {ref.dtype}; it cannot be replayed "
                                        "there: pass init=, or build the model on a real device")
            env[ref.group] = made
    return [_view(env[r.view.group], r.view) for r in recipes]


def _random_ops(recording: Recording, ops: Iterable[int]) -> list[int]:
    """Return the random ops (those that draw from a generator) among ``ops``."""
    return [i for i in ops if torch.Tag.nondeterministic_seeded in recording.ops[i].func.tags]


class _Owners:
    """Which module's stream each recorded random op draws from: the first module, in model order,
    whose recorded tensors depend on it. A random op several modules' tensors depend on (a template
    layer deep-copied into each, as ``nn.TransformerEncoder`` does) is drawn once, from its owner's
    stream, so every copy gets the same numbers, as in eager."""

    def __init__(self, groups: Sequence[tuple[str, list[Recipe]]]) -> None:
        self.owner: dict[tuple[int, int], str] = {}  # (recording serial, op index) -> module FQN
        self.owned: dict[str, dict[int, list[int]]] = {}  # module FQN -> serial -> its random ops, in order
        for fqn, recipes in groups:
            for recording, mine in _by_recording(recipes):
                for i in _random_ops(recording, slice_ops(recording, {r.view.group for r in mine})):
                    if self.owner.setdefault((recording.serial, i), fqn) == fqn:
                        self.owned.setdefault(fqn, {}).setdefault(recording.serial, []).append(i)

    def of(self, recording: Recording, default: str) -> Callable[[int], str]:
        """Return the function naming the stream each random op of ``recording`` draws from."""
        return lambda i: self.owner.get((recording.serial, i), default)

    def closure(self, recording: Recording, ops: set[int]) -> list[int]:
        """Add to ``ops`` every earlier random op of the streams its random ops draw from, with their inputs."""
        todo = _random_ops(recording, ops)
        while todo:
            i = todo.pop()
            stream = self.owned.get(self.owner.get((recording.serial, i), ""), {}).get(recording.serial, [])
            for j in stream[:bisect.bisect_left(stream, i)]:
                if j not in ops:
                    new = {j, *slice_ops(recording, recording.ops[j].reads, before=j)} - ops
                    ops |= new
                    todo.extend(_random_ops(recording, new))
        return sorted(ops)


def _by_recording(recipes: Sequence[Recipe]) -> list[tuple[Recording, list[Recipe]]]:
    """Group ``recipes`` by recording, in the order the recordings were made."""
    found: dict[int, tuple[Recording, list[Recipe]]] = {}
    for r in recipes:
        found.setdefault(r.recording.serial, (r.recording, []))[1].append(r)
    return [found[k] for k in sorted(found)]


def replay_placed(table: Mapping[int, object], recipes: Mapping[int, Recipe],
                  modules: Sequence[tuple[str, object, list[int]]], placement: Mapping[int, torch.device],
                  seed_of: Callable[[str], int]) -> set[int]:
    """Fill the placed tensors that have recipes, module by module; return the ids filled.

    A tensor belongs to the first module holding it (a tied one is replayed once). Each module's
    recorded tensors are replayed together, the unplaced ones as temporaries, with the random
    generator on the module's stream, seeded by ``seed_of(module FQN)`` (:class:`_Owners`), so a
    tensor's values do not depend on which others are placed.
    """
    owner: dict[int, str] = {}
    groups: list[tuple[str, list[int]]] = []
    for fqn, _, keys in modules:
        mine = [k for k in keys if k in recipes and k not in owner]
        owner.update((k, fqn) for k in mine)
        if mine:
            groups.append((fqn, mine))
    placed = [(fqn, keys) for fqn, keys in groups if any(k in placement for k in keys)]
    if not placed:
        return set()
    owners = _Owners([(fqn, [recipes[k] for k in keys]) for fqn, keys in groups])
    filled: set[int] = set()
    cuda = sorted({d.index or 0 for d in placement.values() if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        for fqn, keys in placed:
            device = next(placement[k] for k in keys if k in placement)
            streams = _Streams(device, seed_of)
            into = {k: table[k].tensor for k in keys if k in placement}  # type: ignore[attr-defined]
            for recording, wanted in _by_recording([recipes[k] for k in keys]):
                order = owners.closure(recording, set(slice_ops(recording, {r.view.group for r in wanted})))
                ids = [k for k in keys if recipes[k].recording is recording]
                values = _run(recording, order, wanted, device, [into.get(k) for k in ids], streams,
                              owners.of(recording, fqn))
                for key, value in zip(ids, values):
                    if key in into:
                        if value is not into[key]:
                            into[key].copy_(value)
                        filled.add(key)
    log.debug("replayed %d recorded tensor(s) in %d module(s)", len(filled), len(placed))
    return filled
