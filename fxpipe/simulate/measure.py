"""Measure each node's forward and backward seconds for a micro-batch, on this machine, for the simulator.

    inputs of `rows` rows ─▶ passes.profile (each node alone) ─▶ shares of forward and backward
                         ─▶ the whole graph, forward then backward ─▶ seconds per pass
                         ─▶ node seconds = its share x the whole pass

A node timed alone runs with its inputs hot in cache and pays autograd's start-up for each
backward; the whole graph does neither. So the profile (the ``balance_by="time"`` pass) gives
each node's share of its pass, and one run of the whole graph gives the pass's seconds. The
model is run on copies of its parameters and buffers (its gradients and running statistics
are untouched), whose gradients accumulate from one run to the next as over a pipeline's
micro-batches: a fresh gradient each time would also time the allocation of new memory.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe import passes
from fxpipe.passes.spec import TensorSpec
from fxpipe.passes.timing import seconds

__all__ = ["agreed", "inputs_of_rows", "measure_everywhere", "measure_nodes", "node_profile", "passes_of", "plain_copy",
           "rescale", "retain_anywhere", "whole_graph"]

_KEYS = ("fxpipe.time_fwd", "fxpipe.time_bwd", "fxpipe.time")


def inputs_of_rows(gm: torch.fx.GraphModule, rows: int, example_inputs: tuple | None = None) -> tuple:
    """Return inputs with ``rows`` rows: the example's rows (repeated if too few), or random ones of
    the placeholders' annotated shapes (integer inputs are zeros)."""
    if example_inputs is not None:
        def resize(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            reps = -(-rows // t.shape[0])
            return t.repeat(reps, *([1] * (t.dim() - 1)))[:rows] if reps > 1 else t[:rows]
        return tuple(tree_map(resize, tuple(example_inputs)))
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        spec = n.meta.get("fxpipe.value")

        def make(s: Any) -> Any:
            if not isinstance(s, TensorSpec):
                return s
            shape = (rows, *s.shape[1:]) if s.shape else ()
            return torch.randn(shape, dtype=s.dtype) if s.dtype.is_floating_point else torch.zeros(shape, dtype=s.dtype)
        out.append(tree_map(make, spec, is_leaf=lambda s: isinstance(s, TensorSpec)))
    return tuple(out)


def passes_of(gm: torch.fx.GraphModule, args: tuple, device: torch.device) -> tuple[Callable[[], Any],
                                                                                 Callable[[], None]]:
    """Return the graph's forward (building autograd's graph) and its forward then backward, run on copies
    of its parameters and buffers on ``device``."""
    params = {k: v.detach().to(device, copy=True).requires_grad_(v.requires_grad) for k, v in gm.named_parameters()}
    buffers = {k: v.detach().to(device, copy=True) for k, v in gm.named_buffers()}
    state = params | buffers
    wrt = [p for p in params.values() if p.requires_grad]

    def forward() -> Any:
        with torch.enable_grad():
            return torch.func.functional_call(gm, state, args)

    def both() -> None:
        outs = [t for t in tree_flatten(forward())[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs and wrt:  # gradients add into the copies' .grad, as a pipeline's micro-batches do
            torch.stack([t.float().mean() for t in outs]).sum().backward()

    return forward, both


def whole_graph(gm: torch.fx.GraphModule, args: tuple, device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """Return the seconds of the graph's forward (building autograd's graph) and of its backward."""
    forward, both = passes_of(gm, args, device)
    f_times, b_times = [], []
    forward()
    both()
    for _ in range(repeats):  # alternate, so a change of load hits both alike
        f_times.append(seconds(forward, device))
        b_times.append(seconds(both, device))
    fwd = statistics.median(f_times)
    return fwd, max(statistics.median(b_times) - fwd, 0.0)


def node_profile(gm: torch.fx.GraphModule, args: tuple, device: str | torch.device = "cpu",
                 repeats: int = 3) -> dict[str, tuple[float, float]]:
    """Return ``{node name: (forward, backward)}`` seconds of each compute node timed alone on ``args``.

    Runs :func:`fxpipe.passes.profile` and leaves the graph's earlier measured times as they were.
    """
    before = {n: {k: n.meta[k] for k in _KEYS if k in n.meta} for n in gm.graph.nodes}
    try:
        passes.profile(gm, args, device=device, repeats=repeats, progress_after=float("inf"))
        return {n.name: (n.meta.get("fxpipe.time_fwd", 0.0) / 1e3, n.meta.get("fxpipe.time_bwd", 0.0) / 1e3)
                for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
    finally:
        for n, saved in before.items():
            for k in _KEYS:
                n.meta.pop(k, None)
            n.meta.update(saved)


def rescale(alone: dict[str, tuple[float, float]], forward: float, backward: float) -> dict[str, tuple[float, float]]:
    """Scale node times so that forwards sum to ``forward`` seconds and backwards to ``backward``."""
    sum_f = sum(f for f, _ in alone.values())
    sum_b = sum(b for _, b in alone.values())
    kf = forward / sum_f if forward and sum_f else 1.0
    kb = backward / sum_b if backward and sum_b else 1.0
    return {k: (f * kf, b * kb) for k, (f, b) in alone.items()}


def measure_nodes(gm: torch.fx.GraphModule, rows: int, example_inputs: tuple | None = None,
                  device: str | torch.device = "cpu", repeats: int = 3, whole: int | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Return ``{node name: (forward, backward)}`` seconds for a micro-batch of ``rows`` rows on ``device``.

    Each node alone is timed ``repeats`` times (its share of the pass), the whole graph ``whole``
    times (default ``max(repeats, 3)``: the pass's seconds, what sets every prediction's scale).

    ``gm`` must be annotated (:func:`fxpipe.passes.annotate`); its measured times from an earlier
    ``balance_by="time"`` profile are left as they were.
    """
    dev = torch.device(device)
    args = inputs_of_rows(gm, rows, example_inputs)
    alone = node_profile(gm, args, dev, repeats)
    moved = tuple(tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, args))
    return rescale(alone, *whole_graph(gm, moved, dev, repeats=whole or max(repeats, 3)))


def _plain(t: torch.Tensor, meta: bool = False) -> torch.Tensor:
    """Return a plain local tensor standing in for ``t``: a copy, or random values of its full shape
    where ``t`` has no data here (meta) or is a DTensor (its global shape); ``meta``: a meta tensor."""
    if meta:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    if t.is_meta or hasattr(t, "_local_tensor"):
        shape, dtype = tuple(t.shape), t.dtype
        return torch.randn(shape, dtype=dtype) * 0.02 if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    return t.detach().cpu().clone()


def plain_copy(gm: torch.fx.GraphModule, meta: bool = False) -> torch.fx.GraphModule:
    """Return a copy of ``gm`` whose parameters and buffers are plain tensors on the CPU (see :func:`_plain`;
    ``meta``: on meta).

    The graph and its node annotations are kept; the model's own tensors are neither copied to
    the copy nor touched.
    """
    memo: dict[int, Any] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(_plain(p, meta), requires_grad=p.requires_grad)
    for _, b in gm.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), _plain(b, meta))
    return copy.deepcopy(gm, memo)


def retain_anywhere(gm: torch.fx.GraphModule) -> None:
    """Write what backward keeps (:func:`fxpipe.passes.retain`) on ``gm``'s nodes, from a meta copy if
    ``gm`` holds DTensors (which the pass's fake tensors cannot mix with plain ones)."""
    if all("fxpipe.retains" in n.meta for n in gm.graph.nodes):
        return
    if not any(hasattr(t, "_local_tensor") for t in [*gm.parameters(), *gm.buffers()]):
        passes.retain(gm)
        return
    twin = plain_copy(gm, meta=True)
    passes.retain(twin)
    kept = {n.name: n.meta.get("fxpipe.retains") for n in twin.graph.nodes}
    for n in gm.graph.nodes:
        n.meta["fxpipe.retains"] = kept.get(n.name) or {}


def _needs_copy(gm: torch.fx.GraphModule) -> bool:
    """Tell whether some parameter or buffer of ``gm`` has no plain data in this process."""
    return any(t.is_meta or hasattr(t, "_local_tensor") for t in [*gm.parameters(), *gm.buffers()])


def _across() -> bool:
    """Tell whether this process is one rank of several in an initialised process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreed(make: Callable[[], Any]) -> Any:
    """Return ``make()``, computed on rank 0 alone (the others waiting) and sent to every rank across ranks."""
    import torch.distributed as dist

    if not _across():
        return make()
    box: list[Any] = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measure_everywhere(gm: torch.fx.GraphModule, rows: int, example_inputs: tuple | None = None,
                       repeats: int = 3) -> dict[str, tuple[float, float]]:
    """Return :func:`measure_nodes` of ``gm`` on the CPU, the same on every rank of a process group.

    Across ranks (``torch.distributed`` initialised, world > 1) rank 0 times a :func:`plain_copy`
    while the others wait, and the times are broadcast: a rank holds only its own stages (the
    rest on meta), FSDP2 and tensor parallelism hold DTensors, and ranks measuring at once on
    shared cores would slow each other down. The whole graph is timed ``3 x repeats`` times
    there: a step of the ranks is timed over many repetitions, and one short burst on a shared
    machine drifted by up to 1.5x from one run to the next. In one process: ``gm`` itself, or
    its plain copy if some tensors have no data here.
    """
    if not _across():
        return measure_nodes(plain_copy(gm) if _needs_copy(gm) else gm, rows, example_inputs, repeats=repeats)
    return dict(agreed(lambda: measure_nodes(plain_copy(gm), rows, example_inputs, repeats=repeats,
                                             whole=3 * repeats)))
