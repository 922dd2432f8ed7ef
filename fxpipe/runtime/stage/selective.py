"""Selective recomputation at run time: keep what the expensive nodes made, recompute the rest in backward.

A selective forward runs with autograd on, under saved-tensor hooks, so the autograd graph is
the ordinary one; only where each saved tensor lives differs::

    forward: node k runs, autograd saves t ─▶ pack(t)          backward: autograd unpacks ─▶ unpack(box)
      t lives in a kept value (or is state) ─▶ t                 box empty: recompute its node and what it
      t lives in a cheap value, or is made   ─▶ an empty box     reads of its segment from kept values (grad
        inside a cheap node                                      on, the run's RNG state, is_recomputing());
    end of forward: keep only the kept values recomputing reads  catch the saved tensors by order; fill boxes

The stage runs an instrumented copy of its GraphModule (:func:`fxpipe.runtime.stage.marks.instrument`):
after each compute node a marker tells the tape recording on this thread that node ``k`` made
its value, so a saved tensor is told apart by its storage. Which nodes keep their values is
:func:`fxpipe.passes.selective.selective_plan`'s decision, which the simulator accounts for
too. A recomputed node saves the same tensors in the same order as in its first forward (same
inputs and requires_grad, autocast, random numbers and weight-gradient deferral), so a box is
filled by position. A :class:`Program` is one stage's (made once); a tape one micro-batch's
(:mod:`fxpipe.runtime.stage.tape`), gone with the micro-batch's autograd graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_arg

from fxpipe.passes.mutates import aliases
from fxpipe.passes.selective import SelectivePlan
from fxpipe.runtime.stage.marks import COMPUTE, made, recording
from fxpipe.runtime.stage.rng import stage_generators
from fxpipe.runtime.stage.tape import Tape, unpack

__all__ = ["Program", "foreign_wrap"]


class Program:
    """One stage's selective recomputation: its plan, its nodes, and how to run one of them again.

    ``gm`` is the module the stage runs (instrumented: its markers are not nodes of the plan).
    """

    def __init__(self, gm: torch.fx.GraphModule, plan: SelectivePlan, device: torch.device, index: int,
                 wrap: Callable[[Callable[[], None]], None] | None = None) -> None:
        self.gm, self.plan, self.device, self.index = gm, plan, device, index
        self.replay_cpu = True  # as StageCall.replay_cpu
        self.generators = stage_generators(gm)  # as StageCall.generators
        self.wrap = wrap or (lambda fn: fn())  # a stage reading tensors of other devices: swap in copies
        self.nodes = [n for n in gm.graph.nodes if n.op in COMPUTE and n.target is not made]
        assert [n.name for n in self.nodes] == plan.names, "the plan was made for another graph"
        self.position = {n: k for k, n in enumerate(self.nodes)}
        self.placeholder = {n: p for p, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        self.reads = [[self.position[a] for a in n.all_input_nodes if a in self.position] for n in self.nodes]
        self.candidates = [plan.candidate(k) for k in range(len(self.nodes))]  # read per node by the tape
        self.starts = [r if r >= 0 and r != plan.run[k] else -1  # the run starting after node k (-1: none)
                       for k, r in enumerate([*plan.run[1:], -1])]
        self.members: list[list[int]] = [[] for _ in range(plan.runs)]  # per run, its nodes
        for k, r in enumerate(plan.run):
            if r >= 0:
                self.members[r].append(k)
        self.release = _releases(self)  # node -> the kept values to let go after it unless recomputation may read them

    def state(self) -> list[torch.Tensor]:
        """Return the stage's parameters, buffers and tensor constants (kept as they are)."""
        tensors = [*self.gm.parameters(), *self.gm.buffers()]
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                value = self.attr(str(n.target))
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        return tensors

    def attr(self, target: str) -> Any:
        """Fetch a ``get_attr`` target from the stage module."""
        obj: Any = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def run_node(self, k: int, value: Callable[[torch.fx.Node], Any]) -> Any:
        """Run compute node ``k`` once more, reading its inputs through ``value``."""
        node = self.nodes[k]
        args = map_arg(node.args, value)
        kwargs = map_arg(node.kwargs, value)
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return self.gm.get_submodule(str(node.target))(*args, **kwargs)

    @contextlib.contextmanager
    def recording(self, i: int, inputs: Sequence[Any]) -> Iterator[None]:
        """Record micro-batch ``i``'s forward of the block (the instrumented stage) for selective recomputation."""
        tape = Tape(self, i, inputs)
        with recording(tape), torch.autograd.graph.saved_tensors_hooks(tape.pack, unpack):
            yield
        tape.finish()


def _releases(program: Program) -> dict[int, list[tuple[int, frozenset[int]]]]:
    """Map a node to the kept values whose fate is settled once it has run, each with its *region*.

    A kept value ``k`` is read by recomputation only through the nodes reachable from it up to
    kept nodes with storage of their own (its region, with the other nodes of their runs, which
    replay together; crossing values and views are followed through, as a box may be made on a
    storage they share).
    Their boxes are all made once the region's nodes and every reader of their values have run;
    if then none is live, no recomputation will read ``k`` and the tape lets it go at once,
    instead of holding it to the end of the forward beside what was kept in its place.
    """
    users = [[program.position[u] for u in n.users if u in program.position] for n in program.nodes]
    release: dict[int, list[tuple[int, frozenset[int]]]] = {}
    for k, kept in enumerate(program.candidates):
        if not kept:
            continue
        region: set[int] = set()
        stack = [k]
        while stack:
            for c in users[stack.pop()]:
                if c in region or (program.plan.saved[c] and not aliases(program.nodes[c])):
                    continue  # a kept node's own storage: saves of it are kept, never boxes
                region.add(c)
                stack.append(c)
        for r in {program.plan.run[c] for c in region if program.plan.run[c] >= 0}:
            region.update(program.members[r])
        settled = max([k, *region, *(c for u in region for c in users[u])])
        release.setdefault(settled, []).append((k, frozenset(region)))
    return release


class _Holder(nn.Module):
    """A module holding a stage, so ``functional_call`` can swap tensors of its into a recomputation."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the swapped tensors in place)."""
        fn()


def foreign_wrap(gm: torch.fx.GraphModule, foreign: Sequence[str], device: torch.device
                 ) -> Callable[[Callable[[], None]], None] | None:
    """Return how to run a recomputation with copies of the tensors ``gm`` reads from other devices."""
    if not foreign:
        return None
    holder = _Holder(gm)
    state = dict(gm.named_parameters(remove_duplicate=False)) | dict(gm.named_buffers(remove_duplicate=False))

    def wrap(fn: Callable[[], None]) -> None:
        torch.func.functional_call(holder, {f"gm.{name}": state[name].to(device) for name in foreign}, (fn,))

    return wrap
