"""Infer the value of chosen nodes for given input shapes, on fake tensors.

Reads:  the graph, the module's parameter and buffer shapes (those on ``meta`` stand in on the
        inputs' device, so a rank holding one stage of a model built on meta can infer).
Writes: nothing; returns ``{node name: value}`` with tensors as :class:`TensorSpec`; a node
        that fails raises :class:`~fxpipe.passes.failure.PropagationError` naming it.

A runtime that must size receive buffers for a micro-batch of ``b`` rows (the distributed
runtime) calls this with inputs of ``b`` rows; ``annotate`` keeps its per-node metadata for
the example batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.passes.failure import explain
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SpecProp", "value_specs"]


class SpecProp(torch.fx.Interpreter):
    """Run a GraphModule and keep the spec of the values of the nodes named in ``wanted``."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.gm = gm
        self.extra_traceback = False  # a failure is named by run_node's PropagationError
        self.wanted = wanted
        self.specs: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run one node; record its value's spec if it is wanted; name the node if it fails."""
        try:
            result = super().run_node(n)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the node and its module
            raise explain(self.gm, n, exc, "these inputs", advise=False) from None
        if n.name in self.wanted:
            self.specs[n.name] = spec_of(result)
        return result


class _Holder(torch.nn.Module):
    """Let ``functional_call`` swap a GraphModule's state while an interpreter runs it."""

    def __init__(self, gm: torch.fx.GraphModule, prop: SpecProp) -> None:
        super().__init__()
        self.gm = gm
        self.prop = prop

    def forward(self, *args: Any) -> Any:
        return self.prop.run(*args)


def value_specs(gm: torch.fx.GraphModule, inputs: list[Any], wanted: Iterable[str]) -> dict[str, Any]:
    """Return the spec of each wanted node's value for placeholder values ``inputs``.

    ``inputs`` holds one value per placeholder; tensors may be real tensors or
    :class:`TensorSpec` (made into fake tensors of that shape and dtype).
    """
    prop = SpecProp(gm, set(wanted))
    holder = _Holder(gm, prop)
    state: dict[str, torch.Tensor] = dict(holder.named_parameters(remove_duplicate=False))
    state.update(holder.named_buffers(remove_duplicate=False))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    devices = [v.device for v in tree_flatten(inputs)[0] if isinstance(v, torch.Tensor) and not v.is_meta]
    device = devices[0] if devices else torch.device("cpu")  # of stand-ins for meta tensors (not held here)

    made: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied names share it

    def stand_in(v: torch.Tensor) -> torch.Tensor:
        if id(v) not in made:
            if hasattr(v, "to_local") and hasattr(v, "placements"):  # sharded by data parallel: whole
                made[id(v)] = torch.empty(v.shape, dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
            elif v.is_meta:
                fake = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
                made[id(v)] = fake.requires_grad_(v.requires_grad)
            else:
                made[id(v)] = mode.from_tensor(v)
        return made[id(v)]

    with mode:
        fake_state = {k: stand_in(v) for k, v in state.items()}

        def fake(v: Any) -> Any:
            if isinstance(v, TensorSpec):
                return torch.empty(v.shape, dtype=v.dtype).requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor):
                return mode.from_tensor(v)
            return v

        fake_inputs = tree_map(fake, inputs, is_leaf=lambda v: isinstance(v, TensorSpec))
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level, quiet.level = quiet.level, logging.CRITICAL  # a failing node is raised, named, not logged too
        try:
            torch.func.functional_call(holder, fake_state, tuple(fake_inputs))
        finally:
            quiet.setLevel(level)
    return prop.specs
