"""Cost models for partitioning: per-node costs, cut widths, stage memory, communication weights.

Reads:  ``fxpipe.flops``, ``fxpipe.flops_bwd``, ``fxpipe.bytes``, ``fxpipe.saved_bytes``,
        ``fxpipe.param_bytes`` (from :func:`fxpipe.passes.annotate`) and ``fxpipe.time`` (from
        :func:`fxpipe.passes.profile`).
Writes: nothing.

Each ``balance_by`` kind gives every compute node a cost, in its own unit:

    flops    forward + backward FLOPs (``fxpipe.flops + fxpipe.flops_bwd``)
    time     measured forward + backward milliseconds (``fxpipe.time``)
    params   bytes of the parameters and buffers the node reads (a ``get_attr`` tensor counts
             at each compute node that reads it: every stage reading it holds it)
    memory   the node's share of a stage's peak memory (below)

A stage ``[a, b)`` of the chosen node order also pays for communication:
``comm_in * w[a] + comm_out * w[b]``, where ``w[p]`` is the *cut width* before position ``p``:
the bytes of the values made before ``p`` (graph inputs included, parameters not: they are
never sent) and read at or after ``p``. The weights convert bytes to the balance unit
(:func:`comm_weights`); stages on the same device copy nothing and pay nothing.

Stage memory (for ``max_memory=`` and ``balance_by="memory"``), with ``m`` micro-batches::

    2 * params            the parameters and their gradients (optimizer state not counted)
    + f_act * saved       the outputs its nodes keep for backward, for the whole mini-batch
    + f_in * w[a]         the inputs kept by checkpointed micro-batches (w[a] bounds them)

    checkpoint   f_act   f_in        (every micro-batch holds 1/m of the mini-batch)
    never        1       0           all m micro-batches keep their activations
    except_last  1/m     (m-1)/m     the last keeps them; the others keep inputs and recompute
    always       1/m     1           every one keeps inputs; one recomputes at a time
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.fx

__all__ = [
    "BALANCE_KINDS",
    "BYTES_PER_SECOND",
    "COMPUTE_OPS",
    "FLOPS_PER_SECOND",
    "comm_weights",
    "cut_widths",
    "memory_factors",
    "node_costs",
    "node_memory",
]

COMPUTE_OPS = ("call_module", "call_function", "call_method")
BALANCE_KINDS = ("flops", "params", "memory", "time")

# Sustained throughput assumed when a byte sent is weighed against FLOPs computed.
FLOPS_PER_SECOND = {"cuda": 50e12, "cpu": 2e11}
# Copy bandwidth between two devices: PCIe 4.0 x16 between GPUs without NVLink, host memcpy.
BYTES_PER_SECOND = {("cuda", "cuda"): 25e9, ("cpu", "cuda"): 12e9, ("cuda", "cpu"): 12e9,
                    ("cpu", "cpu"): 10e9}
_DEFAULT_BYTES_PER_SECOND = 10e9
_DEFAULT_FLOPS_PER_SECOND = 1e12


def comm_weights(devices: Sequence[str | torch.device], balance_by: str) -> list[float]:
    """Return, per boundary between stages, the cost of one crossing byte in ``balance_by`` units.

    ``flops``: the receiver's FLOPs per second over the link's bytes per second; ``time``:
    milliseconds per byte; ``params`` and ``memory``: 0. A boundary between stages on the same
    device costs 0 (nothing is copied).
    """
    placed = [torch.device(d) for d in devices]
    out = []
    for src, dst in pairwise(placed):
        if src == dst or balance_by in ("params", "memory"):
            out.append(0.0)
            continue
        bandwidth = BYTES_PER_SECOND.get((src.type, dst.type), _DEFAULT_BYTES_PER_SECOND)
        if balance_by == "time":
            out.append(1e3 / bandwidth)
        else:
            out.append(FLOPS_PER_SECOND.get(dst.type, _DEFAULT_FLOPS_PER_SECOND) / bandwidth)
    return out


def memory_factors(checkpoint: str, micro_batches: int) -> tuple[float, float]:
    """Return ``(f_act, f_in)``: the shares of saved activations and of inputs a stage keeps."""
    m = max(int(micro_batches), 1)
    if checkpoint == "never":
        return 1.0, 0.0
    if checkpoint == "except_last":
        return 1.0 / m, (m - 1) / m
    if checkpoint == "always":
        return 1.0 / m, 1.0
    raise ValueError(f"checkpoint={checkpoint!r}; use 'always', 'except_last' or 'never'")


def _params_read(node: torch.fx.Node, key: str = "fxpipe.param_bytes") -> float:
    """Return the parameter bytes a compute node reads, through its module or ``get_attr`` inputs.

    ``key`` ``"fxpipe.grad_bytes"`` counts the trainable ones only (those given gradients).
    """
    total = node.meta.get(key, 0) or 0
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            total += a.meta.get(key, 0) or 0
    return float(total)


def node_memory(node: torch.fx.Node, f_act: float) -> float:
    """Return a compute node's share of its stage's memory: parameters + their gradients + kept activations.

    A frozen parameter has no gradient (a graph annotated before ``fxpipe.grad_bytes`` counts every one).
    """
    grads = _params_read(node, "fxpipe.grad_bytes") if "fxpipe.grad_bytes" in node.meta else _params_read(node)
    return _params_read(node) + grads + f_act * float(node.meta.get("fxpipe.saved_bytes", 0) or 0)


def node_costs(order: Sequence[torch.fx.Node], balance_by: str, f_act: float = 1.0) -> list[float]:
    """Return the cost of each compute node of ``order`` under ``balance_by`` (0 when unannotated)."""
    if balance_by == "flops":
        return [float((n.meta.get("fxpipe.flops", 0) or 0) + (n.meta.get("fxpipe.flops_bwd", 0) or 0))
                for n in order]
    if balance_by == "time":
        return [float(n.meta.get("fxpipe.time", 0.0) or 0.0) for n in order]
    if balance_by == "params":
        return [_params_read(n) for n in order]
    if balance_by == "memory":
        return [node_memory(n, f_act) for n in order]
    raise ValueError(f"unknown balance_by={balance_by!r}; use one of {list(BALANCE_KINDS) + ['auto']}")


def cut_widths(gm: torch.fx.GraphModule, order: Sequence[torch.fx.Node]) -> list[float]:
    """Return ``w[0..n]``: the bytes crossing the cut before each position of ``order``.

    ``w[0]`` is the bytes of the graph's inputs (what stage 0 receives) and ``w[n]`` the
    bytes of its output. ``get_attr`` values are never counted.
    """
    n = len(order)
    pos = {node: i for i, node in enumerate(order)}
    diff = [0.0] * (n + 2)
    w0 = wn = 0.0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            start = 0
            w0 += float(node.meta.get("fxpipe.bytes", 0) or 0)
        elif node.op in COMPUTE_OPS:
            start = pos[node] + 1
        else:
            if node.op == "output":
                wn = float(node.meta.get("fxpipe.bytes", 0) or 0)
            continue
        size = float(node.meta.get("fxpipe.bytes", 0) or 0)
        if not size or not node.users:
            continue
        last = max(pos.get(u, n) for u in node.users)  # the output node reads at position n
        start, end = max(start, 1), min(last, n - 1)
        if start <= end:
            diff[start] += size
            diff[end + 1] -= size
    w, running = [w0], 0.0
    for p in range(1, n):
        running += diff[p]
        w.append(running)
    w.append(wn)
    return w
