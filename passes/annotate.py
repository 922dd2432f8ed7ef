"""Annotate a GraphModule with shapes, dtypes, bytes and FLOPs, using fake tensors.

Reads:  the graph and the module's parameters and buffers (their shapes only).
Writes: ``node.meta`` keys

    fxpipe.value        the node's value with every tensor replaced by a :class:`TensorSpec`
                        (non-tensor values are kept as they are: ints, None, ...)
    fxpipe.bytes        bytes of the tensors in the node's value
    fxpipe.flops        forward FLOPs of the node (matmul/conv formulas from
                        ``torch.utils.flop_counter``, one per element for other kernels)
    fxpipe.param_bytes  bytes of the parameters and buffers the node reads directly
                        (``get_attr``) or through its module (``call_module``)
    fxpipe.mutates      names of the earlier nodes (placeholders and computed values, not
                        ``get_attr``) whose tensor storage the node changed in place, directly
                        or through a view; seen as a bump of an input's version counter

Nothing real is computed and the model's parameters and buffers are never touched: the
graph runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode` with fake copies of
the state swapped in by :func:`torch.func.functional_call`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

__all__ = ["TensorSpec", "annotate", "annotate_params", "bind_placeholders", "MetaProp", "value_bytes"]

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
    """Count FLOPs of the aten kernels dispatched under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        out = func(*args, **kwargs)
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif func.namespace == "aten" and not func.is_view and not _is_view_like(func):
            leaves, _ = tree_flatten(out)
            self.flops += sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
        return out


def _is_view_like(func) -> bool:
    """Tell whether an aten op only reshapes or indexes metadata."""
    name = func._overloadpacket.__name__
    return name in {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t",
                    "squeeze", "unsqueeze", "slice", "select", "split", "chunk", "unbind",
                    "as_strided", "flatten", "contiguous"}


class MetaProp(torch.fx.Interpreter):
    """Run a GraphModule on fake tensors and record specs, bytes, FLOPs and mutations in ``node.meta``."""

    def __init__(self, module: torch.fx.GraphModule, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._storages: list[tuple[StorageWeakRef, torch.fx.Node]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run one node under a FLOP counter and record what it produced and mutated."""
        inputs = [t for a in n.all_input_nodes if a in self.env for t in _tensors(self.env[a])]
        versions = [(t, t._version) for t in inputs]
        counter = _FlopCount()
        with counter:
            result = super().run_node(n)
        n.meta["fxpipe.value"] = spec_of(result)
        n.meta["fxpipe.bytes"] = value_bytes(n.meta["fxpipe.value"])
        n.meta["fxpipe.flops"] = counter.flops if n.op not in ("placeholder", "get_attr", "output") else 0
        changed = [_storage(t) for t, v in versions if t._version != v]
        n.meta["fxpipe.mutates"] = self._aliases(changed, n) if changed else []
        if n.op != "get_attr":
            self._storages += [(_storage(t), n) for t in _tensors(result)]
        return result

    def _aliases(self, storages: list[StorageWeakRef], n: torch.fx.Node) -> list[str]:
        """Return the names of the earlier nodes whose values live in one of ``storages``."""
        found = {m: None for ref, m in self._storages if m is not n and not ref.expired() and ref in storages}
        return [m.name for m in found]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Return the tensors among the leaves of ``value``."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> StorageWeakRef:
    """Return a weak reference naming the storage that ``t`` and its views share."""
    return StorageWeakRef(t.untyped_storage())


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


class _Runner(torch.nn.Module):
    """Wrap a GraphModule so that ``functional_call`` can swap its state for fake tensors."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> Any:
        return MetaProp(self.gm).run(*args)


def annotate(gm: torch.fx.GraphModule, example_args: tuple, example_kwargs: dict | None = None,
             *, real: bool = False) -> torch.fx.GraphModule:
    """Record ``fxpipe.value/bytes/flops/param_bytes`` on every node; return ``gm``.

    ``example_args`` and ``example_kwargs`` bind to the graph's placeholders as they would
    in a call of ``gm``. With ``real=False`` (the default) everything runs on fake tensors;
    ``real=True`` runs the real kernels on copies of the buffers (for models whose
    data-dependent ops fake tensors cannot follow).
    """
    flat_inputs = bind_placeholders(gm, example_args, example_kwargs or {})
    runner = _Runner(gm)
    state = dict(runner.named_parameters(remove_duplicate=False))
    state.update(runner.named_buffers(remove_duplicate=False))
    if real:
        state = {k: (v.detach().clone() if not isinstance(v, torch.nn.Parameter) else v)
                 for k, v in state.items()}
        with torch.no_grad():
            torch.func.functional_call(runner, state, tuple(flat_inputs))
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fake_state = {k: mode.from_tensor(v) for k, v in state.items()}
            fake_inputs = tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, flat_inputs)
            torch.func.functional_call(runner, fake_state, tuple(fake_inputs))
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
