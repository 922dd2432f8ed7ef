"""Timing a call on a device: its seconds with the device's queued work included, and a median.

Reads and writes nothing of a graph: the one timing helper of the graph profiler
(``fxpipe.passes.profile``), the device calibration and the node measurements of the simulator.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["median_seconds", "seconds", "sync"]


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (nothing to wait for off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    """Return the seconds one call of ``fn`` takes, its device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], device: torch.device | str = "cpu", repeats: int = 5,
                   warmup: int = 1) -> float:
    """Return the median of :func:`seconds` over ``repeats`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn, device) for _ in range(repeats))
