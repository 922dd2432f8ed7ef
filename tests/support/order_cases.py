"""What each rank runs in the tests of pipes called in another order on each rank (imported by spawned processes)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


def _pipe(width: int, world: int):
    """Compile a small MLP of ``width`` across ``world`` ranks with a short timeout."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    return fxpipe.compile(model, world, example_inputs=(torch.randn(4, width),), chunks=2, runtime="distributed",
                          timeout=6, schedule="1f1b")


def out_of_order(rank, world, schedule):
    """Two pipes, rank 0 steps the first then the second, the other ranks the second then the first."""
    torch.manual_seed(0)
    pipes = [(_pipe(8, world), 8), (_pipe(6, world), 6)]
    order = pipes if rank == 0 else pipes[::-1]
    out = {}
    start = time.monotonic()
    try:
        for pipe, width in order:
            x = torch.randn(4, width)
            pipe.step(x, target=torch.randn_like(x), loss_fn=F.mse_loss)
        out["first"] = ["returned", "", time.monotonic() - start]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["first"] = [type(exc).__name__, str(exc), time.monotonic() - start]
    for when in ("next", "after"):  # every rank goes on with the first pipe, as a loop catching errors would
        try:
            x = torch.randn(4, 8)
            pipes[0][0].step(x, target=torch.randn_like(x), loss_fn=F.mse_loss)
            out[when] = ["returned", ""]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[when] = [type(exc).__name__, str(exc)]
    _wait_for_all(rank, world)  # rank 0 hosts the store: it stays until every rank is done with it
    return out


def _wait_for_all(rank, world, limit=60.0):
    """Wait until every rank got here, through files (the pipeline's own groups are closed by now)."""
    folder = os.environ["FXPIPE_TEST_DIR"]
    open(os.path.join(folder, f"done{rank}"), "w").close()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(folder, f"done{r}"))
                                                   for r in range(world)):
        time.sleep(0.05)
