"""Split inputs into micro-batches and gather outputs back into the model's structure.

The rows each micro-batch gets are the plan's (:mod:`fxpipe.plan.batches`); ``None``,
non-tensor values and 0-dim tensors go to every micro-batch; a target is split the same way,
and each micro-batch's loss is weighted by its share of the rows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from fxpipe.errors import PipelineInputError
from fxpipe.passes.spec import unflatten
from fxpipe.plan.batches import batch_size, is_batched, micro_sizes, refuse_batched_masks
from fxpipe.runtime.observe.blame import add_note
from fxpipe.runtime.targetgrads import Losses, TargetGrads

__all__ = ["batch_size", "check_target_rows", "gather", "is_summed", "micro_losses", "micro_sizes", "scatter",
           "sum_grads", "summed", "to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in ``value`` (any structure) to ``device``; other values stay.

    Copies to a GPU do not block; copies to the CPU do, since the host reads them next.
    """
    return tree_map(lambda t: t.to(device, non_blocking=device.type != "cpu")
                    if isinstance(t, torch.Tensor) and t.device != device else t, value)


def scatter(values: Sequence[Any], names: Sequence[str], chunks: int, whole: Collection[str] = (),
            rows: Callable[[int, int], list[int]] | None = None) -> list[list[Any]]:
    """Split each value into micro-batches (those named in ``whole`` go whole to each); return one list per micro-batch.

    ``rows(batch, chunks)`` gives the micro-batches' sizes (torchgpipe's drop-in splits as
    ``Tensor.chunk`` does); by default they differ by at most one row (:func:`micro_sizes`).
    """
    batch = batch_size(values, names, whole, agree=chunks > 1)
    sizes = rows(batch, chunks) if rows is not None and batch is not None else None
    m = len(sizes) if sizes is not None else len(micro_sizes(batch, chunks))
    refuse_batched_masks(values, names, whole, m)
    kept = [None if name in whole else value for value, name in zip(values, names)]
    leaves, spec = tree_flatten(kept)
    columns = [(torch.split(leaf, sizes) if sizes is not None else torch.tensor_split(leaf, m)) if is_batched(leaf)
               else [leaf] * m for leaf in leaves]
    mbs = [tree_unflatten([col[i] for col in columns], spec) for i in range(m)]
    for k, name in enumerate(names):
        if name in whole:
            for mb in mbs:
                mb[k] = values[k]
    return mbs


def gather(outputs: Sequence[Any], alike: Collection[int] = ()) -> Any:
    """Concatenate per-micro-batch outputs on dim 0 into one output of the same structure.

    The leaves at positions ``alike`` do not depend on the batch (a learned temperature): the
    first micro-batch's is taken.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise ValueError("micro-batches returned outputs of different structures; the model's "
                             "output structure must not depend on the batch")
    merged = []
    for k, leaf in enumerate(flat[0][0]):
        column = [leaves[k] for leaves, _ in flat]
        if k in alike:
            merged.append(leaf)
        elif isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError("the model returns a 0-dim tensor, which cannot be gathered across "
                                 "micro-batches; return per-sample values (reduce after the "
                                 "pipeline) or use chunks=1")
            merged.append(torch.cat(column))
        else:
            if any(_differs(other, leaf) for other in column[1:]):
                raise ValueError(
                    f"output leaf {k} is a {type(leaf).__name__} that differs between micro-batches "
                    f"({leaf!r} in the first, {next(o for o in column if _differs(o, leaf))!r} in "
                    "another): it depends on the batch, so it cannot be gathered; return it as a "
                    "tensor with a batch dimension, compute it outside the model, or use chunks=1")
            merged.append(leaf)
    return tree_unflatten(merged, spec)


def _differs(a: Any, b: Any) -> bool:
    """Tell whether two non-tensor output leaves differ (values that cannot compare do not)."""
    try:
        return bool(a != b)
    except Exception:  # noqa: BLE001 - an object without a usable comparison
        return a is not b


def summed(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """Return ``loss_fn`` marked as giving each micro-batch's share of the batch's loss, to be added unweighted."""
    def share(out: Any, tgt: Any) -> torch.Tensor:
        return loss_fn(out, tgt)
    vars(share)["fxpipe_summed"] = True
    return share


def is_summed(loss_fn: Callable[[Any, Any], torch.Tensor]) -> bool:
    """Tell whether ``loss_fn`` was marked by :func:`summed`."""
    return bool(getattr(loss_fn, "fxpipe_summed", False))


def check_target_rows(target: Any, batch: int | None, m: int) -> None:
    """Refuse a target whose batched tensors have another number of rows than the inputs, or rows not in tensors.

    Over ``m`` > 1 micro-batches, per-row labels in a list of numbers or a NumPy array would go
    whole to every micro-batch (only tensors are split).
    """
    rows = _rows_not_in_tensors(target, batch) if batch is not None and batch > 1 and m > 1 else None
    if rows is not None:
        raise PipelineInputError(
            f"target{rows} holds {batch} numbers, one per row of the batch, outside a tensor: pipe.step splits "
            "tensors into micro-batches, and anything else goes whole to every micro-batch, where its rows would "
            "not match the micro-batch's. Make it a tensor (torch.as_tensor(...))")
    target_batch = batch_size([target], ["target"], agree=m > 1)
    if batch is not None and target_batch is not None and target_batch != batch and m > 1:  # one micro-batch: whole
        raise PipelineInputError(f"target has {target_batch} rows on dim 0 but the inputs have "
                                 f"{batch}; give the target the inputs' batch size")


def _rows_not_in_tensors(value: Any, batch: int, where: str = "") -> str | None:
    """Return where in ``value`` a list of ``batch`` numbers or a NumPy array of ``batch`` rows is (``""``: itself)."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", ())[:1] == (batch,):
        return f"{where} (a NumPy array)"
    if isinstance(value, (list, tuple)) and len(value) == batch and all(
            isinstance(v, (bool, int, float)) or type(v).__module__ == "numpy" for v in value):
        return f"{where} (a {type(value).__name__})"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _rows_not_in_tensors(item, batch, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def micro_losses(loss_fn: Callable[[Any, Any], torch.Tensor], target: Any, batch: int | None,
                 m: int, device: torch.device, finish: Callable[[Any], Any] = lambda out: out,
                 looked_at: Callable[..., None] | None = None,
                 detach_target: bool = True
                 ) -> dict[int, Callable[[Any], torch.Tensor]]:
    """Return, per micro-batch, a function from its output to its share of the batch loss.

    Micro-batch ``i`` of ``rows_i`` rows contributes ``loss_fn(out_i, target_i) * rows_i / B``,
    so for a mean-reduced loss the sum equals ``loss_fn`` on the whole batch; a ``loss_fn``
    marked :func:`summed` contributes ``loss_fn(out_i, target_i)`` as it is. ``looked_at`` is
    called with each output ``loss_fn`` got, what it returned, the micro-batch's share of the
    rows and ``loss_fn`` on its target. A target that requires grad is
    read through detached leaves, its gradient given back by the result's ``released()``
    (:mod:`fxpipe.runtime.targetgrads`), unless ``detach_target`` is off (one backward of the
    whole step: GPipe's program in one process).
    """
    check_target_rows(target, batch, m)
    sizes = micro_sizes(batch, m) if batch is not None else [0] * m
    targets = scatter([target], ["target"], m)
    if len(targets) == 1:  # no batched tensor in the target (None, a constant): every micro-batch gets it
        targets = targets * m
    target_grads = TargetGrads()  # a target that requires grad: its rows' gradients, given back after the step
    losses: dict[int, Callable[[Any], torch.Tensor]] = Losses(target_grads)
    for i, (tgt, rows) in enumerate(zip(targets, sizes)):
        tgt = to_device(tgt[0], device)
        tgt = target_grads.detach(tgt) if detach_target else tgt
        weight = rows / batch if batch and not is_summed(loss_fn) else 1.0

        share = rows / batch if batch else None  # of the batch's rows

        def loss(out: Any, tgt: Any = tgt, weight: float = weight, share: float | None = share,
                 rows: int = rows, index: int = i) -> torch.Tensor:
            given = finish(out)
            try:
                value = loss_fn(given, tgt)
            except Exception as exc:
                missing = _missing_field(exc, given)
                split = _split_in_target(exc, target, batch, rows)
                if missing is not None:  # the output lacks what loss_fn reads (a loss the model does not compute)
                    add_note(exc, missing)
                elif split is not None:  # class weights as long as the batch, split with the rows
                    add_note(exc, split)
                elif target is None:  # the likely cause: the target was not given where the loss is computed
                    told = ("pipe.step got target=None on the rank computing the loss (the last stage's): pass "
                            "target= there (passing it on every rank is fine), or give a loss_fn that needs none "
                            "(lambda out, _: out.loss)")
                    unset = _holds_none(given)  # a None field of the output may be what loss_fn read instead
                    if "NoneType" in str(exc) and not unset:  # the target is the only None loss_fn got
                        raise PipelineInputError(f"{told}; loss_fn failed on it: {type(exc).__name__}: {exc}") \
                            from exc
                    also = "; or the None is the model's own output's (a field it left unset: out.loss without " \
                           "labels=)" if unset else ""
                    add_note(exc, f"fxpipe: {told}{also}")
                else:  # torch's message names neither the call nor the values: say which
                    add_note(exc, f"fxpipe: raised in loss_fn on micro-batch {index} of {m} ({rows} rows), given "
                                  f"the output {_brief(given)} and the target {_brief(tgt)}")
                raise
            value = _scalar_loss(value, out)
            if looked_at is not None:
                looked_at(given, value, share, partial(loss_again, loss_fn, tgt, rows=rows))
            return value * weight

        losses[i] = loss
    return losses


def _brief(value: Any) -> str:
    """Describe a value for a note: each tensor's shape and dtype, in its structure (cut at 200 characters)."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"tensor{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        return type(v).__name__ if v is not None else "None"
    leaves = tree_flatten_with_path(value)[0]
    text = one(value) if not leaves or leaves[0][0] == () else \
        f"{type(value).__name__} of {', '.join(f'{keystr(k)}: {one(v)}' for k, v in leaves)}"
    return text if len(text) <= 200 else text[:197] + "..."


def loss_again(loss_fn: Callable, target: Any, out: Any, *, rows: int, keep: int | None = None) -> torch.Tensor:
    """Run ``loss_fn`` again on a micro-batch's output and target, or on ``keep`` of their ``rows`` rows (cycled)."""
    if keep is not None:
        def cut(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or not v.dim() or v.shape[0] != rows:
                return v
            return v.index_select(0, torch.arange(keep, device=v.device) % rows)
        out, target = tree_map(cut, out), tree_map(cut, target)
    return loss_fn(out, target)


def _split_in_target(exc: Exception, target: Any, batch: int | None, rows: int) -> str | None:
    """Say which of the target's tensors were split with the rows where ``loss_fn``'s error names the batch's size."""
    if not batch or rows == batch or not re.search(rf"\b({batch}|{rows})\b", str(exc)):
        return None  # the batch's size (classes as many as rows), or the micro-batch's (weights indexed by labels)
    split = [f"target{keystr(path)}" for path, v in tree_flatten_with_path(target)[0]
             if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch]
    if len(split) < 2:  # labels and weights: one tensor alone is the labels
        return None
    return (f"fxpipe: pipe.step splits the target's tensors with the batch's {batch} rows ({', '.join(split)}: "
            f"{rows} rows in this micro-batch); if one of them is not per row (class weights of {batch} classes, "
            "a constant of the loss), give it to loss_fn another way, not in target=: a closure or "
            "functools.partial (lambda out, y: F.cross_entropy(out, y, weight=w))")


def _missing_field(exc: Exception, out: Any) -> str | None:
    """Name what a ``loss_fn`` read that the model's output lacks (``out.loss`` of a model given no labels), or None."""
    if isinstance(exc, AttributeError) and exc.obj is out and hasattr(out, "keys"):
        field = exc.name
    elif isinstance(exc, KeyError) and isinstance(out, dict) and exc.args and isinstance(exc.args[0], str) \
            and exc.args[0] not in out:
        field = exc.args[0]
    else:
        return None
    if field is None:
        return None
    hint = (" A model computes its own loss only when given its labels: pass labels= at compile (example_kwargs=) "
            "and to every pipe.step, or compute the loss from the logits in loss_fn" if field == "loss" else "")
    return (f"fxpipe: the model's output has no {field!r} (it holds {', '.join(map(repr, out.keys()))}), which "
            f"loss_fn reads.{hint}")


def _scalar_loss(value: Any, out: Any) -> torch.Tensor:
    """Return ``value`` if it is one number as a tensor; refuse a per-sample loss, a non-tensor or a cut-off one."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise PipelineInputError(
            "loss_fn returned a loss on meta: it read tensors on meta, such as the parameters of the stages other "
            "ranks hold (an L2 term over model.parameters(): on this rank they are on meta). Regularize through the "
            "optimizer (weight_decay=), or over the parameters this rank holds (p for p in model.parameters() if "
            "not p.is_meta) outside loss_fn, or keep the term inside the model's forward")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and torch.is_grad_enabled() and \
            not (value.is_floating_point() or value.is_complex()):
        raise PipelineInputError(
            f"loss_fn returned a tensor of {str(value.dtype).removeprefix('torch.')}, which has no gradient (a count or "
            "comparison, (out > y).sum(), is not differentiable): return a floating-point loss computed from the "
            "output with differentiable ops (log counts and accuracies from another function)")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        detached = torch.is_grad_enabled() and not value.requires_grad
        trains = detached and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0])
        if detached and not trains:  # a model frozen whole
            raise PipelineInputError(
                "pipe.step trains, but its loss does not require grad: no parameter the model's output or loss_fn "
                "depends on requires grad, and no input does, so backward would reach nothing (eager's "
                "loss.backward() raises 'element 0 of tensors does not require grad'). Unfreeze what should train "
                "(requires_grad_(True)) before fxpipe.compile, or run the model without training with pipe(x) "
                "under torch.no_grad()")
        if trains:
            raise PipelineInputError("loss_fn returned a loss that does not require grad although the model's "
                                     "output does: it was detached (.detach(), .item(), torch.no_grad() or a "
                                     "new tensor), so no gradient would reach the model; compute the loss from "
                                     "the output with differentiable ops (log metrics from another function; a "
                                     "guard for a micro-batch with nothing to count returns out.sum() * 0, not "
                                     "torch.zeros(()))")
        return value
    if not isinstance(value, torch.Tensor):
        parts = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else []
        several = len(parts) > 1 and all(isinstance(v, torch.Tensor) and v.requires_grad for v in parts)
        raise PipelineInputError(f"loss_fn returned a {type(value).__name__}; pipe.step needs the loss alone, "
                                 "one tensor holding the mean over the micro-batch's rows (return metrics "
                                 "from another function" + ("; several losses: return their (weighted) sum, "
                                                            "as loss.backward() on it would train" if several else "")
                                 + ")")
    raise PipelineInputError(f"loss_fn returned a tensor of shape {tuple(value.shape)}; pipe.step needs one "
                             "number per micro-batch, the mean over its rows (it weights each micro-batch by "
                             "its rows to give the batch's mean): reduce it with .mean() or "
                             "reduction='mean', not reduction='none'")


def sum_grads(parts: list[Any]) -> Any:
    """Sum the gradients several readers sent for one value, leaf by leaf (None leaves stay None)."""
    if len(parts) == 1:
        return parts[0]
    flat = [tree_flatten(p) for p in parts]
    leaves = []
    for column in zip(*[f[0] for f in flat]):
        present = [x for x in column if x is not None]
        leaves.append(sum(present[1:], present[0]) if present else None)
    return unflatten(flat[0][1], leaves)


def _holds_none(out: Any) -> bool:
    """Tell whether a model output holds None somewhere (an unset field: ``out.loss`` without labels)."""
    if out is None:
        return True
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return any(_holds_none(getattr(out, f.name, None)) for f in dataclasses.fields(out))
    if isinstance(out, dict):
        return any(_holds_none(v) for v in out.values())
    if isinstance(out, (list, tuple)):
        return any(_holds_none(v) for v in out)
    return False
