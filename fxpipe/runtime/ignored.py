"""Warn when a mean loss's weighting by rows cannot give eager's loss: ignored entries, summed outputs.

``pipe.step`` weights each micro-batch's loss by its share of the rows, which gives the
batch's mean for a loss averaged over rows. A cross-entropy that skips ``ignore_index=-100``
averages over the entries that count instead: when the micro-batches hold different shares of
them (padded rows of several lengths), the weighted means are not the batch's mean, and
nothing else would say so. A model returning its loss as a sum over the rows gives each
micro-batch's sum, which the weighting shrinks by the number of micro-batches; a mean added
under ``loss_reduction="sum"`` grows by it. Checked once per pipe, on the first step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from fxpipe.errors import user_stacklevel
from fxpipe.plan.batches import micro_sizes
from fxpipe.runtime.ignoreindex import IGNORE_INDEX, ignore_index_of
from fxpipe.runtime.microbatch import is_summed
from fxpipe.runtime.stage.lossreplay import kept
from fxpipe.runtime.summedloss import warn_summed_loss_fn

__all__ = ["IGNORE_INDEX", "check_first_loss", "check_targets_once", "look_at_targets", "warn_summed_outputs",
           "warn_uneven_ignored"]

def warn_uneven_ignored(values: dict[str, Any], batch: int | None, m: int, loss_fn: Callable) -> bool:
    """Warn if an integer target in ``values`` counts unequal shares of its entries per micro-batch.

    Return whether the targets were looked at (not for one micro-batch, a summed loss, or a
    step given none: a refused one, which passed them on another rank, leaves them to the next).
    """
    if batch is None or m < 2 or is_summed(loss_fn):
        return False
    sizes = micro_sizes(batch, m)
    ignored: int | None = None  # looked up at the first integer target: a float one has nothing to ignore
    seen = False
    leaves = [(name + keystr(path), v) for name, value in values.items()
              for path, v in tree_flatten_with_path(value)[0]]  # a target dict's or tuple's labels too
    for name, value in leaves:
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() < 1 \
                or value.shape[0] != batch or value.dtype == torch.bool:
            continue
        seen = True
        ignored = ignore_index_of(loss_fn) if ignored is None else ignored
        counted = (value != ignored).reshape(batch, -1).sum(1)
        shares = [float(part.sum()) / (part.numel() * value[0].numel()) for part in counted.split(sizes)]
        if max(shares) - min(shares) < 1e-9:  # every micro-batch's mean weighs as its rows: eager's mean
            continue
        empty = (" A micro-batch with no entry counted gives a mean over nothing, NaN: the step's loss is NaN "
                 "where eager's is not." if min(shares) == 0 else "")
        warnings.warn(
            f"{name} marks entries {ignored} (ignore_index) in unequal shares of the micro-batches "
            f"({_span(min(shares), max(shares))} of each micro-batch's entries count): a loss_fn averaging over "
            "the entries that count gives each micro-batch's mean, which pipe.step weights by rows, so the step's "
            f"loss and gradients differ from eager's.{empty} Pass loss_reduction='sum' with a loss_fn dividing a "
            "sum by the whole batch's count (docs/guide/using-it.md, 'What loss_fn receives'); ignore this if "
            f"{ignored} is a class your loss counts (said once per pipe)", stacklevel=user_stacklevel())
        break
    return seen


def _span(low: float, high: float) -> str:
    """Write two shares as percents with the fewest decimals (up to 4) that tell them apart."""
    for digits in range(5):
        a, b = f"{low:.{digits}%}", f"{high:.{digits}%}"
        if a != b:
            break
    return f"{a} to {b}"


def warn_summed_outputs(summed: list[str], means: list[str], m: int, loss_fn: Callable,
                        coupled: list[str] | None = None) -> None:
    """Warn of 0-dim sums over the rows under a mean ``loss_fn``, and of means (or coupled values) under a summed one."""
    if coupled and m > 1 and is_summed(loss_fn):
        warnings.warn(
            f"the model returns {', '.join(coupled)}: a 0-dim value that is not a sum over the rows (a mean or "
            "load-balancing term in it: a mixture of experts' auxiliary loss added to its token loss), which loss_fn "
            f"returns or adds. With loss_reduction='sum' pipe.step adds the micro-batches' losses as loss_fn returns "
            f"them, so that term counts once per micro-batch, {m}x its scale in eager. Compute the loss in loss_fn "
            "instead: the token loss from the logits (a sum divided by the whole batch's count) plus the auxiliary "
            "term scaled by the micro-batch's share of the rows (aux * rows / batch), or use chunks=1 (said once per "
            "pipe)", stacklevel=user_stacklevel())
        return
    if means and m > 1 and is_summed(loss_fn) and not summed:
        warnings.warn(
            f"the model returns {', '.join(means)}: a mean over the rows, which loss_fn returns. With "
            f"loss_reduction='sum' pipe.step adds the micro-batches' losses as loss_fn returns them, so a loss_fn "
            f"returning that mean gives {m}x eager's loss and gradients (for even micro-batches). Leave "
            "loss_reduction at 'mean' for it; 'sum' is for a loss_fn returning its micro-batch's share of the "
            "batch's loss (a sum divided by the whole batch's count). A model that ignores num_items_in_batch= (T5, "
            "an encoder-decoder) returns such a mean (said once per pipe)", stacklevel=user_stacklevel())
    if summed and m > 1 and not is_summed(loss_fn):
        warnings.warn(
            f"the model returns {', '.join(summed)}: a sum over the rows, which loss_fn's loss is or adds. pipe.step "
            "weights each micro-batch's loss by its share of the rows (a mean's weighting), so that sum counts "
            f"1/{m} of what it does in eager, in the loss and the gradients (for even micro-batches). Pass "
            "loss_reduction='sum' to add the micro-batches' losses as loss_fn returns them (a loss_fn adding a mean "
            "to that sum then scales the mean by its micro-batch's share of the batch's rows) (said once per pipe)",
            stacklevel=user_stacklevel())


def check_targets_once(binding: Any, target: Any, kwargs: dict, batch: int | None, m: int, loss_fn: Callable) -> None:
    """Look at the step's target and ``labels=`` input until one step of a mean loss was looked at (per pipe).

    The first step also arms :func:`check_first_loss`, which warns of outputs that sum over the
    rows under a mean ``loss_fn``, and that average over them under a summed one, if ``loss_fn``
    returns one of them (:func:`warn_summed_outputs`).
    """
    if not binding.summed_checked:
        binding.summed_checked = True
        binding.summed_pending = (m, loss_fn)
    look_at_targets(binding, {"target": target, "labels": kwargs.get("labels")}, batch, m, loss_fn)


def look_at_targets(binding: Any, values: dict[str, Any], batch: int | None, m: int, loss_fn: Callable) -> None:
    """Warn of ``values`` marking -100 in unequal shares (:func:`warn_uneven_ignored`) until a step had some."""
    if not binding.targets_checked:
        binding.targets_checked = warn_uneven_ignored(values, batch, m, loss_fn)


def check_first_loss(binding: Any, out: Any, loss: torch.Tensor, share: float | None = None,
                     again: Callable[[Any], torch.Tensor] | None = None) -> None:
    """On the first micro-batch's loss of a pipe, warn if it is the model's own 0-dim sum or mean (once).

    ``share`` is the micro-batch's share of the batch's rows and ``again`` its ``loss_fn``: a
    coupled term ``loss_fn`` scales by that share (the warning's own recipe) is not warned of.
    """
    if binding.summed_pending is None:
        return
    m, loss_fn = binding.summed_pending
    scalars = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() == 0 and
               t.is_floating_point()]
    returned = any(t is loss or (t.shape == loss.shape and bool(torch.equal(t.detach(), loss.detach())))
                   for t in scalars)
    if not returned and scalars and not torch.is_grad_enabled():
        return  # a checkpointed forward keeps no graph to look into: look at its recomputation's
    binding.summed_pending = None
    if not is_summed(loss_fn):
        warn_summed_loss_fn(loss_fn, out, again, m)
    # a loss computed from the logits (a sum over a count) is the user's own: nothing to say; one made
    # of the model's 0-dim output (a task loss plus the model's auxiliary sum) is weighted as that output
    if returned or _made_of(loss, scalars):
        coupled, means = binding.coupled_scalars, binding.means
        if (coupled or means) and not returned and share is not None and again is not None and \
                _scaled_by(out, scalars, share, again):
            coupled, means = None, []  # c * aux * rows / batch: each micro-batch's term is its share, as eager's
        warn_summed_outputs(binding.summed, means, m, loss_fn, coupled)


def _scaled_by(out: Any, parts: list[torch.Tensor], share: float, again: Callable[..., torch.Tensor]) -> bool:
    """Tell whether ``again(out)`` takes each of ``parts`` it reads times ``share`` (or a constant times it).

    A coefficient (``0.01 * aux * rows / batch``) is told by the weights following the rows: run
    again on half of the rows (two, for one), each weight must change as the rows do.
    """
    whole = _weights(out, parts, again)
    if not whole:
        return False
    if all(abs(w - share) <= 1e-6 * share for w in whole):
        return True
    rows = getattr(again, "keywords", {}).get("rows")  # microbatch.loss_again's: it can cut the rows
    if not isinstance(rows, int) or rows < 1 or any(w == 0 for w in whole):
        return False
    keep = rows // 2 if rows > 1 else 2
    half = _weights(out, parts, partial(again, keep=keep))
    return len(half) == len(whole) and all(abs(h / w - keep / rows) <= 1e-6 for h, w in zip(half, whole))


def _weights(out: Any, parts: list[torch.Tensor], again: Callable[[Any], torch.Tensor]) -> list[float]:
    """Return the weight ``again(out)`` gives each of ``parts`` it reads (run on copied stand-ins; [] if it fails).

    Copies, not views: a loss_fn changing the outputs in place (``logits.div_(2)``) changes its
    own stand-ins; the random state, its own generators and its modules' buffers are put back
    after (a loss_fn drawing noise, a discriminator's batch norm or spectral norm).
    """
    stand = {id(t): t.detach().clone().requires_grad_() for t in parts}
    given = tree_map(lambda v: stand.get(id(v), v.detach().clone()) if isinstance(v, torch.Tensor) else v, out)
    devices = sorted({t.device.index or 0 for t in parts if t.device.type == "cuda"})
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices), kept(again):
            value = again(given)
            grads = torch.autograd.grad(value, list(stand.values()), allow_unused=True)
    except Exception:  # noqa: BLE001 - a loss_fn that cannot run so: say what the warning says
        return []
    return [float(g) for g in grads if g is not None]


def _made_of(loss: torch.Tensor, parts: list[torch.Tensor], limit: int = 100_000) -> bool:
    """Tell whether ``loss``'s autograd graph reaches one of ``parts`` (looked at once per pipe, bounded).

    By edge, (node, output number): a stage's outputs may all come out of one node (a
    checkpointed stage's), of which the logits a loss reads are not the 0-dim output beside them;
    a leaf (a stage's input returned as it came) by the edge to its gradient's accumulator.
    """
    goals: set[tuple[Any, int]] = {(t.grad_fn, t.output_nr) for t in parts if t.grad_fn is not None}
    with torch.enable_grad():  # a leaf (a stage's input returned as is) is reached by its gradient's accumulator
        for t in parts:
            alias = t.view_as(t) if t.grad_fn is None and t.requires_grad else None
            if alias is not None and alias.grad_fn is not None:
                goals.add(alias.grad_fn.next_functions[0])
    if not goals or loss.grad_fn is None:
        return False
    if (loss.grad_fn, loss.output_nr) in goals:
        return True
    todo: list[Any] = [loss.grad_fn]
    seen: set[Any] = set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for edge in node.next_functions:
            if edge in goals:
                return True
            if edge[0] is not None:
                todo.append(edge[0])
    return False
