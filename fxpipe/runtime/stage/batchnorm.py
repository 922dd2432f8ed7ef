"""Deferred batch norm: running statistics updated once per mini-batch, not per micro-batch.

In training, batch norm normalizes each micro-batch by that micro-batch's statistics, and by
default also updates its running mean and variance once per micro-batch, which weights them
differently from eager training on the whole batch. With ``deferred_batch_norm=True`` each
batch norm keeps normalizing per micro-batch but only accumulates ``sum(x)`` and
``sum(x * x)`` per channel; after the mini-batch the pipeline commits them once, so the
running statistics equal eager's on the full batch (torchgpipe, section 3.4) for a batch norm
whose inputs no earlier batch norm normalized per micro-batch; later ones get the statistics
of the inputs they saw over the mini-batch. A module called more than once per forward gets an
update per call, in the calls' order (:mod:`fxpipe.runtime.stage.normcalls`). Exported graphs
hold ``aten.batch_norm`` calls instead of modules: :mod:`fxpipe.runtime.stage.exportedbn`
defers those (a record per call). Recomputation
for checkpointing does not count twice, and neither does a run on fake tensors (the distributed
runtime propagates each new micro-batch layout's shapes through the graph).

Inside a compiled stage (``torch_compile=``) the forward cannot read whether it recomputes without
a graph break (and torch.compile would compile the code after that break once per batch norm, up
to its recompile limit). There each batch norm adds its sums into a staging tensor inside the
graph, unconditionally; the compiled stage puts the staging tensors back as they were after a
recomputation (:func:`unstaged`), and the commit folds them into the sums.

The modules keep their class, their identity and their state_dict keys: the deferred forward
is an instance attribute, and the sums are plain attributes. It defers only while its pipe runs
(:func:`pipe_running`, around a step or ``pipe(x)``): the user's own call of the model, or of
a copy of it, or of it inside another pipe's step, updates the running statistics as PyTorch's
batch norm does, and adds nothing to the pipe's next update.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.runtime.stage.normcalls import Call, slot
from fxpipe.runtime.stage.recompute import is_recomputing

__all__ = ["accumulate", "commit_batch_norm", "defer_batch_norm", "discard_batch_norm", "fold_staged", "pipe_running",
           "staging", "unstaged"]

_RUNNING: set[int] = set()  # the deferred batch norms whose pipe runs a step or forward (its worker threads too)


@contextmanager
def pipe_running(deferred: Iterable[object]) -> Iterator[None]:
    """Run the block as a step or forward of the pipe whose deferred batch norms are ``deferred``: they defer.

    Only that pipe's: another model's deferred batch norm called inside it (a GAN's discriminator,
    compiled with deferral, called eagerly in the generator's ``loss_fn``) stays PyTorch's.
    """
    mine = {id(bn) for bn in deferred} - _RUNNING
    _RUNNING.update(mine)
    try:
        yield
    finally:
        _RUNNING.difference_update(mine)


def _outside(bn: _BatchNorm) -> bool:
    """Tell whether ``bn`` runs outside its pipe (a call of the model itself): then it is PyTorch's."""
    return id(bn) not in _RUNNING and not vars(bn).get("_fxpipe_always", False)


class _Sums(Protocol):
    """The plain attributes a deferred batch norm accumulates into."""

    _fxpipe_sum: torch.Tensor | None
    _fxpipe_sum_squares: torch.Tensor | None
    _fxpipe_count: int
    _fxpipe_staged: torch.Tensor | None  # compiled stages: rows sum, sum of squares, count (in every column)


def _sums(bn: object) -> _Sums:
    """View a batch norm's (or an exported graph's record's) accumulated sums as typed attributes."""
    return cast(_Sums, bn)


def defer_batch_norm(modules: Iterable[nn.Module]) -> list[_BatchNorm]:
    """Make every batch norm among ``modules`` defer its running-statistics update; return them.

    A subclass with its own ``forward`` (timm's ``BatchNormAct2d``: batch norm, then its
    activation) keeps it: :func:`_own_forward` runs it on scratch running statistics. A norm an
    earlier pipe of the same model deferred (a model compiled again) is deferred by this one too.
    """
    deferred = []
    for bn in modules:
        if not (isinstance(bn, _BatchNorm) and bn.track_running_stats):
            continue
        patched = getattr(bn.__dict__.get("forward"), "__func__", None)
        if patched in (_own_forward, _deferred_forward):  # deferred by an earlier pipe of the same model
            deferred.append(bn)
        elif "forward" not in bn.__dict__:
            own = type(bn).forward is not _BatchNorm.forward
            bn.__dict__["forward"] = types.MethodType(_own_forward if own else _deferred_forward, bn)
            _reset(bn)
            deferred.append(bn)
    return deferred


def _own_forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """Run a subclass's own forward with scratch running statistics; accumulate what its batch norm saw.

    With momentum 1 the scratch statistics come out as the micro-batch's mean and unbiased
    variance (through ``F.batch_norm`` or ``torch.batch_norm``), which give its sums; the real
    ones and ``num_batches_tracked`` stay as they were.
    """
    forward = type(self).forward
    if not self.training or _outside(self):
        return forward(self, x)
    if torch.compiler.is_compiling():
        raise TypeError(f"deferred_batch_norm=True cannot defer {type(self).__name__} inside a compiled stage: a "
                        "batch norm subclass with its own forward runs on scratch statistics there. Leave out "
                        "torch_compile=, or deferred_batch_norm=")
    if x.dim() < 2 or x.shape[1] != self.num_features:
        raise TypeError(f"deferred_batch_norm=True cannot defer {type(self).__name__}: its own forward takes an "
                        f"input of shape {tuple(x.shape)}, not channels on dim 1, so the rows its batch norm "
                        "normalizes are unknown; leave out deferred_batch_norm=")
    real = self.running_mean, self.running_var, self.num_batches_tracked, self.momentum
    assert real[0] is not None and real[1] is not None  # deferred batch norms track running statistics
    unset = torch.finfo(real[0].dtype).max  # momentum 1 replaces it exactly (0 x max is 0)
    mean, var = torch.full_like(real[0], unset), torch.full_like(real[1], unset)
    self.running_mean, self.running_var, self.momentum = mean, var, 1.0
    counter = None if real[2] is None else real[2].clone()
    self.num_batches_tracked = counter
    try:
        out = forward(self, x)
    finally:
        self.running_mean, self.running_var, self.num_batches_tracked, self.momentum = real
    if counter is not None and "_fxpipe_counts" not in vars(self):  # the commit counts where its forward does
        vars(self)["_fxpipe_counts"] = bool(counter != real[2])
    if "_fxpipe_checked" not in vars(self):  # once (a sync): its forward ran the update as asked
        untouched, own = torch.stack([(mean == unset).all(), (mean.abs() > unset / 2).any()]).tolist()
        if untouched:  # it did not update running statistics (this time)
            return out
        if own:
            raise TypeError(f"deferred_batch_norm=True cannot defer {type(self).__name__}: its own forward updates "
                            "the running statistics with a momentum of its own, not self.momentum, so what it "
                            "saw cannot be read back; leave out deferred_batch_norm=")
        vars(self)["_fxpipe_checked"] = True
    if not is_recomputing() and not isinstance(x, FakeTensor):
        rows = x.numel() // self.num_features
        with torch.no_grad():
            mean, var = mean.double(), var.double() * (rows - 1) / rows  # unbiased back to biased
            _add(self, mean * rows, (var + mean * mean) * rows, rows)
    return out


def _reset(bn: _BatchNorm) -> None:
    """Clear a batch norm's accumulated sums."""
    sums = _sums(bn)
    sums._fxpipe_sum = None
    sums._fxpipe_sum_squares = None
    sums._fxpipe_count = 0
    staged = vars(bn).get("_fxpipe_staged")
    if staged is not None:
        staged.zero_()


def _deferred_forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """Normalize by the micro-batch's statistics; accumulate them instead of updating."""
    if not torch.compiler.is_compiling() and _outside(self):  # a compiled stage runs only in its pipe
        return type(self).forward(self, x)
    self._check_input_dim(x)
    if not self.training:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            False, 0.0, self.eps)
    if torch.compiler.is_compiling():
        _stage(self, x)
    else:
        accumulate(self, x)
    return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


def accumulate(bn: object, x: torch.Tensor) -> None:
    """Add a micro-batch's per-channel sums to ``bn``'s (not when recomputing, nor on fake tensors)."""
    if is_recomputing() or isinstance(x, FakeTensor):
        return
    with torch.no_grad():
        _add(bn, *_channel_sums(x))


def _add(bn: object, total: torch.Tensor, squares: torch.Tensor, rows: int) -> None:
    """Add per-channel sums of ``rows`` rows to ``bn``'s (or this call's, for a module called more than once)."""
    sums = _sums(slot(bn))
    if sums._fxpipe_sum is None or sums._fxpipe_sum_squares is None:
        sums._fxpipe_sum, sums._fxpipe_sum_squares = total, squares
    else:
        sums._fxpipe_sum += total
        sums._fxpipe_sum_squares += squares
    sums._fxpipe_count += rows


def _stage(bn: _BatchNorm, x: torch.Tensor) -> None:
    """Inside a compiled graph: add a micro-batch's sums to the staging tensor, recomputation or not."""
    staged = vars(bn).get("_fxpipe_staged")
    if staged is None:
        raise RuntimeError("a deferred batch norm ran inside torch.compile without its staging tensor; "
                           "compile the stage through fxpipe.compile(..., torch_compile=)")
    with torch.no_grad():
        total, squares, rows = _channel_sums(x)
        staged.add_(torch.stack([total, squares, torch.full_like(total, rows)]))


def _channel_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return ``x``'s per-channel sum and sum of squares (float64) and rows.

    Squaring ``x`` itself in its own dtype rounds each square to the size of the mean's: with a
    mean large against the spread (activations around 3e4 with a spread of 1) the variance taken
    from them came out wrong, even negative (-2e12 for a channel of torchvision's mnasnet0_5).
    The squares are of the deviations from the micro-batch's mean instead, then shifted back in
    float64: ``sum x^2 = sum d^2 + 2 c sum d + rows c^2`` with ``d = x - c``.
    """
    dims = [d for d in range(x.dim()) if d != 1]
    rows = x.numel() // x.shape[1]
    total = x.sum(dims, dtype=torch.float64)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    shape = [1] * x.dim()
    shape[1] = x.shape[1]
    centre = (total / rows).to(wide.dtype)
    d = wide - centre.view(shape)
    c = centre.to(torch.float64)
    squares = (d * d).sum(dims, dtype=torch.float64) + 2 * c * d.sum(dims, dtype=torch.float64) + rows * c * c
    return total, squares, rows


def staging(modules: Iterable[nn.Module]) -> list[_BatchNorm]:
    """Give each deferred batch norm among ``modules`` a staging tensor for compiled stages; return them."""
    found = []
    for bn in modules:
        if isinstance(bn, _BatchNorm) and "_fxpipe_count" in vars(bn):
            if vars(bn).get("_fxpipe_staged") is None:
                assert bn.running_mean is not None  # deferred batch norms track running statistics
                vars(bn)["_fxpipe_staged"] = torch.zeros(3, bn.num_features, dtype=torch.float64,
                                                         device=bn.running_mean.device)
            found.append(bn)
    return found


@contextmanager
def unstaged(modules: list[_BatchNorm], drop: bool) -> Iterator[None]:
    """Run the block; if ``drop`` (a recomputation), put the staging tensors back as they were before it."""
    before = [vars(bn)["_fxpipe_staged"].clone() for bn in modules] if drop else []
    yield
    for bn, staged in zip(modules, before):
        vars(bn)["_fxpipe_staged"].copy_(staged)


def fold_staged(modules: Iterable[_BatchNorm]) -> None:
    """Add what compiled stages staged into each batch norm's sums, and clear the staging tensors."""
    for bn in modules:
        staged = vars(bn).get("_fxpipe_staged")
        if staged is None:
            continue
        n = int(staged[2, 0].item())
        if n:
            sums = _sums(bn)
            if sums._fxpipe_sum is None or sums._fxpipe_sum_squares is None:
                sums._fxpipe_sum, sums._fxpipe_sum_squares = staged[0].clone(), staged[1].clone()
            else:
                sums._fxpipe_sum += staged[0]
                sums._fxpipe_sum_squares += staged[1]
            sums._fxpipe_count += n
            staged.zero_()


def discard_batch_norm(modules: Iterable[_BatchNorm]) -> None:
    """Drop the sums a failed step accumulated: the running statistics stay as they were."""
    for bn in modules:
        _reset(bn)


def commit_batch_norm(modules: Iterable[_BatchNorm]) -> None:
    """Update each deferred batch norm's running statistics once from its accumulated sums."""
    modules = list(modules)
    fold_staged(modules)
    with torch.no_grad():
        for bn in modules:
            sums = _sums(bn)
            n = sums._fxpipe_count
            if n == 0:
                continue
            # deferred batch norms track running stats, and a count above 0 means both sums are set
            assert sums._fxpipe_sum is not None and sums._fxpipe_sum_squares is not None
            assert bn.running_mean is not None and bn.running_var is not None
            mean = sums._fxpipe_sum / n
            var = (sums._fxpipe_sum_squares / n - mean ** 2) * (n / max(n - 1, 1))  # unbiased, as eager
            owner = bn.bn if isinstance(bn, Call) else bn  # a further call counts where its module's forward does
            counter = bn.num_batches_tracked if vars(owner).get("_fxpipe_counts", True) else None  # None: not counted
            if counter is not None:
                counter.add_(1)
            momentum = bn.momentum
            if momentum is None:  # cumulative moving average
                momentum = 1.0 / float(counter) if counter is not None else 1.0
            bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)
            bn.running_var.mul_(1 - momentum).add_(var.to(bn.running_var.dtype), alpha=momentum)
            _reset(bn)
