"""Seconds of one node for one micro-batch: from a device model's rates, or measured.

Reads ``node.meta``: ``fxpipe.flops``, ``fxpipe.flops_bwd`` and ``fxpipe.value`` (from
:func:`fxpipe.passes.annotate`), made for the example batch; a micro-batch ``scale`` times
as large scales them. A node is a GEMM (linears, matmuls, attention), a convolution or
another (memory-bound) kernel::

    GEMM, convolution   overhead + FLOPs / rate(kind, smallest dimension)
    other               overhead + elements x seconds per element

Zero bubble's ``W`` takes the weight gradient of each ``nn.Linear`` and ``F.linear`` (what
:mod:`fxpipe.runtime.stage.wgrad` defers): one GEMM as large as its forward.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe.passes.linears import model_defers
from fxpipe.passes.spec import TensorSpec
from fxpipe.simulate.devices import DeviceModel

__all__ = ["NodeTime", "node_times"]

_GEMM_FUNCTIONS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention",
                   "bilinear"}
_CONV_FUNCTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                   "convolution"}


@dataclass
class NodeTime:
    """Seconds of one node for one micro-batch: forward, whole backward, and the part W can take."""

    forward: float
    backward: float
    weight: float = 0.0


def _name(target: Any) -> str:
    """Return a call target's short name (``conv2d``, ``matmul``, ``linear``).

    An exported graph calls ATen overloads, named ``conv2d.default``: their packet's name counts.
    """
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    return getattr(target, "__name__", str(target)).split(".")[-1].lstrip("_")


def _shape(node: Any) -> tuple[int, ...] | None:
    """Return the shape of a node's tensor value, if it is one."""
    spec = node.meta.get("fxpipe.value") if isinstance(node, torch.fx.Node) else None
    return tuple(spec.shape) if isinstance(spec, TensorSpec) else None


def _kernel(gm: torch.fx.GraphModule, node: torch.fx.Node, scale: float) -> tuple[str, float | None]:
    """Return the node's kind of kernel (``gemm``, ``conv``, ``other``) and its smallest GEMM dimension
    (for a convolution: input channels x kernel size, which its efficiency follows on CPUs, or its output
    positions where fewer)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear):
            out = _shape(node)
            rows = (_numel(out) / mod.out_features * scale) if out else None
            return "gemm", min(d for d in (rows, mod.in_features, mod.out_features) if d is not None)
        if isinstance(mod, nn.modules.conv._ConvNd):
            return "conv", _conv_dim(node, mod.in_channels // mod.groups * _numel(tuple(mod.kernel_size)), scale)
        heavy = (node.meta.get("fxpipe.flops", 0) or 0) > 16 * _numel(_shape(node) or (1,))
        return ("gemm", None) if heavy else ("other", None)
    if node.op not in ("call_function", "call_method"):
        return "other", None
    name = _name(node.target)
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if name in _CONV_FUNCTIONS and len(args) > 1 and _shape(args[1]):
        w = _shape(args[1]) or ()
        return "conv", _conv_dim(node, _numel(w[1:]), scale)  # input channels (per group) x kernel size
    if name in _GEMM_FUNCTIONS or (name == "matmul" or node.target is operator.matmul):
        shapes = [s for s in (_shape(a) for a in args[:2]) if s]
        if name == "linear" and len(shapes) == 2:
            rows = _numel(shapes[0][:-1]) * scale
            return "gemm", min(rows, *shapes[1])
        if name == "scaled_dot_product_attention" and len(shapes) == 2:
            return "gemm", float(min(shapes[0][-2], shapes[1][-2], shapes[0][-1]))
        if len(shapes) == 2 and len(shapes[0]) >= 2 and len(shapes[1]) >= 2:
            m = shapes[0][-2] * (scale if len(shapes[0]) == 2 else 1.0)
            return "gemm", min(m, shapes[0][-1], shapes[1][-1])
        return "gemm", None
    return "other", None


def _conv_dim(node: torch.fx.Node, depth: float, scale: float) -> float:
    """Return a convolution's smallest GEMM dimension: ``depth`` (input channels x kernel size), or its output
    positions (rows x pixels of a micro-batch) where fewer (ResNet's last 2x2 maps of one row: 4)."""
    out = _shape(node)
    if not out or len(out) < 3 or not out[1]:
        return float(depth)
    return float(min(depth, _numel(out) / out[1] * scale))


def _numel(shape: Sequence[int] | None) -> float:
    """Return the number of elements of a shape."""
    out = 1.0
    for d in shape or ():
        out *= d
    return out


def node_times(gm: torch.fx.GraphModule, device: DeviceModel, scale: float, dtype: torch.dtype,
               measured: Mapping[str, tuple[float, float]] | None = None) -> dict[str, NodeTime]:
    """Return each compute node's seconds for a micro-batch ``scale`` times the example batch.

    ``measured`` maps node names to measured ``(forward, backward)`` seconds at that size; the
    others come from ``device``.
    """
    out = {}
    element = device.seconds_per_element(torch.empty((), dtype=dtype).element_size())
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        flops = float(node.meta.get("fxpipe.flops", 0) or 0) * scale
        flops_bwd = float(node.meta.get("fxpipe.flops_bwd", 0) or 0) * scale
        kind, d = _kernel(gm, node, scale)
        if kind == "other":
            fwd = device.kernel_overhead * (1.0 if flops else 0.5) + flops * element
            bwd = (device.backward_overhead * (1.0 if flops else 0.5) + flops_bwd * element) if flops_bwd else 0.0
            weight = 0.0
        else:
            rate = device.flops_per_second(dtype, kind, d)
            fwd = device.kernel_overhead + flops / rate
            bwd = device.backward_overhead + flops_bwd / rate if flops_bwd else 0.0
            weight = min(flops / rate, bwd) if model_defers(gm, node) else 0.0
        if measured is not None and node.name in measured:
            mf, mb = measured[node.name]
            weight = weight / bwd * mb if bwd else 0.0
            fwd, bwd = mf, mb
        out[node.name] = NodeTime(fwd, bwd, weight)
    return out
