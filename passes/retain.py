"""Record what each node's backward keeps alive: the tensors autograd saves, by the value they live in.

Reads:  the graph, the module's parameters and buffers (their shapes only), and without example
        inputs the placeholders' ``fxpipe.value`` (from :func:`fxpipe.passes.annotate`).
Writes: ``node.meta["fxpipe.retains"]``: ``{value name: bytes}`` — for every tensor the node's
        autograd functions save for backward, the node whose output holds its storage
        (``""`` for storage no node outputs: a norm's mean and inverse deviation, a dropout
        mask, pooling indices, a leaf module's internals).

``fxpipe.saved_bytes`` (from :func:`fxpipe.passes.annotate`) counts every output as kept; autograd
keeps less. A linear followed by a ReLU keeps the linear's input and the ReLU's output, not
the linear's output::

    x ──Linear──▶ y ──ReLU──▶ r          saved: x (by Linear), r (by ReLU); y is freed
    retains:      Linear {x: |x|}   ReLU {r: |r|}

A stage keeps the union over its nodes, each value once, plus its inputs and outputs (the
runtime holds both until the backward). The graph runs once on fake tensors under
:func:`torch.autograd.graph.saved_tensors_hooks`, so nothing real is computed; parameters
and buffers are never counted (they are the stage's state, not per micro-batch).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
import torch.fx
from fxpipe.passes.annotate import TensorSpec, bind_placeholders
from fxpipe.passes.fakemode import fake_mode
from fxpipe.passes.gcpause import gc_paused
from fxpipe.passes.propagate import _DATA_DEPENDENT, PlainArgs, fetch_stand_in
from fxpipe.passes.spec import differentiable
from fxpipe.passes.untouched import modules_untouched
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["retain"]

log = logging.getLogger(__name__)


class _Retainer(PlainArgs):
    """Run a graph on fake tensors with grad; attribute every saved storage to the value holding it."""

    def __init__(self, gm: torch.fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.mode = mode
        self.fakes: dict[int, torch.Tensor] = {}  # id(real parameter or buffer) -> its fake
        self.state: set[StorageWeakRef] = set()  # storages of parameters and buffers
        self.owner: dict[StorageWeakRef, str] = {}  # storage -> the node whose output it is
        self.current: torch.fx.Node | None = None
        self.saved: dict[torch.fx.Node, dict[StorageWeakRef, int]] = {}
        self.guessed: dict[torch.fx.Node, int] = {}  # data-dependent nodes: what they save, from their output

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        """Return the fake stand-in of a parameter or buffer, made once."""
        if id(t) not in self.fakes:
            if t.is_meta:  # not materialized here (another rank's stage): a fake on the CPU, as the inputs
                with self.mode:
                    fake = torch.empty(t.shape, dtype=t.dtype)
            else:
                fake = self.mode.from_tensor(t.detach())
            if t.requires_grad and differentiable(fake.dtype):
                fake.requires_grad_(True)
            self.fakes[id(t)] = fake
            self.state.add(StorageWeakRef(fake.untyped_storage()))
        return self.fakes[id(t)]

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Fetch an attribute, as a fake if it is a tensor (a module as one calling on fakes)."""
        return fetch_stand_in(cast(torch.fx.GraphModule, self.module), target, self._fake)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Call a submodule with fakes of its parameters and buffers."""
        module = self.fetch_attr(target)
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        if not state:
            return module(*args, **kwargs)
        return torch.func.functional_call(module, {k: self._fake(v) for k, v in state.items()}, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run one node, noting the storages it saves and the ones its output holds."""
        self.current = n
        self.saved[n] = {}
        try:
            out = super().run_node(n)
        except _DATA_DEPENDENT:  # a leaf branching on a value (annotated on real kernels): its example value
            out = tree_map(_stand_in_for, n.meta.get("fxpipe.value"), is_leaf=lambda v: isinstance(v, TensorSpec))
            self.guessed[n] = int(n.meta.get("fxpipe.saved_bytes") or 0)
            log.debug("retain: node %s is data-dependent; counting its output as what it saves", n.name)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.owner.setdefault(StorageWeakRef(t.untyped_storage()), n.name)
        return out

    def pack(self, t: Any) -> Any:
        """Saved-tensor hook: remember the storage of a tensor saved for backward."""
        if isinstance(t, torch.Tensor) and self.current is not None:
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in self.state:
                self.saved[self.current][ref] = int(t.untyped_storage().nbytes())
        return t


def _stand_in_for(spec: Any) -> Any:
    """Return an empty tensor (a fake one, under the fake mode) for a :class:`TensorSpec`; other values as they are."""
    if not isinstance(spec, TensorSpec):
        return spec
    return torch.empty(spec.shape, dtype=spec.dtype).requires_grad_(spec.requires_grad and differentiable(spec.dtype))


def _fake_input(mode: FakeTensorMode, value: Any) -> Any:
    """Return a fake tensor for a real tensor or a :class:`TensorSpec`; other values as they are."""
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, TensorSpec):
        with mode:
            return torch.empty(value.shape, dtype=value.dtype)
    return value


@gc_paused
def retain(gm: torch.fx.GraphModule, example_args: tuple | None = None,
           example_kwargs: dict | None = None) -> torch.fx.GraphModule:
    """Record ``fxpipe.retains`` on every node for a training forward; return ``gm``.

    Without example inputs, the placeholders' ``fxpipe.value`` (from :func:`fxpipe.passes.annotate`)
    gives their shapes.
    """
    if example_args is None and example_kwargs is None:
        flat = [n.meta.get("fxpipe.value") for n in gm.graph.nodes if n.op == "placeholder"]
    else:
        flat = bind_placeholders(gm, example_args or (), example_kwargs or {})
    mode = fake_mode(gm)
    runner = _Retainer(gm, mode)
    fake = tree_map(lambda v: _fake_input(mode, v), flat, is_leaf=lambda v: isinstance(v, TensorSpec))
    with modules_untouched(gm), mode, torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(runner.pack, lambda t: t):
        runner.run(*fake)
    for node in gm.graph.nodes:
        kept: dict[str, int] = {}
        for ref, nbytes in runner.saved.get(node, {}).items():
            name = runner.owner.get(ref, "")
            kept[name] = kept.get(name, 0) + nbytes if name == "" else nbytes
        if node in runner.guessed:
            kept[node.name] = kept.get(node.name, 0) + runner.guessed[node]
        node.meta["fxpipe.retains"] = kept
    return gm
