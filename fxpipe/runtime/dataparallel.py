"""Data parallel across pipeline replicas: reduce each stage's gradients once per step.

Every replica runs the same stages on its own share of the batch; the ranks holding the
same stage average its gradients over their data-parallel group, with PyTorch's own
engines:

- replicate (default): :class:`~torch.nn.parallel.DistributedDataParallel` on each stage
  module. Its forward is never called; the micro-batches' backwards accumulate into
  ``.grad`` with its reducer idle, and before a stage's last backward of the step the
  reducer is armed (``prepare_for_backward``, as DDP's own forward does), so that backward
  all-reduces the accumulated gradients in buckets as they become ready, overlapped with
  the rest of it.
- shard (``data_parallel_shard=True``): FSDP2 (``fully_shard``) on each stage module, its
  parameters gathered for the step (``reshard_after_forward=False``), gradient sync off for
  every backward but the stage's last, which reduce-scatters.

- tensor parallel and replicate: the parameters are DTensors, which DDP does not take; each
  step's local gradients (shards) are all-reduced over the replicas once the step's backwards
  are done (:meth:`GradSync.reduce`), flattened per dtype into one all-reduce. FSDP2 shards
  DTensors as torchtitan does (``fully_shard`` after ``parallelize_module``, over ``mesh["dp"]``).
- replicate, a stage with parameters a loss may not reach (only outputs it can ignore depend on
  them, :func:`fxpipe.passes.maybe_without_grad`): reduced after the step the same way, where
  DDP's reducer would wait for their gradients. The replicas first agree which gradients exist:
  one a replica's loss did not reach counts as zeros where another's did, and stays None only
  where no replica's did.

Either way a stage's last backward must see every weight gradient, so a schedule with
``W`` steps has that stage's other ``W`` run before it and computes its own weights in it
(:func:`final_backwards`). ``pipe.no_sync()`` turns reduction off for gradient
accumulation over several steps.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.plan.stages import user_leaf
from fxpipe.runtime.placement import register_everywhere
from fxpipe.runtime.schedules.finals import final_backwards

__all__ = ["GradSync", "final_backwards", "keep_every_gradient", "views_sent_only"]


class GradSync:
    """Reduce the gradients of this rank's stage modules over its data-parallel group."""

    def __init__(self, modules: Mapping[int, nn.Module], layout: Any, shard: bool,
                 share_with: Sequence[nn.Module] = (), after_step: Collection[int] = ()) -> None:
        self.shard = shard
        self.sync = True  # off inside pipe.no_sync()
        self.group = layout.dp_group
        self.replicas = layout.dp
        self.after: list[torch.Tensor] = []  # tensor parallel, replicated: reduced after the step
        self.wrapped: dict[int, Any] = {}
        self.swapped: dict[int, nn.Parameter] = {}  # id of a parameter FSDP2 replaced -> its replacement
        self.layout = layout
        self.modules = dict(modules)
        self.trainable = {j: _trainable(m) for j, m in modules.items()}  # what each wrapper was built for
        self.stepped = False  # a backward ran: FSDP2 has gathered the parameters (in their dtype then)
        # stages with parameters the loss may not reach: DDP's reducer would wait for their gradients
        self.manual = {j for j in after_step if not shard}
        for j, module in modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue  # nothing to reduce
            if self._after_step(j):
                known = {id(p) for p in self.after}
                self.after += [p for p in module.parameters() if p.requires_grad and id(p) not in known]
            elif shard:
                from torch.distributed.fsdp import fully_shard

                assert layout.mesh is not None
                before = dict(module.named_parameters(remove_duplicate=False))
                scalar = [k for k, p in before.items() if p.dim() == 0]
                if scalar:
                    from fxpipe.errors import CompileError
                    raise CompileError(f"data_parallel_shard=True shards every parameter on dim 0, and {scalar[0]!r} "
                                       "is 0-dim (FSDP2 refuses it): make it a 1-element tensor in the model "
                                       "(nn.Parameter(torch.full((1,), value))), or use data_parallel_shard=False")
                if j in after_step:  # a leaf of the user's may skip parameters by the data: give them zeros
                    keep_every_gradient(module)
                self.wrapped[j] = fully_shard(module, mesh=layout.mesh["dp"], reshard_after_forward=False)
                swapped = {id(before[k]): p for k, p in module.named_parameters(remove_duplicate=False)}
                register_everywhere(share_with, swapped)
                self.swapped.update(swapped)
            else:
                self.wrapped[j] = self._ddp(module)

    def _ddp(self, module: nn.Module) -> Any:
        """Wrap ``module`` in DDP over the replicas (its reducer takes the parameters requiring grad now)."""
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.layout.device.index] if self.layout.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, process_group=self.layout.dp_group)

    def refresh(self) -> None:
        """Follow parameters frozen, unfrozen or cast since the stages were wrapped, before a step.

        DDP's reducer waits for the gradients of the parameters that required grad when it was
        built: one frozen since never comes, so the others were left unaveraged and the next step
        failed inside DDP. Such a stage is wrapped again (every replica freezes at the same step,
        as it runs the same script); one frozen whole needs no reduction. FSDP2 takes a frozen
        parameter as it comes, but a stage with none trainable when compiled was never sharded.
        """
        from fxpipe.errors import PipelineInputError

        for j, module in self.modules.items():
            now = _trainable(module)
            if now == self.trainable[j]:
                continue
            if self._after_step(j):
                known = {id(p) for p in self.after}
                self.after += [p for p in module.parameters() if p.requires_grad and id(p) not in known]
            elif self.shard and j in self.wrapped and self.stepped and _dtypes(now) != _dtypes(self.trainable[j]):
                raise PipelineInputError(
                    f"stage {j}'s parameters changed dtype since its first step ({_dtypes(self.trainable[j])[0]} -> "
                    f"{_dtypes(now)[0]}: a model cast after compile), after FSDP2 (data_parallel_shard=True) had "
                    "gathered them in the old one; cast the model before fxpipe.compile (with example inputs of "
                    "that dtype), keep its dtype and use torch.autocast, or use data_parallel_shard=False (DDP)")
            elif self.shard and j not in self.wrapped and _any_trainable(now):
                raise PipelineInputError(
                    f"stage {j} had no parameter requiring grad when the pipe was compiled, so FSDP2 did not shard "
                    "it and its gradients would not be reduced over the replicas; unfreezing it is refused. Compile "
                    "with the parameters requiring grad (leave them out of the optimizer until they train), or "
                    "build a new pipe after unfreezing (fxpipe.save, fxpipe.compile, fxpipe.load)")
            elif not self.shard:  # frozen, unfrozen or cast (model.double()): a new reducer
                self.wrapped.pop(j, None)  # its reducer goes with it
                if _any_trainable(now):
                    self.wrapped[j] = self._ddp(module)
            self.trainable[j] = now

    def _after_step(self, j: int) -> bool:
        """Tell whether stage ``j``'s gradients are reduced after the step (:meth:`reduce`), not by DDP or FSDP2."""
        return (self.layout.tp > 1 and not self.shard) or j in self.manual

    def before_backward(self, j: int, final: bool) -> None:
        """Arm or hold stage ``j``'s reduction for the coming backward (``final``: its last of the step)."""
        wrapped = self.wrapped.get(j)
        if wrapped is None:
            return
        reduce = final and self.sync
        self.stepped = True
        if self.shard:  # the step's last backward reshards under no_sync too: a call ends with the sharded
            wrapped.set_requires_gradient_sync(reduce)  # parameters on the modules, as the model holds them (kept
            wrapped.set_is_last_backward(reduce)  # gathered, a parameter the model's root holds read its shard)
            wrapped.set_reshard_after_backward(final)
        elif reduce:
            wrapped.reducer.prepare_for_backward([])

    def reshard(self) -> None:
        """Put FSDP2's sharded parameters (the optimizer's) back on the stages after a call with no last backward.

        With ``reshard_after_forward=False`` only a stage's last backward reshards: after
        ``pipe(x)`` (or a failed step) the modules would keep the gathered full parameters, which
        ``pipe.parameters()``, ``state_dict()`` and ``fxpipe.save(..., optimizer=)`` then read.
        """
        if self.shard:
            for wrapped in self.wrapped.values():
                wrapped.reshard()

    def reduce(self) -> None:
        """Average the gradients reduced after the step (tensor parallel, replicated; stages whose parameters the
        loss may not reach, None where it reached them on no replica): one all-reduce per dtype."""
        import torch.distributed as dist

        if not self.after:
            return
        # a replica whose loss did not reach a parameter has None where another has a gradient: zeros there,
        # so every replica reduces the same tensors (None stays only where no replica has one)
        present = torch.tensor([p.grad is not None for p in self.after], dtype=torch.int32, device=self.layout.device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        for p, anywhere in zip(self.after, present.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [self.local(p.grad) for p in self.after if p.grad is not None]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.group)
            flat /= self.replicas
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))

    def local(self, grad: torch.Tensor) -> torch.Tensor:
        """Return the part of a gradient this process holds (a shard's, under FSDP2)."""
        return grad.to_local() if hasattr(grad, "to_local") else grad


_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the leaves given zero shares


def keep_every_gradient(stage: nn.Module) -> None:
    """Make each leaf of the user's in ``stage`` give every trainable parameter a gradient, zeros where unused.

    FSDP2 reduce-scatters the gradients a replica has: replicas whose data skipped different
    parameters of a leaf (experts given no rows) flattened different sets, and the reduction
    mixed them up (1.3x off) or gloo aborted. Adding ``0 * sum(parameters)`` to the leaf's
    floating outputs gives every parameter its (zero) share, as a replica reaching it adds its own.
    """
    for module in stage.modules():
        if not user_leaf(module) or not any(p.requires_grad for p in module.parameters()):
            continue
        if module not in _HOOKED:  # a stage wrapped again (parameters frozen since) keeps its one hook
            _HOOKED.add(module)
            module.register_forward_hook(_with_zero_shares)


def _with_zero_shares(module: nn.Module, args: Any, out: Any) -> Any:
    """Add zero times the sum of ``module``'s trainable parameters to each floating output needing grad."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return out
    zero = torch.stack([p.sum() for p in params]).sum() * 0

    def add(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            return t + zero.to(t.dtype)
        return t
    return tree_map(add, out)


def _trainable(module: nn.Module) -> tuple[tuple[bool, torch.dtype], ...]:
    """Return whether each of ``module``'s parameters requires grad, and its dtype (DDP's buckets are of one dtype)."""
    return tuple((p.requires_grad, p.dtype) for p in module.parameters())


def _dtypes(trainable: tuple[tuple[bool, torch.dtype], ...]) -> list[torch.dtype]:
    """Return the dtypes in :func:`_trainable`'s answer, each once, in order."""
    return list(dict.fromkeys(dtype for _, dtype in trainable))


def _any_trainable(trainable: tuple[tuple[bool, torch.dtype], ...]) -> bool:
    """Tell whether :func:`_trainable`'s answer has a parameter requiring grad."""
    return any(needs for needs, _ in trainable)


@contextmanager
def views_sent_only() -> Iterator[None]:
    """Silence FSDP2's warning that a stage returned a view, where only fxpipe reads the outputs.

    FSDP2 warns because an in-place op on a returned view would drop its pre-backward hook.
    The outputs of a stage that is not the last are only detached and sent (or handed to the
    next stage as a new leaf), never changed in place; the last stage's outputs reach the
    user's ``loss_fn``, so its warning stays.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)
        yield
