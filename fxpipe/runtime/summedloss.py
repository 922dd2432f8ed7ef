"""Tell a ``loss_fn`` that sums over the rows from one that averages, by how it weighs one row.

``pipe.step`` weights each micro-batch's loss by its share of the rows (a mean's weighting).
A ``loss_fn`` summing over the rows (``reduction="sum"``) then gives 1/m of eager's loss and
gradients, and nothing fails. Its gradient tells it: a row's gradient under a sum is the same
whether the loss sees all of the micro-batch's rows or half of them; under a mean it doubles::

    rows 0..n-1      loss_fn ──▶ d loss / d out[0] = g
    rows 0..n/2-1    loss_fn ──▶ d loss / d out[0] = g (a sum)  or  2g (a mean)

Looked at once per pipe, on the first micro-batch's loss, on copies of the outputs, for a
``loss_fn`` that asks for ``reduction="sum"`` (other ``loss_fn`` are not run again for it).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.errors import user_stacklevel
from fxpipe.runtime.ignoreindex import code_of, passes_keyword
from fxpipe.runtime.stage.lossreplay import kept
from fxpipe.runtime.stage.rng import held

__all__ = ["asks_for_sum", "sums_rows", "warn_summed_loss_fn"]


def warn_summed_loss_fn(loss_fn: Callable, out: Any, again: Callable[..., torch.Tensor] | None, m: int) -> None:
    """Warn, under the mean weighting of ``m`` > 1 micro-batches, if ``loss_fn`` (run as ``again``) sums over the rows.

    Only a ``loss_fn`` asking for ``reduction="sum"`` (:func:`asks_for_sum`) is run again to tell.
    """
    if m < 2 or again is None or not asks_for_sum(loss_fn) or not sums_rows(out, again):
        return
    warnings.warn(
        "loss_fn sums over the rows (reduction='sum', or a sum divided by a constant: it weighs a row alike over "
        "a micro-batch's rows and over half of them), but pipe.step weights each micro-batch's loss by its share of "
        f"the rows, which is right for a mean only: the step's loss and gradients come out about 1/{m} of eager's. "
        "Pass pipe.step(..., loss_reduction='sum') to add the micro-batches' losses as loss_fn returns them, or "
        "reduce with the mean (said once per pipe)", stacklevel=user_stacklevel())


def asks_for_sum(loss_fn: Callable) -> bool:
    """Tell whether ``loss_fn`` asks for ``reduction="sum"``: a loss module's field, a partial's keyword, or its code's."""
    if any(getattr(sub, "reduction", None) == "sum" for m in held(loss_fn, nn.Module) for sub in m.modules()):
        return True
    if getattr(loss_fn, "reduction", None) == "sum" or any(
            f.keywords.get("reduction") == "sum" for f in held(loss_fn, partial)):
        return True
    for f, _ in code_of(loss_fn):
        if passes_keyword(f.__code__, "reduction") and _holds(f.__code__, "sum"):
            return True
        named = [f.__globals__.get(n) for n in f.__code__.co_names]  # a criterion made at module level
        if any(isinstance(g, nn.Module) and getattr(g, "reduction", None) == "sum" for g in named):
            return True
    return False


def _holds(code: types.CodeType, constant: str) -> bool:
    """Tell whether ``code`` (or a function defined in it) holds the string ``constant``."""
    return any(c == constant or isinstance(c, types.CodeType) and _holds(c, constant) for c in code.co_consts)


def sums_rows(out: Any, again: Callable[..., torch.Tensor]) -> bool:
    """Tell whether ``again(out)`` weighs the first row's output the same over all its rows and over half of them.

    ``again`` takes ``keep=`` (:func:`fxpipe.runtime.microbatch.loss_again`); its ``rows`` keyword
    is the micro-batch's (one row is taken twice instead of halved). False where it cannot tell:
    no output with rows that the loss reads, a loss coupling the rows, or a ``loss_fn`` that
    fails on half of them.
    """
    rows = getattr(again, "keywords", {}).get("rows")
    if not isinstance(rows, int) or rows < 1:
        return False
    whole = _first_row_grad(out, again, rows)
    # half of the rows; one row is taken twice instead (loss_again cycles them): a sum's weight then doubles
    half = _first_row_grad(out, partial(again, keep=rows // 2 if rows > 1 else 2), rows)
    if whole is None or half is None or whole == 0:
        return False
    summed = 1.0 if rows > 1 else 2.0  # a mean's ratio is rows / (rows // 2) >= 2, or 1 for one row taken twice
    return abs(half / whole - summed) <= 1e-3 * summed


def _first_row_grad(out: Any, again: Callable[..., torch.Tensor], rows: int) -> float | None:
    """Return the norm of ``again``'s gradient at the first row of the outputs with ``rows`` rows (None: none)."""
    stand: dict[int, torch.Tensor] = {}

    def copy(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        c = v.detach().clone()
        if c.is_floating_point() and c.dim() and c.shape[0] == rows:
            c.requires_grad_()
            stand[id(v)] = c
        return c

    given = tree_map(copy, out)
    if not stand:
        return None
    devices = sorted({t.device.index or 0 for t in stand.values() if t.device.type == "cuda"})
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices), kept(again):
            value = again(given)
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                return None
            grads = torch.autograd.grad(value.reshape(()), list(stand.values()), allow_unused=True)
    except Exception:  # noqa: BLE001 - a loss_fn that cannot run so: nothing to tell
        return None
    found = [g[0].double().norm() for g in grads if g is not None]
    return float(torch.stack(found).norm()) if found else None
