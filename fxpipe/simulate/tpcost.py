"""What tensor parallelism does to each stage's costs: its share of the work, its collectives, its shards.

    a stage over t ranks:   the sharded nodes' seconds / t (the styled linears, the values left as shards)
                            + the collectives of its styled calls, over the intra-node link:
                              all-reduce        2 (t - 1) / t x bytes / bandwidth + 2 (t - 1) x latency
                              all-gather, reduce-scatter   (t - 1) / t x bytes / bandwidth + (t - 1) x latency
                            the sharded weights' bytes (and gradients) / t

Reads the tensor-parallel record of the plan (``plan.tensor_parallel``: the styles and the collectives
of each styled call for the example batch, :mod:`fxpipe.plan.tensorparallel`), ``node.meta["fxpipe.tp"]``
and the stage costs of :mod:`fxpipe.simulate.stagecost`. Forward collectives add to ``F``, backward
ones to ``B`` and ``I`` (the input gradients' all-reduce is on the critical path), none to ``W``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from fxpipe.passes.tpsites import find_sites
from fxpipe.plan.pipeline import PipelinePlan, human
from fxpipe.plan.tensorparallel import plan_tensor_parallel
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.nodetime import node_times
from fxpipe.simulate.stagecost import StageCost

__all__ = ["TPCost", "collective_seconds", "tp_record", "tp_table", "with_tensor_parallel"]


@dataclasses.dataclass
class TPCost:
    """One stage's tensor-parallel collectives per micro-batch: counts, bytes and seconds, per pass."""

    forward_count: int = 0
    forward_bytes: float = 0.0
    backward_count: int = 0
    backward_bytes: float = 0.0
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0


def collective_seconds(kind: str, nbytes: float, t: int, device: DeviceModel) -> float:
    """Return the seconds of one ring collective of ``nbytes`` (the whole value's) over ``t`` ranks."""
    bandwidth = device.tp_bandwidth or device.link_bandwidth
    latency = device.tp_latency or device.link_latency
    steps = 2 * (t - 1) if kind == "all_reduce" else t - 1
    return steps / t * nbytes / bandwidth + steps * latency


def with_tensor_parallel(costs: list[StageCost], gm: torch.fx.GraphModule, plan: PipelinePlan, record: Mapping[str, Any],
                         device: DeviceModel, rows: float, dtype: torch.dtype | None = None,
                         measured: Mapping[str, tuple[float, float]] | None = None, sharded: set[str] | None = None
                         ) -> tuple[list[StageCost], list[TPCost]]:
    """Return the stage costs with ``record["size"]`` ranks per stage, and each stage's collectives.

    ``sharded`` names the nodes whose values are shards (default: those ``node.meta["fxpipe.tp"]`` says).
    """
    t = int(record["size"])
    base = next((int(leaf.shape[0]) for n in gm.graph.nodes if n.op == "placeholder"
                 for leaf in [n.meta.get("fxpipe.value")] if getattr(leaf, "shape", None)), rows)
    scale = rows / base
    own = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    times = node_times(gm, device, scale, dtype or own, measured)
    bytes_scale = scale * torch.empty((), dtype=dtype or own).element_size() / torch.empty((), dtype=own).element_size()
    styled = {c["node"] for c in record["calls"]}
    if sharded is None:
        sharded = {n.name for n in gm.graph.nodes if isinstance(n.meta.get("fxpipe.tp"), int)}
    sharded = sharded | styled
    sites = find_sites(gm)
    weights = {fqn: sum(float(p.numel() * p.element_size()) for p in (sites[fqn].weight, sites[fqn].bias)
                        if p is not None) for fqn in record["modules"] if fqn in sites}
    stage_of = {n.name: n.meta.get("fxpipe.stage", 0) for n in gm.graph.nodes}
    out, comms = [], []
    for s in plan.stages:
        mine = [v for v in s.nodes if v in sharded and v in times]
        saved_f = sum(times[v].forward for v in mine) * (1 - 1 / t)
        saved_b = sum(times[v].backward for v in mine) * (1 - 1 / t)
        saved_w = sum(times[v].weight for v in mine) * (1 - 1 / t)
        comm = TPCost()
        for call in record["calls"]:
            if stage_of.get(call["node"], call.get("stage")) != s.index:
                continue
            for when, kind, nbytes in call["collectives"]:
                nbytes = float(nbytes) * scale
                if when == "forward":
                    comm.forward_count += 1
                    comm.forward_bytes += nbytes
                    comm.forward_seconds += collective_seconds(kind, nbytes, t, device)
                else:
                    comm.backward_count += 1
                    comm.backward_bytes += nbytes
                    comm.backward_seconds += collective_seconds(kind, nbytes, t, device)
        shard = sum(b for fqn, b in weights.items() if any(stage_of.get(n) == s.index for n in sites[fqn].nodes))
        c = costs[s.index]
        split = _sharded_kept(gm, s.nodes, sharded) * bytes_scale * (1 - 1 / t)  # saved values that are shards
        grads = max(c.grads - shard * (1 - 1 / t), 0)
        part = grads / c.grads if c.grads else 1.0  # what a rank keeps of the stage's weights: its fresh gradients too
        out.append(dataclasses.replace(
            c, forward=c.forward - saved_f + comm.forward_seconds, backward=c.backward - saved_b + comm.backward_seconds,
            weight=c.weight - saved_w, params=c.params - shard * (1 - 1 / t), grads=grads,
            accumulate=c.accumulate * part, accumulate_i=c.accumulate_i * part, grads_w=c.grads_w * part, kept=max(c.kept - split, c.inputs), sel_kept=max(c.sel_kept - split, c.inputs)))
        comms.append(comm)
    return out, comms


def _sharded_kept(gm: torch.fx.GraphModule, names: list[str], sharded: set[str]) -> float:
    """Return the bytes (example batch) that a stage's backward saves of values a tp rank holds a shard of."""
    nodes = {n.name: n for n in gm.graph.nodes}
    total = 0.0
    for v in names:
        n = nodes.get(v)
        if n is None:
            continue
        for value, nbytes in (n.meta.get("fxpipe.retains") or {}).items():
            if value in sharded or (not value and v in sharded):
                total += float(nbytes)
    return total


def tp_record(gm: Any, plan: PipelinePlan, size: int | None) -> tuple[dict[str, Any] | None, set[str] | None]:
    """Return the tensor-parallel record to simulate (the plan's, or the automatic plan's at ``size``) and its shards.

    The shards are the nodes whose values a rank holds a shard of (None: read them off the graph).
    """
    own = _whole_batch(plan.tensor_parallel, plan.chunks)
    if size is None:
        return own, None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel={size!r}; use an integer of at least 1")
    if size == 1:
        return None, None
    if own is not None and own["size"] == size:
        return own, None
    if gm is None:
        raise ValueError("tensor_parallel= reads the model's graph; simulate the compiled Pipe, not a plan")
    tp = plan_tensor_parallel(gm, size, "auto", record=False)
    return tp.record(1), set(tp.layouts)


def _whole_batch(record: dict[str, Any] | None, chunks: int) -> dict[str, Any] | None:
    """Return a plan's record with its collectives' bytes for the whole example batch, as the simulation scales them.

    The plan records them per micro-batch of the example (``record["micro"]`` of them).
    """
    if record is None:
        return None
    per = int(record.get("micro") or chunks)
    calls = [{**c, "collectives": [[p, k, b * per] for p, k, b in c["collectives"]]} for c in record["calls"]]
    return {**record, "calls": calls, "micro": 1}


def tp_table(t: int, comms: list[TPCost]) -> str:
    """Render each stage's tensor-parallel collectives per micro-batch."""
    lines = [f"tensor parallel over {t} ranks, collectives per micro-batch:"]
    for j, c in enumerate(comms):
        lines.append(f"  stage {j}: forward {c.forward_count} ({human(c.forward_bytes, 'B')}, "
                     f"{c.forward_seconds * 1e3:.3f} ms), backward {c.backward_count} "
                     f"({human(c.backward_bytes, 'B')}, {c.backward_seconds * 1e3:.3f} ms)")
    return "\n".join(lines)
