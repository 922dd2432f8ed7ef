"""``GPipe``: torchgpipe's module wrapper, compiled by fxpipe.

``GPipe(nn.Sequential, balance, devices=, chunks=, checkpoint=, deferred_batch_norm=)`` keeps
torchgpipe 0.0.7's contract: the same argument checks and errors, ``partitions`` (an
``nn.ModuleList`` of ``nn.Sequential``, so state_dict keys read ``partitions.0.0.weight``),
``len``/indexing/iteration over the layers, moving refused and casting allowed, tensors or
tuples of tensors in and out. Underneath, the partitions are lowered to a graph
(:mod:`~fxpipe.compat.torchgpipe.lowering`) and the balance becomes the split points of
``fxpipe.compile``::

    nn.Sequential(l0, l1, l2, l3), balance=[1, 3]
      → partitions [Sequential(l0), Sequential(l1, l2, l3)]
      → graph: input ─▶ partition_0 ─▶ partition_1 ─▶ output
      → compiler.compile(graph, 2, split_points=["partition_1"], devices=, chunks=, checkpoint=)

so the micro-batches, the clock-cycle schedule, fork/join ordering, copy streams,
checkpointing with replayed random numbers and deferred batch norm are fxpipe's, and skips
between partitions are fxpipe skip routes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe import compiler
from fxpipe.compat.torchgpipe.lowering import check_tensors, lower
from fxpipe.compat.torchgpipe.skip.layout import inspect_skip_layout
from fxpipe.compat.torchgpipe.skip.skippable import verify_skippables
from fxpipe.errors import PipelineInputError
from fxpipe.pipe import Pipe

__all__ = ["BalanceError", "GPipe", "verify_module"]

Device = torch.device | int | str


class BalanceError(ValueError):
    """A balance that does not partition the module (torchgpipe's error of the same name)."""


def recommend_auto_balance(message: str) -> str:
    """Append the hint to balance automatically with ``torchgpipe.balance``."""
    return (f"{message}\nWhile the model changes, its best balance changes too: "
            "fxpipe.compat.torchgpipe.balance finds one, e.g.\n"
            "  from fxpipe.compat.torchgpipe.balance import balance_by_time\n"
            "  balance = balance_by_time(n_partitions, model, sample, device=...)\n"
            "or use fxpipe.compile(model, n_stages, example_inputs=...), which needs no balance and "
            "no nn.Sequential.")


def verify_module(module: nn.Sequential) -> None:
    """Refuse a module that is not an ``nn.Sequential`` of distinct layers with distinct parameters."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned; fxpipe.compile takes any "
                        "nn.Module")
    if len(list(module.named_children())) != len(module):
        raise ValueError("module with duplicate children is not supported; give each layer its own "
                         "module object")
    total = len(list(module.parameters()))
    if total != sum(len(list(child.parameters())) for child in module.children()):
        raise ValueError("module with duplicate parameters in distinct children is not supported; "
                         "fxpipe.compile supports tied parameters")


def split_module(module: nn.Sequential, balance: Iterable[int],
                 devices: list[torch.device]) -> tuple[nn.ModuleList, list[int], list[torch.device]]:
    """Group the layers into partitions of ``balance`` sizes; keep one device per partition.

    Raises :class:`BalanceError` (a ValueError) for a wrong balance, IndexError for fewer devices than partitions.
    """
    balance = list(balance)
    if len(module) != sum(balance):
        raise BalanceError(recommend_auto_balance(
            f"module and sum of balance have different length (module: {len(module)}, sum of "
            f"balance: {sum(balance)})"))
    if any(b <= 0 for b in balance):
        raise BalanceError(recommend_auto_balance(
            f"all balance numbers must be positive integer (balance: {balance})"))
    if len(balance) > len(devices):
        raise IndexError(f"too few devices to hold given partitions (devices: {len(devices)}, "
                         f"partitions: {len(balance)}); pass devices= with one device per partition")
    layers = list(module.named_children())
    partitions, start = [], 0
    for size in balance:
        partitions.append(nn.Sequential(OrderedDict(layers[start:start + size])))
        start += size
    return nn.ModuleList(partitions), balance, devices[:len(balance)]


class GPipe(nn.Module):
    """Run an ``nn.Sequential`` as a pipeline: torchgpipe's ``GPipe``, compiled by fxpipe.

    ``balance`` lists the number of layers of each partition; partition ``j`` runs on
    ``devices[j]`` (default: every CUDA device). ``chunks`` is the number of micro-batches;
    ``checkpoint`` is ``"always"``, ``"except_last"`` or ``"never"``;
    ``deferred_batch_norm=True`` updates batch norm running statistics once per mini-batch.
    Raises TypeError (not an ``nn.Sequential``), ValueError (bad arguments or balance) or
    IndexError (fewer devices than partitions).
    """

    #: The layers, grouped into one ``nn.Sequential`` per partition.
    partitions: nn.ModuleList
    #: The number of layers in each partition.
    balance: list[int]
    #: The device of each partition; ``devices[-1]`` holds the output.
    devices: list[torch.device]
    #: The number of micro-batches.
    chunks: int = 1
    #: When to checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
    checkpoint: str = "except_last"
    _pipe: Pipe | None

    def __init__(self, module: nn.Sequential, balance: Iterable[int] | None = None, *,
                 devices: Iterable[Device] | None = None, chunks: int = chunks,
                 checkpoint: str = checkpoint, deferred_batch_norm: bool = False) -> None:
        super().__init__()
        chunks = int(chunks)
        checkpoint = str(checkpoint)
        if balance is None:
            raise ValueError(recommend_auto_balance("balance is required"))
        if chunks <= 0:
            raise ValueError(f"number of chunks must be positive integer, got {chunks}")
        if checkpoint not in ("always", "except_last", "never"):
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never' "
                             f"(got {checkpoint!r})")
        verify_module(module)
        verify_skippables(module)
        self.chunks = chunks
        self.checkpoint = checkpoint
        if devices is None:
            devices = range(torch.cuda.device_count())
        self.partitions, self.balance, self.devices = split_module(
            module, balance, [torch.device(d) for d in devices])
        self.__dict__["_pipe"] = None  # not a submodule: state_dict keys stay partitions.*
        if len(self.partitions):
            gm, names = lower(list(self.partitions), inspect_skip_layout(self.partitions))
            pipe = compiler.compile(gm, len(self.partitions), split_points=names[1:], devices=self.devices,
                                  chunks=chunks, checkpoint=checkpoint,
                                  deferred_batch_norm=deferred_batch_norm)
            pipe.training = self.training  # the layers keep their own modes until train()/eval()
            pipe._runtime.binding.rows = chunk_rows  # torchgpipe's micro-batches: batch 6, chunks 4 -> 2, 2, 2
            self.__dict__["_pipe"] = pipe
        if deferred_batch_norm:
            self._register_state_dict_hook(_add_deferred_sums)
            self.register_load_state_dict_pre_hook(_drop_deferred_sums)

    @property
    def pipe(self) -> Pipe | None:
        """Return the fxpipe :class:`~fxpipe.Pipe` that runs the partitions (None when empty)."""
        return self._pipe

    def __len__(self) -> int:
        """Count the layers of all partitions."""
        return sum(len(cast(nn.Sequential, p)) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        """Return a layer by its index in the original sequential module."""
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers")
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """Iterate over the layers of all partitions, in order."""
        for partition in self.partitions:
            yield from cast(nn.Sequential, partition)

    def cuda(self, device: Any = None) -> GPipe:
        """Refuse: GPipe places each partition on its device."""
        raise _moving_denied()

    def cpu(self) -> GPipe:
        """Refuse: GPipe places each partition on its device."""
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        """Cast parameters and buffers to a dtype; refuse to move them to a device."""
        if "device" in kwargs or "tensor" in kwargs:
            raise _moving_denied()
        if args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise _moving_denied()
        return super().to(*args, **kwargs)

    def train(self, mode: bool = True) -> GPipe:
        """Set training mode on the layers and the pipeline."""
        super().train(mode)
        if self._pipe is not None:
            self._pipe.train(mode)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse changing what the pipe was compiled for (``chunks``, ``checkpoint``, ``balance``, ``devices``)."""
        if name in ("chunks", "checkpoint", "balance", "devices") and "_pipe" in self.__dict__:
            raise TypeError(f"GPipe.{name} is fixed when the GPipe is built (its pipe was compiled for "
                            f"{name}={getattr(self, name)!r}; setting it would be ignored): build a new "
                            f"GPipe(module, balance, {name}={value!r}, ...)")
        super().__setattr__(name, value)

    def forward(self, input: Any) -> Any:
        """Run a mini-batch (a tensor or a tuple of tensors) through the pipeline; return the output.

        Raises TypeError for any other input.
        """
        check_tensors(input, "the input")
        rows = [v.shape[0] for v in input if v.dim() > 0] if isinstance(input, tuple) else []
        if len(set(rows)) > 1:
            raise PipelineInputError(
                f"batch sizes disagree: the input's tensors have {rows} rows on dim 0. GPipe splits each of them "
                f"into micro-batches on dim 0 and gives a micro-batch the same rows of each (torchgpipe chunked "
                f"each on its own, pairing rows of different samples), so give them the same batch size; a tensor "
                f"every micro-batch needs whole belongs in the module (a buffer), not in the input")
        if self._pipe is None:
            return input  # an empty sequential module
        return self._pipe(input)


def chunk_rows(batch: int, chunks: int) -> list[int]:
    """Return the micro-batch sizes ``Tensor.chunk(chunks)`` gives a batch of ``batch`` rows, as torchgpipe splits.

    Each holds ``ceil(batch / chunks)`` rows but the last, so there may be fewer than ``chunks``
    (batch 6, chunks 4: 2, 2, 2), and the last may be smaller by more than one (10, 4: 3, 3, 3, 1).
    """
    size = -(-batch // chunks)
    return [min(size, batch - start) for start in range(0, batch, size)]


def _deferred_norms(gpipe: GPipe) -> Iterator[tuple[str, _BatchNorm]]:
    """Yield the batch norms torchgpipe would have made deferred, by their names under ``partitions``."""
    for name, module in gpipe.partitions.named_modules(prefix="partitions"):
        if isinstance(module, _BatchNorm) and module.track_running_stats and "sum" not in module._buffers:
            yield name, module


def _add_deferred_sums(gpipe: GPipe, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Add torchgpipe's ``sum`` and ``sum_squares`` keys of each deferred batch norm, zero between mini-batches.

    torchgpipe's ``deferred_batch_norm=True`` swaps every batch norm for its ``DeferredBatchNorm``,
    which accumulates in those persistent buffers and zeroes them at each commit; fxpipe defers the
    model's own batch norms, so a state dict of either loads into the other with ``strict=True``.
    """
    for name, bn in _deferred_norms(gpipe):
        for key in ("sum", "sum_squares"):
            state[f"{prefix}{name}.{key}"] = torch.zeros_like(cast(torch.Tensor, bn.running_mean))


def _drop_deferred_sums(gpipe: GPipe, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Drop torchgpipe's ``sum`` and ``sum_squares`` keys before loading: between mini-batches they are zero."""
    for name, _bn in _deferred_norms(gpipe):
        for key in ("sum", "sum_squares"):
            state.pop(f"{prefix}{name}.{key}", None)


def _moving_denied() -> TypeError:
    """Return the error for moving a GPipe to a device."""
    return TypeError("denied to move parameters and buffers, because GPipe should manage device "
                     "placement; pass devices= to GPipe instead (casting with .to(dtype) or .half() "
                     "is allowed)")
