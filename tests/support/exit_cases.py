"""What each rank runs in the exit tests: a pipe alive until the interpreter exits (imported by spawned ranks)."""

from __future__ import annotations

import atexit
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe

KEEP: list = []  # a module global, as a script's top-level pipe: freed only as the interpreter tears down


def _threads() -> int:
    """Return how many threads this process runs (gloo's included, which Python does not see)."""
    return len(os.listdir("/proc/self/task"))


def _at_exit(rank: int, seen: dict) -> None:
    """Record, after fxpipe's own exit handler ran, the threads left and what the pipe still holds."""
    runtime = KEEP[0]._runtime
    seen.update(exit_threads=_threads(), released=runtime.released,
                groups=[g is not None for g in (runtime.comm.group, runtime.layout.pp_group,
                                                runtime.layout.dp_group, runtime.layout.mesh)],
                wrapped=len(runtime.grad_sync.wrapped) if runtime.grad_sync is not None else 0)
    with open(os.path.join(os.environ["FXPIPE_TEST_DIR"], f"exit{rank}.json"), "w") as f:
        json.dump(seen, f)


def global_pipe(rank, world, schedule):
    """Train a pp1 x dp``world`` pipe held by a module global, destroy the groups, and let the script end."""
    seen: dict = {}
    atexit.register(_at_exit, rank, seen)  # registered first, so it runs after fxpipe's handler
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    rows = len(x) // world
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    KEEP.append(fxpipe.compile(model, 1, example_inputs=(xs,), runtime="distributed", timeout=60,
                               chunks=2, data_parallel=world, schedule=schedule))
    seen["running_threads"] = _threads()
    loss = KEEP[0].step(xs, target=ys, loss_fn=F.mse_loss)
    dist.destroy_process_group()
    return {"loss": loss.item()}
