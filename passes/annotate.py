"""Annotate a GraphModule with shapes, dtypes, bytes and FLOPs, using fake tensors.

Reads:  the graph and the module's parameters and buffers (their shapes only).
Writes: ``node.meta`` keys

    fxpipe.value        the node's value with every tensor replaced by a :class:`TensorSpec`
                        (non-tensor values are kept as they are: ints, None, ...)
    fxpipe.bytes        bytes of the tensors in the node's value
    fxpipe.flops        forward FLOPs of the node (matmul/conv/attention formulas from
                        ``torch.utils.flop_counter``, one per output element for other kernels)
    fxpipe.flops_bwd    backward FLOPs: for the formula kernels, the forward count times the
                        number of their operands that need a gradient (at most 2: input and
                        weight, or both sides of a matmul); one per element for the rest;
                        0 when the node's output needs no gradient
    fxpipe.saved_bytes  bytes the node's output keeps alive for backward (0 for views)
    fxpipe.param_bytes  bytes of the parameters and buffers the node reads directly
                        (``get_attr``) or through its module (``call_module``)

Nothing real is computed and the model's parameters and buffers are never touched: each
node runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, a module with fake
copies of its own state swapped in by :func:`torch.func.functional_call`. Nodes with equal
signatures (:mod:`passes.signature`) run once; the others reuse the first one's result, so a
deep stack of identical layers costs little more than one layer.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from passes.signature import node_key, value_key

__all__ = ["TensorSpec", "annotate", "annotate_params", "bind_placeholders", "spec_of", "value_bytes"]

log = logging.getLogger(__name__)

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


def _itemsize(dtype: torch.dtype) -> int:
    """Return the bytes per element of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits // 8 * (2 if dtype.is_complex else 1)
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).bits // 8


def spec_of(value: Any) -> Any:
    """Replace every tensor in ``value`` by its :class:`TensorSpec`."""
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


_VIEWS = {"view", "reshape", "expand", "expand_as", "permute", "transpose", "t", "squeeze",
          "unsqueeze", "flatten", "unflatten", "narrow", "select", "split", "chunk", "unbind",
          "getitem", "contiguous", "detach", "view_as", "movedim", "swapaxes", "swapdims",
          "as_strided", "real", "imag", "getattr", "size", "dim"}


def _is_view(node: torch.fx.Node) -> bool:
    """Tell whether a call only reinterprets its input (its output keeps nothing new alive)."""
    if node.op == "call_method":
        return node.target in _VIEWS
    if node.op == "call_function":
        return getattr(node.target, "__name__", "") in _VIEWS
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


class _Propagator:
    """Run a GraphModule node by node on fake (or real) tensors, recording ``node.meta``."""

    def __init__(self, gm: torch.fx.GraphModule, mode: FakeTensorMode | None) -> None:
        self.gm = gm
        self.mode = mode
        self.tensors: dict[int, torch.Tensor] = {}  # id(real tensor) -> the copy nodes read
        self.modules: dict = {}
        self.cache: dict = {}
        self.hits = 0

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Return the fake (or, for buffers in real mode, cloned) stand-in of a model tensor."""
        if id(t) not in self.tensors:
            if self.mode is not None:
                self.tensors[id(t)] = self.mode.from_tensor(t)
            else:
                self.tensors[id(t)] = t if isinstance(t, nn.Parameter) else t.detach().clone()
        return self.tensors[id(t)]

    def _call_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Call a module with its state replaced by stand-ins."""
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        if not state:
            return module(*args, **kwargs)
        stand_ins = {k: self._tensor(v) for k, v in state.items()}
        return torch.func.functional_call(module, stand_ins, args, kwargs)

    def _execute(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run one call node on concrete arguments."""
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        return self._call_module(self.gm.get_submodule(node.target), args, kwargs)

    def _compute(self, node: torch.fx.Node, env: dict) -> _Result:
        """Run a call node under a FLOP counter."""
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        counter = _FlopCount()
        with counter:
            value = self._execute(node, args, kwargs)
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

    def run(self, flat_inputs: list, memoize: bool) -> None:
        """Propagate ``flat_inputs`` through the graph, writing ``fxpipe.*`` on every node."""
        env: dict[torch.fx.Node, Any] = {}
        keys: dict[torch.fx.Node, Any] = {}
        inputs = iter(flat_inputs)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                value = next(inputs)
                result = _Result(value, spec_of(value), 0, 0, 0, 0, value_key(value))
            elif node.op == "get_attr":
                value = _fetch(self.gm, node.target)
                if isinstance(value, torch.Tensor):
                    value = self._tensor(value)
                result = _Result(value, spec_of(value), 0, 0, 0, 0, value_key(value))
            elif node.op == "output":
                value = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                result = _Result(value, spec_of(value), 0, 0, 0, 0, None)
            else:
                key = node_key(node, keys, self.modules) if memoize else None
                result = self.cache.get(key) if key is not None else None
                if result is None:
                    result = self._compute(node, env)
                    if key is not None:
                        self.cache[key] = result
                else:
                    self.hits += 1
                    result = replace(result, value=tree_map(lambda v: v, result.value))
            env[node] = result.value
            keys[node] = result.key
            node.meta["fxpipe.value"] = result.spec
            node.meta["fxpipe.bytes"] = value_bytes(result.spec) if node.op != "output" else 0
            node.meta["fxpipe.flops"] = result.flops
            node.meta["fxpipe.flops_bwd"] = result.flops_bwd
            node.meta["fxpipe.saved_bytes"] = result.saved
        if node.op == "output":
            node.meta["fxpipe.bytes"] = value_bytes(node.meta["fxpipe.value"])


def _grad_operands(node: torch.fx.Node, args: tuple, kwargs: dict, gm: torch.fx.GraphModule) -> int:
    """Count the node's tensor operands that need a gradient (its module's parameters as one)."""
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    count = sum(1 for t in leaves if t.requires_grad)
    if node.op == "call_module":
        count += any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
    return count


def _with_grad_rule(spec: Any, node: torch.fx.Node, args: tuple, kwargs: dict,
                    gm: torch.fx.GraphModule) -> Any:
    """Mark floating outputs as needing a gradient when an operand does (for real-kernel runs)."""
    grad = _grad_operands(node, args, kwargs, gm) > 0
    return tree_map(lambda s: TensorSpec(s.shape, s.dtype, grad and (s.dtype.is_floating_point
                                                                     or s.dtype.is_complex))
                    if isinstance(s, TensorSpec) else s, spec)


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    """Return the bytes of parameters and buffers a node reads from the module."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        seen = {id(t): t for t in list(mod.parameters()) + list(mod.buffers())}
        return sum(t.numel() * t.element_size() for t in seen.values())
    if node.op == "get_attr":
        obj = _fetch(gm, node.target)
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
    return 0


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    """Fetch a dotted attribute from a module."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def annotate(gm: torch.fx.GraphModule, example_args: tuple, example_kwargs: dict | None = None,
             *, real: bool = False, memoize: bool = True) -> torch.fx.GraphModule:
    """Record ``fxpipe.value/bytes/flops/flops_bwd/saved_bytes/param_bytes`` on every node; return ``gm``.

    ``example_args`` and ``example_kwargs`` bind to the graph's placeholders as they would
    in a call of ``gm``. With ``real=False`` (the default) everything runs on fake tensors;
    ``real=True`` runs the real kernels, without autograd, on copies of the buffers (for
    models whose data-dependent ops fake tensors cannot follow). ``memoize=False`` runs
    every node even when an equal one ran before (for checking the memo).
    """
    flat_inputs = bind_placeholders(gm, example_args, example_kwargs or {})
    if real:
        with torch.no_grad():
            _Propagator(gm, None).run(flat_inputs, memoize=False)
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fake_inputs = tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, flat_inputs)
            propagator = _Propagator(gm, mode)
            propagator.run(fake_inputs, memoize=memoize)
        log.debug("annotated %d nodes, %d from the memo", len(gm.graph.nodes), propagator.hits)
    return annotate_params(gm)


def annotate_params(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Record ``fxpipe.param_bytes`` on every node (needs no example inputs); return ``gm``."""
    for node in gm.graph.nodes:
        node.meta["fxpipe.param_bytes"] = _param_bytes(gm, node)
    return gm


def bind_placeholders(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """Return one value per placeholder of ``gm`` for a call ``gm(*args, **kwargs)``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return _bind_pytree(gm, info.in_spec, args, kwargs)
    values: list = []
    args, kwargs = list(args), dict(kwargs)
    for node in placeholders:
        name = node.target
        if name.startswith("*"):
            values.append(tuple(args))
            args = []
        elif args:
            values.append(args.pop(0))
        elif name in kwargs:
            values.append(kwargs.pop(name))
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"missing a value for the model input '{name}': pass it positionally "
                            f"or as the keyword {name}=...")
    if args:
        raise TypeError(f"the model takes {len(placeholders)} inputs but {len(placeholders) + len(args)} "
                        "were given positionally")
    if kwargs:
        raise TypeError(f"unexpected keyword input(s) {sorted(kwargs)}; the model's inputs are "
                        f"{[n.target for n in placeholders]}")
    return values


def _bind_pytree(gm: torch.fx.GraphModule, in_spec, args: tuple, kwargs: dict) -> list:
    """Flatten a call of a GraphModule whose codegen flattens inputs (``torch.export``)."""
    sig = inspect.signature(gm.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"the inputs do not match the model's signature {sig}: {exc}") from None
    bound.apply_defaults()
    names = list(sig.parameters)
    args_spec, kwargs_spec = (in_spec.children() if hasattr(in_spec, "children")
                              else in_spec.children_specs)
    n_args = args_spec.num_children
    kw_keys = kwargs_spec.context
    call = (tuple(bound.arguments[p] for p in names[:n_args]), {k: bound.arguments[k] for k in kw_keys})
    return list(fx_pytree.tree_flatten_spec(call, in_spec))
