"""One micro-batch of selective recomputation: where its saved tensors live, and how the dropped ones come back.

The tape of :mod:`fxpipe.runtime.stage.selective` for one micro-batch of one stage. During the
forward it is the saved-tensor hooks' pack (:meth:`Tape.pack`) and the markers' listener
(:meth:`Tape.made`); when the forward ends it decides what recomputation runs and keeps only
the values that reads (:meth:`Tape.finish`); in backward an empty box's unpack recomputes its
node and the cheap nodes it reads of its segment, its random numbers replayed run by run::

    box of node k empty ─▶ closure of k in its segment (graph order) ─▶ run each node again
      (grad on, is_recomputing(), autocast and weight-gradient deferral as in the forward,
       saved-tensor hooks catching the n-th save of each node) ─▶ fill the live empty boxes

The tape holds no reference into the autograd graph (kept values are detached); the graph
holds the boxes and, through them, the tape.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.runtime.observe import timeline
from fxpipe.runtime.observe.blame import note_failure
from fxpipe.runtime.stage import wgrad
from fxpipe.runtime.stage.recompute import in_pass
from fxpipe.runtime.stage.rng import autocast_as, autocast_state, restore_rng, same_rng, save_rng, with_inputs
from fxpipe.runtime.stage.stream import on_device

if TYPE_CHECKING:
    from fxpipe.runtime.stage.selective import Program

__all__ = ["Tape", "unpack"]


def _ref(t: torch.Tensor) -> StorageWeakRef | None:
    """Return a weak reference to ``t``'s storage (None for a tensor without one)."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _subclass(t: torch.Tensor) -> bool:
    """Tell whether ``t`` is a tensor subclass (a DTensor under tensor parallelism), not a plain tensor."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter)


def _leaves(value: Any) -> list:
    """Return the leaves of a value (a tensor, the common case, without pytree)."""
    return [value] if isinstance(value, torch.Tensor) else tree_flatten(value)[0]


def _detach(value: Any) -> tuple[list, Any, list[bool]]:
    """Return ``value``'s leaves (tensors detached), its structure (None: one tensor), and which required grad."""
    leaves, spec = ([value], None) if isinstance(value, torch.Tensor) else tree_flatten(value)
    return ([v.detach() if isinstance(v, torch.Tensor) else v for v in leaves], spec,
            [isinstance(v, torch.Tensor) and v.requires_grad for v in leaves])


def _revive(entry: tuple[list, Any, list[bool]]) -> Any:
    """Rebuild a detached value as fresh leaves requiring grad where the original did."""
    leaves, spec, grads = entry
    fresh = [v.detach().requires_grad_(True) if g else v for v, g in zip(leaves, grads)]
    return fresh[0] if spec is None else tree_unflatten(fresh, spec)


class _Box:
    """A saved tensor's stand-in: empty until a recomputation fills it (or holding a kept one)."""

    __slots__ = ("__weakref__", "at", "geometry", "leaf", "node", "ref", "tape", "tensor")

    def __init__(self, tape: Tape, node: int, at: int = -1, tensor: torch.Tensor | None = None,
                 leaf: int = -1, geometry: tuple | None = None, ref: StorageWeakRef | None = None) -> None:
        self.tape, self.node, self.at, self.tensor = tape, node, at, tensor
        self.leaf, self.geometry = leaf, geometry  # a slice of node's value, not one of its saves
        self.ref = ref  # the saved tensor's storage, while its node runs


def unpack(obj: Any) -> Any:
    """Saved-tensor hook: return a kept tensor, or a box's, recomputing its segment first if empty."""
    if not isinstance(obj, _Box):
        return obj
    if obj.tensor is None:
        obj.tape.recompute(obj)
    return obj.tensor


class Tape:
    """One micro-batch of one stage: where its saved tensors live, and how to recompute the dropped ones."""

    def __init__(self, program: Program, i: int, inputs: Sequence[Any]) -> None:
        self.program, self.i = program, i
        self.plan = program.plan
        self.candidates, self.starts, self.saved = program.candidates, program.starts, program.plan.saved
        self.current = 0
        self.counts = [0] * len(program.nodes)
        self.owner: dict[StorageWeakRef, tuple[int, int, torch.dtype, StorageWeakRef]] = {}
        for t in program.state() + [v for x in inputs for v in _leaves(x) if isinstance(v, torch.Tensor)]:
            self._own(t, -1, -1)
        self.inputs = [_detach(x) for x in inputs]
        self.env: dict[int, tuple[list, Any, list[bool]]] = {}  # kept values a recomputation reads
        self.pending: list[_Box] = []  # the running node's own saves, told apart once it is done
        self.boxes: dict[int, list[weakref.ref]] = {}  # node -> its boxes (its saves, or slices of its value)
        self.generators = with_inputs(program.generators, inputs)  # the stage's own and those given as inputs
        self.rng = ({0: save_rng(program.device, program.replay_cpu, self.generators)}  # per run, at its start
                    if self.plan.run[:1] == [0] else {})
        self.autocast = autocast_state()
        self.deferring = wgrad.active()
        self.rerun: set[int] = set()  # the nodes recomputation may run
        self.caught: dict[tuple[int, int], weakref.ref] = {}
        self.catching = (-1, 0)

    def _own(self, t: torch.Tensor, k: int, leaf: int) -> StorageWeakRef | None:
        """Note that ``t``'s storage belongs to node ``k``'s value (-1: state or an input) unless taken."""
        ref = _ref(t)
        if ref is not None:
            held = self.owner.get(ref)
            if held is None or held[3].expired():
                self.owner[ref] = (k, leaf, t.dtype, ref)
        return ref

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor hook of the forward: keep ``t``, or drop it for a box (see the module)."""
        k = self.current
        if not isinstance(t, torch.Tensor):
            return t
        if k >= len(self.counts):  # after the last node: kept
            return t.detach()
        at = self.counts[k]
        self.counts[k] += 1
        ref = _ref(t)
        held = self.owner.get(ref) if ref is not None else None
        if held is not None and not held[3].expired():
            j, leaf, dtype, _ = held
            if j < 0 or self.candidates[j] or dtype != t.dtype or _subclass(t):
                return t.detach()  # a subclass's view (a DTensor's) cannot be remade by as_strided: kept
            box = _Box(self, j, leaf=leaf, geometry=(t.size(), t.stride(), t.storage_offset()))
            self.boxes.setdefault(j, []).append(weakref.ref(box))
            return box
        if ref is None or self.saved[k]:
            return t.detach()
        box = _Box(self, k, at, t.detach(), ref=ref)
        self.pending.append(box)
        return box

    def made(self, k: int, value: Any) -> None:
        """Marker: node ``k`` is done; own its value's storage, settle its saves, note RNG at a segment's start."""
        candidate = self.candidates[k]
        if isinstance(value, torch.Tensor):
            mine = {self._own(value, k, 0)}
        else:
            mine = {self._own(t, k, n) for n, t in enumerate(_leaves(value)) if isinstance(t, torch.Tensor)}
        if self.pending:
            for box in self.pending:  # its own value's storage, if kept, stays; the rest is dropped
                if not (candidate and box.ref in mine):
                    box.tensor = None
                    self.boxes.setdefault(k, []).append(weakref.ref(box))
                box.ref = None
            self.pending = []
        if candidate:
            self.env[k] = _detach(value)
        for c, region in self.program.release.get(k, ()):  # kept values no recomputation can read any more
            if c in self.env and not any(r() is not None for j in region for r in self.boxes.get(j, ())):
                del self.env[c]
        self.current = k + 1
        r = self.starts[k]
        if r >= 0:
            self.rng[r] = save_rng(self.program.device, self.program.replay_cpu, self.generators)

    def finish(self) -> None:
        """End of the forward: decide which nodes recomputation runs; keep only the values it reads."""
        plan, program = self.plan, self.program
        self.owner.clear()
        end = save_rng(program.device, program.replay_cpu, self.generators)
        rerun = {k for k, refs in self.boxes.items() if any(r() is not None for r in refs)}
        drawn = {r for r in self.rng if not same_rng(self.rng[r], self.rng.get(r + 1, end))}
        needed: set[int] = set()
        stack = list(rerun)
        while stack:
            while stack:
                k = stack.pop()
                for a in program.reads[k]:
                    if plan.candidate(a):
                        if a not in rerun or plan.segment[a] != plan.segment[k]:
                            needed.add(a)
                    elif a not in rerun:
                        rerun.add(a)
                        stack.append(a)
            for r in drawn:  # random numbers drawn: a run replays in order, up to its last node needed
                last = max((k for k in program.members[r] if k in rerun), default=-1)
                stack += [k for k in program.members[r] if k <= last and k not in rerun]
                rerun.update(stack)
        self.env = {k: v for k, v in self.env.items() if k in needed}
        self.rerun = rerun
        self.rng = {r: state for r, state in self.rng.items() if r in drawn}
        self.caught = {(k, box.at): r for k, refs in self.boxes.items() for r in refs
                       if (box := r()) is not None and box.at >= 0}

    def value(self, node: torch.fx.Node, local: dict[int, Any]) -> Any:
        """Return an input of a recomputed node: recomputed, kept, an input of the stage, or state."""
        program = self.program
        if node.op == "get_attr":
            return program.attr(str(node.target))
        if node.op == "placeholder":
            return _revive(self.inputs[program.placeholder[node]])
        k = program.position[node]
        return local[k] if k in local else _revive(self.env[k])

    def catch(self, t: torch.Tensor) -> None:
        """Saved-tensor hook of a recomputation: fill the box of the tensor saved at this position."""
        k, at = self.catching
        self.catching = (k, at + 1)
        ref = self.caught.get((k, at))
        box = ref() if ref is not None else None
        if box is not None and box.tensor is None:
            box.tensor = t.detach()

    def _closure(self, k: int) -> list[int]:
        """Return the nodes a recomputation of node ``k`` runs, in graph order: its cheap ancestors
        of its segment, and in a run that drew random numbers everything before them."""
        plan, program, seg = self.plan, self.program, self.plan.segment[k]
        chosen, stack = {k}, [k]
        while stack:
            j = stack.pop()
            more = [a for a in program.reads[j] if a in self.rerun and plan.segment[a] == seg and a not in self.env]
            if plan.run[j] in self.rng:  # replayed random numbers: the run in order up to j
                more += [a for a in program.members[plan.run[j]] if a < j]
            for a in more:
                if a not in chosen:
                    chosen.add(a)
                    stack.append(a)
        return sorted(chosen)

    def recompute(self, want: _Box) -> None:
        """Recompute ``want``'s node and what it reads of its segment, filling every live empty box of them."""
        program, plan = self.program, self.plan
        local: dict[int, Any] = {}
        order = self._closure(want.node)
        last = {a: i for i, k in enumerate(order) for a in program.reads[k]}  # where each value is read last

        def run() -> None:
            with contextlib.ExitStack() as replay:
                at = -1
                for i, k in enumerate(order):
                    if plan.run[k] in self.rng and plan.run[k] != at:  # the random state of this run's start
                        replay.close()
                        replay.enter_context(restore_rng(program.device, self.rng[plan.run[k]]))
                    at = plan.run[k]
                    self.catching = (k, 0)
                    local[k] = program.run_node(k, lambda n: self.value(n, local))
                    for ref in self.boxes.get(k, []):
                        box = ref()
                        if box is not None and box.tensor is None and box.at < 0:
                            box.tensor = _slice(_leaves(local[k])[box.leaf], box.geometry)
                    for a in program.reads[k]:  # let a recomputed value go after its last reader
                        if last.get(a) == i:
                            local.pop(a, None)

        store = wgrad.collecting([]) if self.deferring else contextlib.nullcontext()
        with on_device(program.device), torch.enable_grad(), in_pass("recomputing"), \
                autocast_as(self.autocast), store, timeline.span("recompute", program.index, self.i, program.device), \
                torch.autograd.graph.saved_tensors_hooks(self.catch, unpack):
            try:
                program.wrap(run)
            except Exception as exc:
                note_failure(exc, program.gm, program.index, program.device, "selective recomputation in backward")
                raise
        if want.tensor is None:
            raise RuntimeError(f"stage {program.index}: selective recomputation of node "
                               f"{program.nodes[want.node].name!r} did not save what its first forward saved; "
                               "the node is not deterministic in what autograd keeps, so keep it: pass "
                               "save= returning True for it")


def _slice(t: torch.Tensor, geometry: tuple | None) -> torch.Tensor:
    """Return the view of a recomputed value that a saved tensor was (same sizes, strides, offset)."""
    t = t.detach()
    if geometry is None or (t.size(), t.stride(), t.storage_offset()) == geometry:
        return t
    return t.as_strided(*geometry)
