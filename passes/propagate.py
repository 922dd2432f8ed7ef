"""Run a GraphModule node by node on fake (or real) tensors, recording what each node computes.

Reads:  the graph and the module's parameters and buffers (through stand-ins; those of a model
        built on ``meta`` stand in on the inputs' device).
Writes: ``node.meta`` keys ``fxpipe.value``, ``fxpipe.bytes``, ``fxpipe.flops``,
        ``fxpipe.flops_bwd``, ``fxpipe.saved_bytes`` and ``fxpipe.mutates`` (described in
        :mod:`fxpipe.passes.annotate`).

Each call node runs under a FLOP counter; a module runs with its parameters and buffers
swapped for stand-ins (fake tensors, or clones of the buffers for real kernels) by
:func:`torch.func.functional_call`, so the model's own state is never touched. A node whose
signature (:mod:`fxpipe.passes.signature`) matches an earlier node's reuses that node's result,
unless the graph may change a value in place: then every node runs, so that each value is
its own tensor and an in-place change shows, through the version counters of the inputs,
on exactly the values (and views) it touched.

A node that raises (other than on a data-dependent op, which the caller may retry on real
kernels) raises :class:`fxpipe.passes.failure.PropagationError` naming the node and its module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.fx
import torch.fx.immutable_collections
from fxpipe.passes.failure import explain, refuse_not_dense
from fxpipe.passes.mutates import VIEW_NAMES, may_mutate, op_name
from fxpipe.passes.nesting import levels_restored
from fxpipe.passes.signature import node_key, value_key
from fxpipe.passes.spec import TensorSpec, differentiable, map_leaves, spec_of, value_bytes
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

__all__ = ["PlainArgs", "Propagator", "call_with_stand_ins", "fetch", "fetch_stand_in"]

_METADATA_OPS = {
    torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.dim.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.copy_.default,
}
_DATA_DEPENDENT = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   GuardOnDataDependentSymNode)  # the caller retries these on real kernels


class _FlopCount(TorchDispatchMode):
    """Count FLOPs of the aten kernels dispatched under this mode: formula kernels, the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.heavy = 0  # kernels with a formula in torch.utils.flop_counter (matmul, conv, ...)
        self.light = 0  # one per output element of every other computing kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        out = func(*args, **kwargs)
        if packet in flop_registry:
            self.heavy += int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif func.namespace == "aten" and not func.is_view and not _is_view_like(func):
            leaves, _ = tree_flatten(out)
            self.light += sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
        return out


def _is_view_like(func) -> bool:
    """Tell whether an aten op only reshapes or indexes metadata."""
    name = func._overloadpacket.__name__
    return name in {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t",
                    "squeeze", "unsqueeze", "slice", "select", "split", "chunk", "unbind",
                    "as_strided", "flatten", "contiguous"}


def _is_view(node: torch.fx.Node) -> bool:
    """Tell whether a call only reinterprets its input (its output keeps nothing new alive)."""
    if node.op in ("call_method", "call_function"):
        name = op_name(node.target)
        return name in VIEW_NAMES or name in ("getattr", "size", "dim")  # aliases, or no tensor
    return False


@dataclass
class _Result:
    """What one node computed: its value and everything recorded about it."""

    value: Any
    spec: Any
    nbytes: int
    flops: int
    flops_bwd: int
    saved: int
    key: Any


class PlainArgs(torch.fx.Interpreter):
    """An Interpreter that calls targets with plain lists and dicts, as a graph's generated code does.

    torch.fx keeps a node's arguments in ``immutable_list``/``immutable_dict``: a function the
    model wrapped with ``torch.fx.wrap`` that writes into its list argument (torchvision's 3-D Swin
    sets ``shift_size[i] = 0``) runs in the GraphModule but raised ``'immutable_list' object does
    not support mutation`` here.
    """

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[tuple, dict]:
        """Fetch a node's arguments from the environment, as plain containers."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}


def _plain(value: Any) -> Any:
    """Return ``value`` with torch.fx's immutable lists and dicts as plain ones (their contents too)."""
    if isinstance(value, torch.fx.immutable_collections.immutable_list):
        return [_plain(v) for v in value]
    if isinstance(value, torch.fx.immutable_collections.immutable_dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class Propagator(PlainArgs):
    """Run a GraphModule node by node on fake (or real) tensors, recording ``node.meta``.

    ShapeProp-style: :meth:`run_node` runs each node (``call_module`` and ``get_attr`` on
    stand-ins of the module's state) and records what it computed on the node.
    """

    def __init__(self, gm: torch.fx.GraphModule, mode: FakeTensorMode | None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.gm = gm
        self.mode = mode
        self.tensors: dict[int, torch.Tensor] = {}  # id(real tensor) -> the copy nodes read
        self.modules: dict = {}
        self.cache: dict = {}
        self.hits = 0
        self.memoize = False
        self.device = torch.device("cpu")  # where stand-ins of meta tensors live: the inputs' device
        self.keys: dict[torch.fx.Node, Any] = {}
        self.storages: list[tuple[StorageWeakRef, torch.fx.Node]] = []  # what each value lives in

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Return the fake (or, for buffers in real mode, cloned) stand-in of a model tensor."""
        if id(t) not in self.tensors:
            if self.mode is not None and t.is_meta:  # a model built on meta: a fake on the inputs' device
                with self.mode:
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
                self.tensors[id(t)] = fake.requires_grad_(t.requires_grad)
            elif self.mode is not None:
                self.tensors[id(t)] = self.mode.from_tensor(t)
            else:
                self.tensors[id(t)] = t if isinstance(t, nn.Parameter) else t.detach().clone()
        return self.tensors[id(t)]

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Call a module with its state replaced by stand-ins."""
        return call_with_stand_ins(self.gm, target, args, kwargs, self._tensor)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Fetch an attribute; a tensor through its stand-in."""
        return fetch_stand_in(self.gm, target, self._tensor)

    def _compute(self, node: torch.fx.Node) -> _Result:
        """Run a call node under a FLOP counter."""
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        counter = _FlopCount()
        try:
            with counter:
                value = getattr(self, node.op)(node.target, args, kwargs)
        except NotImplementedError as exc:  # a higher-order op (torch.cond, flex_attention) has no rule for it
            if "HigherOrderOperator" not in str(exc):
                raise
            counter = _FlopCount()  # run again uncounted: the node costs what the ops around it count
            value = getattr(self, node.op)(node.target, args, kwargs)
        spec = spec_of(value)
        if self.mode is None:  # real kernels run under no_grad: infer which outputs need a gradient
            spec = _with_grad_rule(spec, node, args, kwargs, self.gm)
        nbytes = value_bytes(spec)
        needs_grad = any(isinstance(s, TensorSpec) and s.requires_grad for s in tree_flatten(spec)[0])
        flops_bwd = 0
        if needs_grad:
            flops_bwd = counter.heavy * min(2, _grad_operands(node, args, kwargs, self.gm)) + counter.light
        saved = 0 if _is_view(node) else nbytes
        return _Result(value, spec, nbytes, counter.heavy + counter.light, flops_bwd, saved, value_key(value))

    def propagate(self, flat_inputs: list, memoize: bool) -> None:
        """Propagate ``flat_inputs`` (one per placeholder) through the graph, writing ``fxpipe.*``."""
        self.memoize = memoize and not any(may_mutate(n) for n in self.gm.graph.nodes)
        self.keys, self.storages = {}, []
        devices = [t.device for t in _tensors(flat_inputs) if not t.is_meta]
        self.device = devices[0] if devices else self.device
        with levels_restored():  # a node failing inside an exported torch.vmap leaves no level open
            self.run(*flat_inputs, enable_io_processing=False)

    def run_node(self, node: torch.fx.Node) -> Any:
        """Run one node (or reuse an equal earlier node's result); record it in ``node.meta``."""
        mutates: list[str] = []
        if node.op in ("placeholder", "get_attr", "output"):
            value = super().run_node(node)
            spec = spec_of(value)
            key = value_key(value) if node.op != "output" else None
            result = _Result(value, spec, value_bytes(spec), 0, 0, 0, key)
        else:
            key = node_key(node, self.keys, self.modules) if self.memoize else None
            cached = self.cache.get(key) if key is not None else None
            if cached is None:
                read = [t for a in node.all_input_nodes if a in self.env for t in _tensors(self.env[a])]
                versions = [(t, t._version) for t in read]
                try:
                    result = self._compute(node)
                except _DATA_DEPENDENT:
                    raise
                except Exception as exc:
                    nones = [str(a.target) for a in node.all_input_nodes if a.op == "placeholder" and a in self.env
                             and self.env[a] is None]
                    raise explain(self.gm, node, exc, nones=nones) from exc
                refuse_not_dense(self.gm, node, _tensors(result.value))
                changed = [_storage(t) for t, v in versions if t._version != v]
                mutates = _aliases(self.storages, changed, node) if changed else []
                if key is not None and not changed:
                    self.cache[key] = result
            else:
                result = cached
                self.hits += 1
        value = result.value
        if isinstance(value, (tuple, list, dict)):  # a fresh container for each node
            value = tree_map(lambda v: v, value)
        self.keys[node] = result.key
        node.meta["fxpipe.value"] = result.spec
        node.meta["fxpipe.bytes"] = result.nbytes
        node.meta["fxpipe.flops"] = result.flops
        node.meta["fxpipe.flops_bwd"] = result.flops_bwd
        node.meta["fxpipe.saved_bytes"] = result.saved
        node.meta["fxpipe.mutates"] = mutates
        if node.op != "get_attr":
            self.storages += [(_storage(t), node) for t in _tensors(value) if not _batched(t)]
        return value


def _tensors(value: Any) -> list[torch.Tensor]:
    """Return the tensors among the leaves of ``value``."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _batched(t: torch.Tensor) -> bool:
    """Tell whether ``t`` is a value inside ``torch.vmap`` (it has no storage of its own)."""
    return torch._C._functorch.is_batchedtensor(t)


def _storage(t: torch.Tensor) -> StorageWeakRef:
    """Return a weak reference naming the storage that ``t`` and its views share."""
    return StorageWeakRef(t.untyped_storage())


def _aliases(storages: list[tuple[StorageWeakRef, torch.fx.Node]], changed: list[StorageWeakRef],
             node: torch.fx.Node) -> list[str]:
    """Return the names of the earlier nodes whose values live in one of the ``changed`` storages."""
    found = {m: None for ref, m in storages if m is not node and not ref.expired() and ref in changed}
    return [m.name for m in found]


def _grad_operands(node: torch.fx.Node, args: tuple, kwargs: dict, gm: torch.fx.GraphModule) -> int:
    """Count the node's tensor operands that need a gradient (its module's parameters as one)."""
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    count = sum(1 for t in leaves if t.requires_grad)
    if node.op == "call_module":
        count += any(p.requires_grad for p in gm.get_submodule(cast(str, node.target)).parameters())
    return count


def _with_grad_rule(spec: Any, node: torch.fx.Node, args: tuple, kwargs: dict,
                    gm: torch.fx.GraphModule) -> Any:
    """Mark floating outputs as needing a gradient when an operand does (for real-kernel runs)."""
    grad = _grad_operands(node, args, kwargs, gm) > 0
    return map_leaves(lambda s: replace(s, requires_grad=grad and differentiable(s.dtype))
                      if isinstance(s, TensorSpec) else s, spec)


def call_with_stand_ins(gm: torch.fx.GraphModule, target: str, args: tuple, kwargs: dict,
                        stand_in: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Call submodule ``target`` of ``gm`` with each of its parameters and buffers swapped for ``stand_in(it)``."""
    module = gm.get_submodule(target)
    state: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    if not state:
        return module(*args, **kwargs)
    return torch.func.functional_call(module, {k: stand_in(v) for k, v in state.items()}, args, kwargs)


def fetch_stand_in(gm: torch.fx.GraphModule, target: str, stand_in: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Fetch a dotted attribute of ``gm``; a tensor as ``stand_in(it)``, a module as one calling on stand-ins."""
    value = fetch(gm, target)
    if isinstance(value, torch.Tensor):
        return stand_in(value)
    return _StandInCall(gm, target, stand_in) if isinstance(value, nn.Module) else value


class _StandInCall:
    """A module fetched by a ``get_attr`` (a mode-guarded call): calling it runs the module on stand-ins.

    Calling the real module would write its buffers (batch norm's running statistics and
    ``num_batches_tracked``) while the graph is only being measured.
    """

    def __init__(self, gm: torch.fx.GraphModule, target: str, stand_in: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.gm, self.target, self.stand_in = gm, target, stand_in

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module with its state swapped for stand-ins."""
        return call_with_stand_ins(self.gm, self.target, args, kwargs, self.stand_in)

    def __getattr__(self, name: str) -> Any:
        """Read any other attribute from the module itself."""
        return getattr(fetch(self.gm, self.target), name)


def fetch(gm: torch.nn.Module, target: str) -> Any:
    """Fetch a dotted attribute from a module."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
