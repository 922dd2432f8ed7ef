"""CUDA streams that degrade to no-ops on CPU, so one code path serves both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

__all__ = [
    "AbstractStream",
    "current_stream",
    "new_stream",
    "on_device",
    "record_stream",
    "use_stream",
    "wait_stream",
]

AbstractStream = torch.cuda.Stream | None


def new_stream(device: torch.device) -> AbstractStream:
    """Create a new CUDA stream on ``device``; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    """Return the current CUDA stream of ``device``; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def use_stream(stream: AbstractStream):
    """Make ``stream`` current on its device for the block (no-op for None)."""
    if stream is None:
        return nullcontext()
    return torch.cuda.stream(stream)


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Make ``source`` wait for the work queued so far on ``target``."""
    if source is None or target is None or source == target:
        return
    source.wait_stream(target)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tell the caching allocator that ``stream`` uses ``tensor``'s memory."""
    if stream is None or not tensor.is_cuda:
        return
    tensor.record_stream(stream)


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device for the block (no-op on CPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
