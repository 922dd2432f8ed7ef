"""What the rank holding the first stage tells its pipeline about a step, before it runs.

It checks and splits the inputs, agrees with the other replicas on the batch size, and
sends every rank of its pipeline the micro-batch layout (batch size and the spec of each
micro-batch); each rank sizes its receive buffers from the layout (:func:`specs`,
propagated on fake tensors once per layout and autocast state). Bad input is refused on
every rank of every pipeline with the same error, instead of a mismatched message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.errors import PipelineInputError
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.runtime.comm import on_every_rank
from fxpipe.runtime.stagecall import autocast_state

__all__ = ["check_shapes", "publish", "receive", "specs_for", "tell_all"]


def check_shapes(names: list[str], spec: list[Any], example: list[Any]) -> None:
    """Refuse inputs whose non-batch shape or dtype differs from the example's."""
    for name, got, want in zip(names, spec, example):
        got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
        for g, w in zip(got_leaves, want_leaves):
            if isinstance(w, TensorSpec) and isinstance(g, TensorSpec) and (
                    g.shape[1:] != w.shape[1:] or g.dtype != w.dtype or len(g.shape) != len(w.shape)):
                raise PipelineInputError(
                    f"input '{name}' has shape {tuple(g.shape)} and dtype {g.dtype}, but the plan was "
                    f"built for shape (batch, {', '.join(map(str, w.shape[1:]))}) and dtype {w.dtype}; "
                    "the distributed runtime sizes its receive buffers from the plan, so compile with "
                    "example inputs of the shape you run")


def _agree_on_batch(batch: int | None, group: Any, replica: int) -> None:
    """Refuse a step whose replicas hold different batch sizes, naming two of them."""
    sizes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, batch, group=group)
    for other, size in enumerate(sizes):
        if size != batch:
            raise PipelineInputError(
                f"replica {replica} has a batch of {batch} rows but replica {other} has {size}; every "
                "replica averages its gradients with the others', so give each the same batch size")


def publish(runtime: Any, args: tuple, kwargs: dict, training: bool) -> tuple[dict, list[list[Any]]]:
    """On the first stage's rank: check and split the inputs, send the layout; return it and the micro-batches."""
    try:
        check_shapes(runtime.signature.names, spec_of(runtime.signature.bind(args, kwargs)), runtime.example)
        mbs, batch = runtime.signature.split(args, kwargs, runtime.plan.chunks, training, runtime.device)
        specs = [spec_of(mb) for mb in mbs]
        if runtime.layout.dp > 1:
            _agree_on_batch(batch, runtime.layout.dp_group, runtime.layout.replica)
    except (TypeError, ValueError) as exc:
        tell_all(runtime, {"error": (type(exc).__name__, str(exc))})
        runtime.comm.flush()  # deliver it before this rank's exception ends the process
        raise on_every_rank(exc)
    header = {"batch": batch, "specs": specs}
    tell_all(runtime, header)
    return header, mbs


def receive(runtime: Any) -> dict:
    """On the other ranks: receive the layout (or the first rank's refusal, raised here too)."""
    first = runtime.first
    header = runtime.comm.recv_object(first, f"waiting for rank {first}'s inputs")
    if header.get("error"):
        kind, message = header["error"]
        raise on_every_rank((TypeError if kind == "TypeError" else PipelineInputError)(message))
    return header


def tell_all(runtime: Any, value: Any) -> None:
    """Send a small value from this rank to every other rank of its pipeline."""
    for r in range(runtime.world):
        if r != runtime.rank:
            runtime.comm.send_object(value, r)


def specs_for(runtime: Any, header: dict) -> Callable[[int], dict[str, Any]]:
    """Return micro-batch index -> spec of every crossing value, propagated once per layout."""
    keys = [repr((layout, autocast_state())) for layout in header["specs"]]

    def specs(i: int) -> dict[str, Any]:
        if keys[i] not in runtime.layouts:
            runtime.layouts[keys[i]] = passes.value_specs(runtime.gm, list(header["specs"][i]), runtime.crossing)
        return runtime.layouts[keys[i]]
    return specs
