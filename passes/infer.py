"""Infer the value of chosen nodes for given input shapes, on fake tensors.

Reads:  the graph, the module's parameter and buffer shapes (those on ``meta`` stand in on the
        inputs' device, so a rank holding one stage of a model built on meta can infer).
Writes: nothing; returns ``{node name: value}`` with tensors as :class:`TensorSpec`; a node
        that fails raises :class:`~fxpipe.passes.failure.PropagationError` naming it.

A node whose signature (:mod:`fxpipe.passes.signature`) matches an earlier node's reuses its
value, as annotation does, unless the graph may change a value in place.

A runtime that must size receive buffers for a micro-batch of ``b`` rows (the distributed
runtime) calls this with inputs of ``b`` rows; ``annotate`` keeps its per-node metadata for
the example batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.fx
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.passes.failure import explain
from fxpipe.passes.fakemode import bound_dispatch_cache, fake_mode
from fxpipe.passes.gcpause import gc_paused
from fxpipe.passes.mutates import may_mutate
from fxpipe.passes.nesting import levels_restored
from fxpipe.passes.propagate import _DATA_DEPENDENT, PlainArgs, call_with_stand_ins, fetch_stand_in
from fxpipe.passes.signature import node_key, value_key
from fxpipe.passes.untouched import modules_untouched
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Propagator", "SpecProp", "value_specs"]


#: torch.export's checks of sizes and values (``torch._check``, a ``.tolist()``'s sum against the rows), which
#: return nothing a later node reads.
_CHECKS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range", "sym_constrain_range_for_size")
    if hasattr(torch.ops.aten, name))


class SpecProp(PlainArgs):
    """Run the nodes a GraphModule needs for ``wanted``; keep the spec of the values of ``wanted``.

    Nodes no wanted value depends on (the last stage's, when the wanted values cross stage
    boundaries) are skipped.
    """

    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.gm = gm
        self.extra_traceback = False  # a failure is named by run_node's PropagationError
        self.wanted = wanted
        self.needed = _ancestors(gm, wanted)
        self.specs: dict[str, Any] = {}
        # a node whose signature matches an earlier one's reuses its value (repeated layers run once),
        # unless the graph may change a value in place (mod:`fxpipe.passes.signature`)
        self.memoize = not any(may_mutate(n) for n in gm.graph.nodes)
        self.keys: dict[torch.fx.Node, Any] = {}
        self.modules: dict = {}
        self.cache: dict = {}
        # the stand-in of a module tensor (a fake tensor), made when a node first reads it: a node
        # served from the memo makes none
        self.stand_in: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.rows: tuple[int | None, int | None] = (None, None)  # the example's and these inputs' rows
        self.imitated: set[str] = set()  # nodes whose value is their example's, resized (_like_example)
        self.skew = 0  # added to a guessed row count: 1 tells which values' sizes follow the guess (runtime.build)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Fetch an attribute; a tensor through its stand-in."""
        return fetch_stand_in(self.gm, target, self.stand_in)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Call a module with its parameters and buffers swapped for their stand-ins."""
        return call_with_stand_ins(self.gm, target, args, kwargs, self.stand_in)

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run one needed node (or reuse an equal earlier node's value); record its spec if wanted."""
        if n.name not in self.needed and n.op != "output":
            return None  # the output node returns the skipped nodes as None
        key = node_key(n, self.keys, self.modules) if self.memoize and n.op.startswith("call_") else None
        if key is not None and key in self.cache:
            result = tree_map(lambda v: v, self.cache[key])  # a fresh container for each node
        else:
            try:
                result = super().run_node(n)
                if any(a.name in self.imitated for a in n.all_input_nodes):
                    self.imitated.add(n.name)  # made of an imitation: its data is not there either
            except Exception as exc:  # noqa: BLE001 - re-raised naming the node and its module
                # a leaf branching on a value, or a node reading a value imitated so (its data is not
                # there: a packed sequence's batch sizes): its example's value, resized
                imitating = isinstance(exc, _DATA_DEPENDENT) or any(a.name in self.imitated for a in n.all_input_nodes)
                if imitating and n.target in _CHECKS:  # a check of sizes the data fixed: imitations cannot pass it
                    return None
                result = self._like_example(n) if imitating else None
                if result is None:
                    raise explain(self.gm, n, exc, "these inputs", advise=False) from None
                self.imitated.add(n.name)
            if key is not None:
                self.cache[key] = result
        if self.memoize:
            self.keys[n] = value_key(result)
        if n.name in self.wanted:
            self.specs[n.name] = spec_of(result)
        spec = n.meta.get("fxpipe.value")
        if n.op == "placeholder" and self.rows == (None, None) and isinstance(result, torch.Tensor) and \
                result.dim() > 0 and isinstance(spec, TensorSpec) and spec.shape:
            self.rows = (int(spec.shape[0]), int(result.shape[0]))  # read before the input's value is let go
        return result


    def _resized(self, a: torch.fx.Node) -> bool:
        """Tell whether node ``a``'s value here has other rows than its example's."""
        v, spec = self.env.get(a), a.meta.get("fxpipe.value")
        return isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(spec, TensorSpec) and len(spec.shape) > 0 \
            and int(spec.shape[0]) != int(v.shape[0])

    def _like_example(self, n: torch.fx.Node) -> Any:
        """Return ``n``'s value from the example's (``node.meta``) when its inputs differ from the example's in dim 0 only.

        A node with no tensor input (an LSTM reading a packed sequence) is resized by the
        model inputs' rows.

        Fake tensors cannot follow a data-dependent op (a leaf module branching on a value),
        which compile annotated on real kernels; a rank holding one stage cannot run the others'
        kernels, but a node whose inputs changed only in their rows gives what it gave for the
        example with those rows. Anything else: None (refused, naming the node).
        """
        example = n.meta.get("fxpipe.value")
        base = rows = None
        # the inputs whose rows changed first: one left at its example's size (imitated: an expert's tokens,
        # sized by the data) says nothing of the rows, where a changed one does (the micro-batch's gates)
        for a in sorted(n.all_input_nodes, key=lambda a: not self._resized(a)):
            v, spec = self.env.get(a), a.meta.get("fxpipe.value")
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            if not isinstance(spec, TensorSpec) or len(spec.shape) != v.dim() or tuple(spec.shape[1:]) != tuple(v.shape[1:]):
                return None
            if base is None:
                base, rows = int(spec.shape[0]), int(v.shape[0])
            elif int(spec.shape[0]) != int(v.shape[0]) and (int(spec.shape[0]), int(v.shape[0])) != (base, rows):
                return None
        if base is None:  # no tensor among its inputs (a packed sequence's tuple): the model inputs' rows
            base, rows = self.rows
        if example is None or base is None or rows is None:
            return None
        grown: int = rows

        def make(s: Any) -> Any:
            if not isinstance(s, TensorSpec):
                return s
            # rows that are not the batch's (a mask's selection) are the example's: a guess, which skew moves
            shape = [grown if k == 0 and d == base else d + self.skew if k == 0 else d
                     for k, d in enumerate(s.shape)]
            return torch.empty(shape, dtype=s.dtype).requires_grad_(s.requires_grad)
        return tree_map(make, example, is_leaf=lambda v: isinstance(v, TensorSpec))


def _ancestors(gm: torch.fx.GraphModule, wanted: set[str]) -> set[str]:
    """Return the names of the wanted nodes, every node they depend on, and every placeholder."""
    nodes = {n.name: n for n in gm.graph.nodes}
    needed = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    todo = [nodes[w] for w in wanted if w in nodes]
    while todo:
        n = todo.pop()
        if n.name in needed and n.op != "placeholder":
            continue
        needed.add(n.name)
        todo += [a for a in n.all_input_nodes if a.name not in needed]
    return needed


class Propagator:
    """Infer the specs of chosen nodes for one input layout after another, on fake tensors.

    One fake mode and one stand-in per tensor of the module serve every call, so a new
    layout costs only the propagation of the nodes the chosen ones depend on.
    """

    def __init__(self, gm: torch.fx.GraphModule, wanted: Iterable[str]) -> None:
        self.prop = SpecProp(gm, set(wanted))
        self.mode = fake_mode(gm)
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, its stand-in)

    @gc_paused
    def __call__(self, inputs: list[Any]) -> dict[str, Any]:
        """Return the spec of each chosen node's value for placeholder values ``inputs``.

        ``inputs`` holds one value per placeholder; tensors may be real tensors or
        :class:`TensorSpec` (made into fake tensors of that shape and dtype).
        """
        devices = [v.device for v in tree_flatten(inputs)[0] if isinstance(v, torch.Tensor) and not v.is_meta]
        device = devices[0] if devices else torch.device("cpu")  # of stand-ins for meta tensors (not held here)
        mode = self.mode
        with mode:
            self.prop.stand_in = partial(self._stand_in, device=device)

            def fake(v: Any) -> Any:
                if isinstance(v, TensorSpec):
                    return torch.empty(v.shape, dtype=v.dtype, memory_format=v.memory_format
                                       ).requires_grad_(v.requires_grad)
                if isinstance(v, torch.Tensor):
                    return mode.from_tensor(v)
                return v

            fake_inputs = tree_map(fake, inputs, is_leaf=lambda v: isinstance(v, TensorSpec))
            quiet = logging.getLogger("torch._subclasses.fake_tensor")
            level, quiet.level = quiet.level, logging.CRITICAL  # a failing node is raised, named, not logged too
            self.prop.specs = {}
            self.prop.keys, self.prop.cache = {}, {}
            self.prop.rows, self.prop.imitated = (None, None), set()
            try:
                with modules_untouched(self.prop.gm), levels_restored():  # nor a vmap its level
                    self.prop.run(*fake_inputs)
            finally:
                quiet.setLevel(level)
                bound_dispatch_cache()
        return self.prop.specs

    def _stand_in(self, v: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Return the fake stand-in of a module tensor (one per tensor: tied names share it)."""
        known = self.made.get(id(v))
        if known is not None and known[0] is v and known[1].dtype == v.dtype and \
                not (v.is_meta and known[1].device != device):  # model.double() changes a tensor's dtype in place
            return known[1]
        if hasattr(v, "to_local") and hasattr(v, "placements"):  # sharded by data parallel: whole
            made = torch.empty(v.shape, dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
        elif v.is_meta:
            made = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).requires_grad_(v.requires_grad)
        elif known is not None and known[0] is v:  # its dtype changed in place: from_tensor would return the old fake
            made = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device
                                       ).requires_grad_(v.requires_grad)
        else:
            made = self.mode.from_tensor(v)
        self.made[id(v)] = (v, made)
        return made


def value_specs(gm: torch.fx.GraphModule, inputs: list[Any], wanted: Iterable[str]) -> dict[str, Any]:
    """Return the spec of each wanted node's value for placeholder values ``inputs`` (see :class:`Propagator`)."""
    return Propagator(gm, wanted)(inputs)
