"""What one micro-batch costs each stage: seconds per action and bytes held, from the graph's annotations.

Reads ``node.meta``: ``fxpipe.flops``, ``fxpipe.flops_bwd``, ``fxpipe.bytes``, ``fxpipe.value``
(:func:`fxpipe.passes.annotate`), ``fxpipe.stage`` (the partition), ``fxpipe.retains``
(:func:`fxpipe.passes.retain`, run here when missing). Annotations are for the example batch;
a micro-batch of ``rows`` rows scales every activation by ``rows / example rows``.

A stage's seconds are its nodes' (:mod:`fxpipe.simulate.nodetime`: a device model's rates, or measured
times); ``weight`` is the part zero bubble's ``W`` takes, ``I`` the rest of the backward.

Bytes per micro-batch (:class:`StageCost`)::

    kept       what a stage holds from F to B: the values its nodes' backward saved (once each),
               its inputs and its outputs (the last stage: what its loss saves, as much as the output)
    inputs     what it holds instead when checkpointed (its inputs); B recomputes ``kept``
    sel_kept   what it holds under selective recomputation: its inputs and outputs, the saved
               values of its expensive nodes, the kept values recomputing reads
               (:func:`fxpipe.passes.selective.selective_bytes`); ``sel_redo`` the most one
               segment's recomputation adds during B, ``sel_forward`` the seconds it takes
    stay       what it holds under offload: its inputs and outputs (the rest waits in host memory)
    wstore     what it holds from I to W: each deferred linear's input and output gradient
    transient  the backward's own workspace: at most one node's output gradient and its inputs'
               gradients at once, before the saved values behind them are freed
    accumulate what a later micro-batch's backward adds on top: a node's fresh weight gradient,
               before autograd adds it into the one held (the first backward keeps its own);
               ``accumulate_i`` the same in I, whose deferred linears leave theirs to W, which
               adds them into ``.grad`` in place (``grads_w`` of the gradients appear at W)

The model's inputs are the caller's tensors, there before the step: neither counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fxpipe.passes.inplace import known_mutations
from fxpipe.passes.linears import model_defers
from fxpipe.passes.retain import retain
from fxpipe.passes.selective import selective_bytes, selective_plan
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.plan.stages import example_rows
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.nodetime import node_times

__all__ = ["StageCost", "describe", "example_rows", "graph_costs", "plan_costs", "under"]

@dataclass
class StageCost:
    """One stage, one micro-batch: seconds of each action's work and bytes held (see the module)."""

    forward: float
    backward: float  # input and weight gradients (without recomputation)
    weight: float  # the part of ``backward`` that W takes when the schedule defers it
    loss: float = 0.0  # the loss's forward and backward, on the last stage
    recompute: float = 0.0  # seconds every backward recomputes besides (set for a selective stage)
    kept: float = 0.0
    inputs: float = 0.0
    wstore: float = 0.0
    wstore_in: float = 0.0  # the part of ``wstore`` that is the stage's own inputs
    transient: float = 0.0
    accumulate: float = 0.0
    accumulate_i: float = 0.0
    grads_w: float = 0.0  # the gradients of the deferred linears (zero bubble makes them at the first W)
    sel_kept: float = 0.0
    sel_redo: float = 0.0
    sel_forward: float = 0.0
    stay: float = 0.0
    params: float = 0.0  # parameters and buffers
    grads: float = 0.0  # gradients of the trainable parameters
    frozen: bool = False  # nothing needs a gradient: the runtime never recomputes it
    sends: dict[int, float] = field(default_factory=dict)  # consumer stage -> bytes of values
    grads_back: dict[int, float] = field(default_factory=dict)  # producer stage -> bytes of gradients
    # across ranks (set by the simulator): what messages hold per micro-batch
    pinned_f: float = 0.0  # values sent to other ranks, held until the step's sends are flushed
    pinned_b: float = 0.0  # gradients sent back to other ranks, likewise
    ahead_f: float = 0.0  # the next micro-batch's receive buffers, posted while this one computes
    ahead_b: float = 0.0


def graph_costs(gm: torch.fx.GraphModule, plan: PipelinePlan, device: DeviceModel, rows: float,
                dtype: torch.dtype | None = None, measured: Mapping[str, tuple[float, float]] | None = None,
                save: Callable[[torch.fx.Node], bool] | None = None, memo: dict | None = None) -> list[StageCost]:
    """Return every stage's :class:`StageCost` for micro-batches of ``rows`` rows.

    ``memo`` (a dict kept between calls on the same graph, as a search makes them) holds what does
    not depend on ``rows``: the graph's mutations, each stage's selective plan and state bytes.

    ``dtype`` (default: the parameters') is what activations are computed and kept in: mixed
    precision (``torch.bfloat16`` with float32 parameters) halves their bytes, not the state's.
    The loss (on the last stage) is taken as three memory-bound passes over the model's output.
    ``save`` is what selective recomputation keeps (default: the expensive nodes).
    """
    base = example_rows(gm) or rows
    own = _dtype(gm)
    dtype = dtype or own
    item = torch.empty((), dtype=dtype).element_size()
    bytes_scale = rows / base * item / torch.empty((), dtype=own).element_size()  # activations in ``dtype``
    scale = rows / base
    if any("fxpipe.retains" not in n.meta for n in gm.graph.nodes):
        retain(gm)
    times = node_times(gm, device, scale, dtype, measured)
    nodes = {n.name: n for n in gm.graph.nodes}
    size = {n.name: float(n.meta.get("fxpipe.bytes", 0) or 0) * bytes_scale for n in gm.graph.nodes}
    size[""] = sum(size[n.name] for n in gm.graph.nodes if n.op == "output")  # the model's output
    consumers = plan.consumers()
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    memo = {} if memo is None else memo
    if "mutations" not in memo:
        memo["mutations"] = known_mutations(gm)
    mutations = memo["mutations"]
    costs = []
    for s in plan.stages:
        mine = [nodes[v] for v in s.nodes if v in nodes]
        t = [times[n.name] for n in mine if n.name in times]
        # what a micro-batch's forward leaves for its backward (a frozen stage runs none: nothing)
        kept: dict[str, float] = {} if s.frozen else {v: size.get(v, 0.0) for v in s.inputs + s.outputs}
        for v in placeholders:  # the caller's batch: there before the step, not the stage's to hold
            kept[v] = 0.0
        internal = 0.0
        for n in ([] if s.frozen else mine):
            for v, nbytes in (n.meta.get("fxpipe.retains") or {}).items():
                if v in placeholders:
                    continue
                if v:
                    kept[v] = max(kept.get(v, 0.0), nbytes * bytes_scale)
                else:
                    internal += nbytes * bytes_scale
        deferred = [n for n in mine if model_defers(gm, n)]
        xs = {a.name for n in deferred for a in n.args[:1] if isinstance(a, torch.fx.Node)} - placeholders
        sends: dict[int, float] = {}
        for v in s.outputs:
            for c in consumers.get(v, []):
                sends[c] = sends.get(c, 0.0) + size.get(v, 0.0)
        grads_back: dict[int, float] = {}
        producer = plan.producer()
        for v in s.grad_inputs:
            if v in producer:
                grads_back[producer[v]] = grads_back.get(producer[v], 0.0) + size.get(v, 0.0)
        key = tuple(s.nodes)
        if ("state", key) not in memo:
            memo[("state", key)] = _state_bytes(gm, mine)
        params, grads = memo[("state", key)]
        if ("fresh", key) not in memo:  # each node's trainable bytes: its weight gradient, fresh
            memo[("fresh", key)] = {n.name: _state_bytes(gm, [n])[1] for n in mine if n.op != "placeholder"}
        fresh = memo[("fresh", key)]
        later = {n.name for n in deferred}
        last = size[""] if s.index == plan.n_stages - 1 else 0.0
        out_elems = last / item
        compute = [n for n in mine if n.op in ("call_module", "call_function", "call_method")]
        free = set(s.inputs) | set(s.outputs) | placeholders
        if ("selective", key) not in memo:
            memo[("selective", key)] = selective_plan(gm, compute, save, mutations)
        sel = selective_bytes(compute, memo[("selective", key)], size, free, bytes_scale)
        ends = sum(v for k, v in kept.items() if k in s.inputs or k in s.outputs)  # its inputs and outputs
        # per node, what its backward holds at once: its output gradient and its inputs' gradients
        work = {n.name: size[n.name] + sum(size.get(a.name, 0.0) for a in n.all_input_nodes if a.name not in placeholders)
                for n in mine}
        transient = max(work.values(), default=0.0)
        costs.append(StageCost(
            forward=sum(x.forward for x in t), backward=sum(x.backward for x in t),
            weight=sum(x.weight for x in t),
            loss=(4 * device.kernel_overhead + 3 * out_elems * device.seconds_per_element(item)) if out_elems else 0.0,
            kept=sum(kept.values()) + internal + last,
            sel_kept=ends + sum(sel.kept.values()) + sel.internal + last, sel_redo=sel.redo,
            sel_forward=sum(times[v].forward for v in sel.rerun if v in times), stay=ends + last,
            inputs=sum(size.get(v, 0.0) for v in s.inputs if v not in placeholders),
            wstore=sum(size.get(x, 0.0) for x in xs) + sum(size[n.name] for n in deferred),
            wstore_in=sum(size.get(x, 0.0) for x in xs if x in s.inputs),
            transient=transient,
            accumulate=max((w + fresh.get(v, 0.0) for v, w in work.items()), default=0.0) - transient,
            accumulate_i=max((w + (0.0 if v in later else fresh.get(v, 0.0)) for v, w in work.items()),
                             default=0.0) - transient,
            grads_w=sum(fresh.get(v, 0.0) for v in later),
            params=params, grads=grads, sends=sends, grads_back=grads_back, frozen=s.frozen))
    return costs


def _state_bytes(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> tuple[float, float]:
    """Return the bytes of the parameters and buffers ``nodes`` read, and of the trainable ones."""
    seen: dict[int, torch.Tensor] = {}
    for n in nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            seen.update({id(t): t for t in list(mod.parameters()) + list(mod.buffers())})
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                obj: Any = gm
                for part in str(a.target).split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, torch.Tensor):
                    seen[id(obj)] = obj
    total = sum(t.numel() * t.element_size() for t in seen.values())
    trainable = sum(t.numel() * t.element_size() for t in seen.values() if t.requires_grad)
    return float(total), float(trainable)


def _dtype(gm: torch.fx.GraphModule) -> torch.dtype:
    """Return the dtype of the model's floating parameters (float32 if none)."""
    for p in gm.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def plan_costs(plan: PipelinePlan, device: DeviceModel, chunks: int, batch_scale: float = 1.0,
               dtype: torch.dtype = torch.float32) -> list[StageCost]:
    """Return coarse per-stage costs from a plan alone (a saved one: no graph to read).

    Forward takes a third of a stage's FLOPs (or measured ``time_ms``) and backward two thirds,
    half of it weight gradients (a frozen stage's are all forward), every kernel at the device's
    plateau rate; a micro-batch holds ``saved_bytes`` and sends ``activation_bytes`` on.
    ``batch_scale`` is the mini-batch over the example batch the plan was made for.
    """
    per_micro = batch_scale / chunks  # of the plan's whole-batch FLOPs and times
    nbytes = batch_scale * plan.chunks / chunks  # of the plan's per-micro-batch bytes
    rate = device.flops_per_second(dtype, "gemm")
    producer = plan.producer()
    out = []
    for s in plan.stages:
        if s.time_ms:
            total = s.time_ms / 1e3 * per_micro
        else:
            total = s.flops * per_micro / rate + (device.kernel_overhead + device.backward_overhead) * len(s.nodes)
        last = s.index == plan.n_stages - 1
        back = 0.0 if s.frozen else 2 / 3  # a frozen stage's FLOPs are its forward's alone
        out.append(StageCost(
            forward=total * (1 - back), backward=total * back, weight=total * back / 2,
            kept=float(s.saved_bytes) * nbytes, inputs=float(s.checkpoint_bytes) * nbytes,
            wstore=float(s.saved_bytes) * nbytes / 2, params=float(s.params), grads=0.0 if s.frozen else float(s.params),
            sends={} if last else {s.index + 1: float(s.activation_bytes) * nbytes}, frozen=s.frozen,
            grads_back={producer[v]: float(s.checkpoint_bytes) * nbytes / max(len(s.grad_inputs), 1)
                        for v in s.grad_inputs if v in producer}))
    return out


def under(c: StageCost, policy: str) -> StageCost:
    """Return a stage's costs as a ``policy`` stage pays them (whole-stage checkpointing: unchanged)."""
    if policy == "selective":
        return dataclasses.replace(c, kept=c.sel_kept, transient=c.transient + c.sel_redo, recompute=c.sel_forward)
    if policy == "offload":  # the saved activations come back for the backward, one micro-batch at a time
        return dataclasses.replace(c, kept=c.stay, transient=c.transient + max(c.kept - c.stay, 0.0))
    return c


def describe(policies: Sequence[str]) -> str:
    """Name the policies of a step: one mode, or the stages' joined by commas."""
    return policies[0] if len(set(policies)) == 1 else ",".join(policies)
