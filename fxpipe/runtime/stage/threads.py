"""One worker thread per device, so the stages of a clock cycle compute concurrently.

On CUDA, kernels run asynchronously but Python launches them one at a time: with a single
thread, stage 1 could not start launching until stage 0 had launched its whole forward.
Each device gets its own thread (torchgpipe, section 3.2.2); the clock waits for all of them
before the next fence. Autograd's grad mode and autocast are thread-local, so each task
carries the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fxpipe.runtime.stage.stagecall import autocast_as, autocast_state

__all__ = ["DeviceThreads"]


def _call(grad: bool, autocast: tuple, fn: Callable, args: tuple) -> Any:
    """Run ``fn(*args)`` with the caller's grad mode and autocast state."""
    with torch.set_grad_enabled(grad), autocast_as(autocast):
        return fn(*args)


class DeviceThreads:
    """A single-thread executor per device."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.pools = {d: ThreadPoolExecutor(1, thread_name_prefix=f"fxpipe-{d}") for d in dict.fromkeys(devices)}

    def run(self, tasks: Sequence[tuple[torch.device, Callable, tuple]]) -> list[Any]:
        """Run each ``(device, fn, args)`` on its device's thread; return the results in order."""
        grad, autocast = torch.is_grad_enabled(), autocast_state()
        futures: list[Future] = [self.pools[d].submit(_call, grad, autocast, fn, args) for d, fn, args in tasks]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the threads."""
        for pool in self.pools.values():
            pool.shutdown(wait=False)
