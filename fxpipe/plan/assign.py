"""Assign every node a stage: trace the model, annotate its graph, cut it.

    model ──trace──▶ GraphModule ──annotate (fake tensors)──▶ costs ──partition──▶ node.meta["fxpipe.stage"]

Nothing real runs: annotation follows shapes on fake tensors (real kernels on copies of the
buffers only for data-dependent ops), and only ``balance_by="time"`` measures kernels.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses import fake_tensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_flatten

from fxpipe import passes
from fxpipe.errors import PipelineInputError, TraceError, user_stacklevel
from fxpipe.frontend.export import named_arguments
from fxpipe.frontend.hooks import warn_lost_hooks
from fxpipe.frontend.markers import resolve_split_points
from fxpipe.frontend.tracing import detector_note, trace
from fxpipe.options import AUTO, CompileOptions, cut_mode
from fxpipe.passes.failure import PropagationError
from fxpipe.plan.batches import batch_size, index_like, is_batched, micro_sizes, refuse_batched_masks
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.plan.saved import apply_plan

__all__ = ["Assignment", "annotate_graph", "assign_stages"]

log = logging.getLogger(__name__)

_DATA_DEPENDENT = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   GuardOnDataDependentSymNode)


@dataclass
class Assignment:
    """The traced, annotated graph with every node's stage, and how it was cut."""

    gm: torch.fx.GraphModule
    cut: Any  # the partitioner's result (costs, memory per stage), None for a saved plan
    micro: int  # micro-batches of the example batch
    balance_by: str
    fixed: bool = False  # the stages were given (split points, markers, a saved plan), not balanced here


def assign_stages(model: nn.Module, options: CompileOptions, saved: PipelinePlan | None,
              devices: Sequence[torch.device], profile_device: torch.device) -> Assignment:
    """Trace ``model``, annotate its graph and assign every node a stage (``fxpipe.stage``).

    Reads the options' example inputs, chunks, checkpointing, balance, split points or markers,
    memory cap, leaf modules and tracer; ``saved`` is a saved plan to apply instead of cutting.
    """
    try:
        return _assign_stages(model, options, saved, devices, profile_device)
    except PropagationError as exc:
        hint = _container_hint(options.example_inputs)
        if hint is None:
            raise
        raise PropagationError(f"{hint}\n{exc}", exc.node, exc.module) from None
    except TraceError as exc:  # torch.export's front end: the same mistake fails while tracing
        hint = _container_hint(options.example_inputs)
        if hint is None:
            raise
        raise TraceError(f"{hint}\n{exc}", module=exc.module, filename=exc.filename, lineno=exc.lineno) from None
    except TypeError as exc:  # a model of several inputs given the list or dict as its first: one missing
        hint = _container_hint(options.example_inputs)
        if hint is None or type(exc) is not TypeError:
            raise
        raise TypeError(f"{hint}\n{exc}") from None


def _container_hint(given: Any) -> str | None:
    """Say how to pass several inputs when ``example_inputs`` was a list or a dict (the model got it whole)."""
    if isinstance(given, list):
        return ("example_inputs is a list, so the model got it as its one input; to give several inputs pass a "
                "tuple, example_inputs=tuple(...)")
    if isinstance(given, dict):
        keys = ", ".join(f"{k!r}: ..." for k in list(given)[:3]) + (", ..." if len(given) > 3 else "")
        return (f"example_inputs is a dict, so the model got it as its one input; to give inputs by name pass "
                f"example_kwargs={{{keys}}} (example_kwargs=the dict)")
    return None


def _assign_stages(model: nn.Module, options: CompileOptions, saved: PipelinePlan | None,
               devices: Sequence[torch.device], profile_device: torch.device) -> Assignment:
    """Trace, annotate and cut (see :func:`assign_stages`)."""
    n_stages, args, kwargs, has_inputs = options.n_stages, options.args, options.kwargs, options.has_inputs
    chunks, checkpoint, balance_by, max_memory = options.chunks, cut_mode(options.checkpoint), options.balance_by, \
        options.max_memory
    if options.checkpoint == AUTO:
        max_memory = None  # the budget is the policy chooser's (fxpipe.simulate.fit), along the schedule
    tracer = options.tracer
    if tracer == "fx" and isinstance(model, torch.fx.GraphModule):
        gm = model
        if not hasattr(gm, "meta"):  # torchvision's create_feature_extractor skips GraphModule.__init__
            gm.meta = {}
    else:
        if tracer == "export":
            _check_example_batch(model, args, kwargs, options.unbatched, chunks > 1)
        gm = trace(model, leaf_modules=options.leaf_modules, tracer=tracer, example_inputs=args,
                   example_kwargs=kwargs, device=devices[0] if devices else None, unbatched=options.unbatched,
                   export_dims=options.export_dims)
        warn_lost_hooks(model, gm, tracer if isinstance(tracer, str) else "fx")
    whole = _mark_unbatched(gm, options.unbatched)

    # torch.distributed.pipelining's markers (pipe_split(), split_spec=) as split points
    split_points = resolve_split_points(gm, n_stages, options.split_points, options.split_spec, saved is not None)

    if has_inputs:
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        values = passes.bind_placeholders(gm, args, kwargs)
        batch = batch_size(values, names, whole, agree=chunks > 1)
        if batch is None and chunks > 1 and any(is_batched(leaf) for value, name in zip(values, names)
                                                if name in whole for leaf in tree_flatten(value)[0]):
            warnings.warn(f"unbatched={sorted(whole)} leaves no input to split into micro-batches: every step "
                          f"runs as one micro-batch, whatever chunks={chunks} says, so nothing is pipelined. Name "
                          "only the inputs without a batch dimension (a table inside a dict input: pass it as an "
                          "argument of its own)", stacklevel=user_stacklevel())
        micro = len(micro_sizes(batch, chunks))
        annotate_graph(gm, args, kwargs)
        listed = passes.listed_batches(gm) if micro > 1 and batch is not None else []
        if listed and batch is not None and (any(stacked for _, stacked in listed) or passes.micro_specs(
                gm, batch, micro_sizes(batch, chunks)[0], whole) is None):
            # a list stacked into the batch (images, per-sample sequences), or joined so that its split does not
            # run; tensors batched on dim 0 already and concatenated (two views) split and run
            raise ValueError(f"{'; '.join(text for text, _ in listed)}. fxpipe splits every tensor of an input on "
                             "its own dim 0 into micro-batches, not a list along its length, so each of them would "
                             "be cut apart (an image along its channels, a sequence along its tokens). Pass the "
                             "batch as one tensor (stack the list before the model and let its forward take the "
                             "stacked batch), or use chunks=1; if each tensor is batched on dim 0 already (feature "
                             "maps), stack them along another dim (torch.stack(maps, dim=-1))")
        states = passes.state_inputs(gm, whole) if batch is not None and micro > 1 else []
        if states:
            raise PipelineInputError(
                f"input(s) {states} are an RNN's initial state, of shape (layers * directions, batch, hidden), which "
                "fxpipe would split on dim 0 (the layers) into micro-batches; pass it batch-first and move the dim "
                "inside the forward (h0.transpose(0, 1).contiguous() before the RNN), or use chunks=1")
        refuse_batched_masks(values, names, whole, micro if batch is not None else 1)
        bags = passes.flat_ids(gm, whole) if batch is not None and micro > 1 else []
        if bags:
            where, inputs = bags[0]
            raise PipelineInputError(
                f"'{where}' takes flat ids with offsets (a jagged batch: every sample's ids one after another) from "
                f"input(s) {inputs}; fxpipe splits each input into micro-batches by rows on dim 0, which cannot cut "
                "flat ids by sample (nor the offsets into them). Pass the ids as a 2-D tensor (batch, ids per "
                "sample) padded with the bag's padding_idx (per_sample_weights the same shape), or flatten a 2-D "
                "input inside the forward; or use chunks=1")
        flat = [name for value, name in zip(values, names) if name in whole and isinstance(value, torch.Tensor)
                and value.dim() == 1 and value.numel() > 1 and index_like(value)] if batch is not None and micro > 1 \
            else []  # one value (a diffusion timestep of shape (1,)) broadcasts: no offsets nor indices
        if flat:
            warnings.warn(
                f"unbatched={flat} gives 1-D integer input(s) whole to each of the {micro} micro-batches: if they hold "
                "offsets, lengths or indices into the batch's rows (cu_seqlens, a group per row), each micro-batch "
                "reads them against rows it does not hold. Pad the batch to one row per sample with a mask, or use "
                "chunks=1 (which needs no unbatched=)", stacklevel=user_stacklevel())
        keys = passes.group_keys(gm) if batch is not None and micro > 1 else []
        if keys:
            told = ", ".join(f"'{name}' (node '{node}')" for name, node in keys)
            warnings.warn(
                f"integer input(s) {told} index the rows of a reduction that groups them (index_add_, scatter_*): "
                "fxpipe cuts micro-batches by rows, so where a group's rows span the cut (a graph or point cloud of a "
                "flat batch, with a per-row group vector or edge_index), each micro-batch reduces part of it, and an "
                "index given whole (unbatched=) points at rows the micro-batch does not hold. Pad the batch to one row "
                "per sample with a mask, or use chunks=1; fxpipe.testing.assert_pipeline_equivalent(model, inputs, "
                f"chunks={chunks}) tells", stacklevel=user_stacklevel())
        if batch is not None and micro > 1:
            _note_coupled(gm, batch, micro_sizes(batch, chunks)[0], chunks, whole)
    else:
        passes.annotate_params(gm)
        micro = chunks
    if saved is not None:
        balance_by = saved.balance_by
    elif balance_by == "auto":
        balance_by = "flops" if has_inputs else "params"
    if saved is None and balance_by in ("flops", "memory", "time") and not has_inputs:
        raise ValueError(f"balance_by={balance_by!r} needs example_inputs= to know the shapes; "
                         "pass example inputs or use balance_by='params'")
    if options.max_memory is not None and not has_inputs:
        raise ValueError("max_memory= needs example_inputs= to know the activation sizes; pass "
                         "example inputs")
    if saved is None and balance_by == "time":
        if profile_device.type == "meta":
            raise ValueError("balance_by='time' measures kernels and cannot run on the meta device; "
                             "give real devices or use balance_by='flops'")
        passes.profile(gm, args, kwargs, device=profile_device)

    comm = passes.comm_weights(devices, balance_by)
    cut = None
    if saved is not None:
        apply_plan(gm, saved, n_stages)
    elif split_points is not None:
        if len(split_points) + 1 != n_stages:
            raise ValueError(f"{len(split_points)} split points make {len(split_points) + 1} stages "
                             f"but n_stages={n_stages}; give n_stages - 1 split points")
        cut = passes.partition_at(gm, split_points, balance_by=balance_by, comm=comm, max_memory=max_memory,
                                  checkpoint=checkpoint, micro_batches=micro)
    else:
        cut = passes.partition(gm, n_stages, balance_by=balance_by, comm=comm, max_memory=max_memory,
                               checkpoint=checkpoint, micro_batches=micro)
    return Assignment(gm, cut, micro, balance_by, fixed=saved is not None or split_points is not None)


def _check_example_batch(model: nn.Module, args: tuple, kwargs: dict, unbatched: Sequence[str], agree: bool) -> None:
    """Refuse example inputs whose batch sizes disagree (but ``unbatched=`` ones), before exporting."""
    signature = inspect.signature(model.forward)
    params = signature.parameters
    unknown = [n for n in unbatched if n not in params]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"unbatched={list(unbatched)!r} names {unknown}, which {type(model).__name__}.forward "
                         f"does not take; its inputs are {list(params)}")
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return  # the front end names the mismatch
    named = named_arguments(signature, bound)
    try:
        batch_size([v for _, v in named], [k for k, _ in named], set(unbatched), agree=agree)
    except PipelineInputError as exc:
        if not detector_note(model):
            raise
        raise PipelineInputError(f"{exc}{detector_note(model)}") from None


def _mark_unbatched(gm: torch.fx.GraphModule, unbatched: Sequence[str]) -> frozenset[str]:
    """Record the placeholders every micro-batch gets whole in ``gm.meta``; refuse a name the graph has no input for.

    A name is a forward input's: torch.export flattens a tuple or dict input into one
    placeholder per tensor (``rope=(cos, sin)``: ``rope_0``, ``rope_1``), each given whole.
    """
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {str(n.target).rsplit("_", 1)[0] for n in gm.graph.nodes if n.op == "placeholder"
                 and "fxpipe.fixed" in n.meta}  # fixed by the trace (a None example input): no rows to keep whole
    unbatched = [n for n in unbatched if n in names or n not in constants]
    flattened = passes.input_placeholders(gm)
    unknown = [n for n in unbatched if n not in names and n not in flattened]
    if unknown:
        raise ValueError(f"unbatched={list(unbatched)!r} names {unknown}, which the traced model has no input for; "
                         f"its inputs are {list(flattened) or names}")
    whole = sorted({p for n in unbatched for p in (flattened.get(n) or [n])})
    gm.meta["fxpipe.unbatched"] = whole
    return frozenset(whole)


def _note_coupled(gm: torch.fx.GraphModule, batch: int, rows: int, chunks: int, whole: frozenset[str]) -> None:
    """Record in ``gm.meta`` the outputs that couple a batch's rows; warn that micro-batches change them."""
    part = passes.micro_specs(gm, batch, rows, whole) if rows != batch else None  # one propagation for both
    found = passes.classify_outputs(gm, batch, rows, whole, part)
    gm.meta["fxpipe.independent"] = found.independent  # (leaf position, name): every micro-batch's alike
    alike = tuple(f"{name} (node " for _, name in found.independent)
    coupled = [c for c in passes.batch_coupled_outputs(gm, batch, rows, whole, part) if not c.startswith(alike)]
    gm.meta["fxpipe.coupled"] = coupled
    scalars = found.coupled
    gm.meta["fxpipe.summed"] = {"sum": found.summed, "mean": found.means, "coupled": found.coupled_names}
    unchecked = passes.scalar_outputs(gm) if rows != batch and part is None else []
    if unchecked:  # the graph does not run for a micro-batch's rows on fake tensors: nothing could be told
        warnings.warn(
            f"the model returns 0-dim output(s) {unchecked}, which fxpipe could not check against a micro-batch's "
            "rows (the graph does not run for them on fake tensors; see the debug log of fxpipe.passes.batchrows). "
            f"Each of the {chunks} micro-batches computes them over its own rows: a mean over the rows (a per-token "
            "loss) comes out as eager's, anything else (a load-balancing loss) differs. Use chunks=1 for the "
            "model's own values", stacklevel=user_stacklevel())
    paired = passes.paired_inputs(gm, batch, rows, whole) if rows != batch and part is None else []
    if paired:  # an adjacency split by rows: its columns still index the whole batch's
        warnings.warn(
            f"input(s) {', '.join(paired)} pair the batch's rows with one another (an adjacency, a pairwise mask: the "
            f"batch's size, {batch}, on another dim than dim 0 too), and the model does not run on a micro-batch's "
            f"{rows} rows (checked on fake tensors): fxpipe splits dim 0 of every input, and the other dims keep the "
            "whole batch's columns. Use chunks=1 (or pass per-sample graphs, batched and padded)",
            stacklevel=user_stacklevel())
    sequences = passes.sequence_first_splits(gm, batch, rows, part)
    if sequences:
        warnings.warn(
            f"fxpipe splits every input on dim 0 into micro-batches, but {'; '.join(sequences)}: each micro-batch "
            "would hold a slice of the sequence for the whole batch, and attend or recur over that slice only, so "
            "outputs and gradients differ from eager's. Pass batch-first inputs (batch_first=True on the module, or "
            "transpose inside the model before it), or use chunks=1", stacklevel=user_stacklevel())
    if coupled or scalars:
        warnings.warn(
            f"the model's output couples the rows of a batch: {'; '.join(coupled + scalars)}. Each of the {chunks} "
            "micro-batches computes it over its own rows only: pipe.step's loss_fn sees those per-micro-batch "
            "values (a contrastive loss then has the micro-batch's negatives, not the batch's; a load-balancing "
            "loss, its micro-batch's balance), so the loss and gradients differ from eager's on the whole batch"
            f"{', and pipe(x) refuses to join them' if coupled else ''}. Use chunks=1 for the model's own values",
            stacklevel=user_stacklevel())


def annotate_graph(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Annotate on fake tensors; for data-dependent ops, on real kernels with buffer copies."""
    try:
        passes.annotate(gm, args, kwargs)
    except _DATA_DEPENDENT as exc:
        if any(t.is_meta for t in (*gm.parameters(), *gm.buffers())):
            raise ValueError(f"fake tensors cannot follow a data-dependent op of the model ({type(exc).__name__}), "
                             "and its tensors are on meta, so fxpipe cannot run the real kernels instead; "
                             "list the module doing it in leaf_modules=, or build the model on a real "
                             "device") from exc
        log.warning("fake tensors cannot follow a data-dependent op (%s); annotating with real "
                    "kernels on copies of the buffers", type(exc).__name__)
        passes.annotate(gm, args, kwargs, real=True)
        gm.meta["fxpipe.data_dependent"] = True  # sizes of later micro-batches are guessed (passes.infer)
