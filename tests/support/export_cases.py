"""What each rank runs in the distributed tests of models traced with ``tracer="export"``."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from models import MLP

import fxpipe


def real_weights(rank, world, schedule):
    """An exported model with real weights: each rank keeps its stage only, and a save holds the trained values.

    torch.export's fake tensor memo holds a weak reference to every parameter, which forbids
    swapping a tensor to meta in place; a rank that kept the other stages' tensors real wrote
    their untrained copies into the checkpoint beside the owners' trained ones.
    """
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, tracer="export")
    held = {id(t) for j in pipe.plan.stages_of(rank) for t in (*pipe.stages[j].parameters(), *pipe.stages[j].buffers())}
    wrong = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta == (id(t) in held)]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    opt.step()
    trained = {k: v.clone() for k, v in pipe.state_dict().items()}
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], "ckpt")
    fxpipe.save(pipe, path)
    saved = fxpipe.load_state_dict(path)
    stale = sorted(k for k, v in trained.items() if not torch.equal(saved[k], v))
    return {"wrong": wrong, "stale": stale, "mine": sorted(trained)}


CASES = {"real_weights": real_weights}
