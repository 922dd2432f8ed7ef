"""What each rank runs in the tests of checkpoint misuse across ranks (imported by spawned processes)."""

from __future__ import annotations

import os

import torch
from torch import nn

import fxpipe


def paths_differ(rank, world, schedule):
    """A save to a path naming the rank; a strict load of foreign keys; then a save every rank agrees on."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(4, 8),), chunks=2, runtime="distributed",
                          timeout=30, schedule=schedule)
    where = os.environ["FXPIPE_TEST_DIR"]
    out = {}
    try:  # the mistake: a name made from the rank (or the time)
        fxpipe.save(pipe, os.path.join(where, f"step-10-{rank}"))
        out["paths"] = "saved"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["paths"] = f"{type(exc).__name__}: {exc}"
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    state["5.weight"] = torch.zeros(8, 8)
    try:
        pipe.load_state_dict(state)
        out["strict"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["strict"] = f"{type(exc).__name__}: {exc}"
    fxpipe.save(pipe, os.path.join(where, "step-10"))
    out["listing"] = sorted(os.listdir(where))
    return out
