"""Measure each layer of a sequential module: time with fxpipe's profiler, memory by what it keeps.

Layers are measured on copies (:func:`layerwise_sandbox`: deep-copied, moved to the device,
in training mode), so the module's parameters, buffers and mode are left as they were. The
copies are lowered to a graph with one node per layer (:mod:`~fxpipe.compat.torchgpipe.lowering`),
so each layer receives the real output of the layer before it and ``@skippable`` layers
receive the skips they pop, which profiling layer by layer on its own cannot give them.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe import passes
from fxpipe.compat.torchgpipe.lowering import lower
from fxpipe.compat.torchgpipe.skip.layout import inspect_skip_layout

__all__ = ["layerwise_sandbox", "profile_sizes", "profile_times"]

log = logging.getLogger(__name__)


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Yield a copy of each layer, moved to ``device`` and in training mode; ``module`` is untouched."""
    for layer in module:
        layer_copy = copy.deepcopy(layer)
        layer_copy.to(device)
        layer_copy.train()
        yield layer_copy


def _layer_graph(module: nn.Sequential, device: torch.device):
    """Lower copies of the layers to a graph with one node per layer; return it and the node names."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient; clear the gradients (model.zero_grad("
                         "set_to_none=True)) before balancing, since profiling runs backward")
    layers = list(layerwise_sandbox(module, device))
    return lower(layers, inspect_skip_layout([layer] for layer in layers), prefix="layer", name="Layers")


def _to(sample: Any, device: torch.device) -> Any:
    """Copy the sample's tensors to ``device`` as new leaves keeping ``requires_grad``."""
    return tree_map(lambda t: t.detach().to(device).requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) else t, sample)


def profile_times(module: nn.Sequential, sample: Any, timeout: float, device: torch.device) -> list[float]:
    """Return each layer's forward + backward milliseconds: the median over profiling rounds.

    Rounds of :func:`fxpipe.passes.profile` (the median of a few runs per layer) repeat until
    ``timeout`` seconds have passed; there is at least one. The median over rounds keeps a
    round slowed down by other work on the machine from deciding the balance.
    """
    gm, names = _layer_graph(module, device)
    sample = _to(sample, device)
    try:  # shapes let the profiler know which values need gradients; optional
        passes.annotate(gm, (sample,))
    except Exception as exc:  # noqa: BLE001 - a layer fake tensors cannot follow: profile without
        log.debug("profiling without shapes: fake tensors cannot run a layer (%s)", exc)
    nodes = [next(n for n in gm.graph.nodes if n.name == name) for name in names]
    rounds: list[list[float]] = [[] for _ in names]
    begun = time.monotonic()
    while True:
        passes.profile(gm, (sample,), device=device, progress_after=float("inf"))
        for k, node in enumerate(nodes):
            rounds[k].append(node.meta["fxpipe.time"])
        if time.monotonic() - begun >= timeout:
            return [statistics.median(times) for times in rounds]


class _Made(TorchDispatchMode):
    """Remember (weakly) every tensor the ops under this mode return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        """Run the op; remember the tensors it returns."""
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


# Allocation granularity: the CUDA caching allocator's smallest block, the CPU allocator's alignment.
BLOCK_BYTES = {"cuda": 512, "cpu": 64}


def _kept_bytes(call: Any, *args: Any) -> tuple[Any, int]:
    """Run ``call(*args)``; return its result and the bytes of new storage still alive after it.

    Each storage counts whole allocation blocks (:data:`BLOCK_BYTES`), as the allocator hands them out.
    """
    with _Made() as mode:
        result = call(*args)
    seen: dict[int, int] = {}
    for ref in mode.made:
        t = ref()
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            block = BLOCK_BYTES.get(t.device.type, 1)
            seen[storage.data_ptr()] = -(-storage.nbytes() // block) * block
    return result, sum(seen.values())


def profile_sizes(module: nn.Sequential, input: Any, chunks: int, param_scale: float,
                  device: torch.device) -> list[int]:
    """Return each layer's memory in bytes: what its forward keeps alive per micro-batch, plus parameters.

    Each layer runs once, with grad, on the first two rows of ``input``; the storage it leaves
    alive (its output and what autograd keeps for backward, in allocation blocks) is scaled to
    a micro-batch of ``len(input) / chunks`` rows, and its parameters count ``param_scale``
    times (weights, gradients, optimizer state).
    """
    gm, _ = _layer_graph(module, device)
    first = next(t for t in tree_flatten(input)[0] if isinstance(t, torch.Tensor))
    rows = min(first.size(0), 2)  # two rows: a batch norm in training mode refuses one
    rows_per_micro = first.size(0) / chunks / rows
    value = _to(tree_map(lambda t: t[:rows] if isinstance(t, torch.Tensor) else t, input), device)
    calls = dict(gm.named_modules())
    sizes = []
    skips: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            call = calls[node.target]
            popped = [skips[a.name] for a in node.args[1:]]
            with torch.enable_grad():
                result, latent = _kept_bytes(call, value, *popped)
            params = {id(p): p for p in call.parameters()}.values()
            param_bytes = sum(p.untyped_storage().nbytes() for p in params)
            sizes.append(int(latent * rows_per_micro + param_bytes * param_scale))
        elif node.op == "call_function":
            item = result[node.args[1]]
            if node.args[1] == 0:
                value = _to(item, device)  # the next layer's input, cut from this layer's graph
            else:
                skips[node.name] = item
    return sizes
