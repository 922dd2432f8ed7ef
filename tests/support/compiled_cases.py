"""What each rank runs in the distributed tests of compiled stages (``torch_compile=``)."""

from __future__ import annotations

from dist_cases import _check_step, _dp_setup, _grad_errors, _tied_dp
from models import TiedTransformer, token_loss

import torch

AOT = {"backend": "aot_eager"}


def schedule(rank, world, name):
    """One step of a tied transformer with compiled stages equals eager (two stages per rank for V schedules)."""
    torch.manual_seed(0)
    per_rank = 2 if name in ("interleaved", "zbv") else 1
    tokens, target = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    result, pipe = _check_step(rank, world, TiedTransformer(), tokens, target, token_loss, chunks=4, schedule=name,
                               stages_per_rank=per_rank, torch_compile=AOT)
    stats = pipe.compile_stats
    return {**result, "compiled": sorted(stats), "split": {j: bool(s["split"]) for j, s in stats.items()},
            "keys": [k for k in pipe.state_dict() if "_orig_mod" in k]}


def data_parallel(rank, world, name):
    """2 replicas x 2 ranks of compiled stages (DDP, or FSDP2 with ':shard'): a step equals eager's."""
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _tied_dp, name, chunks=4,
                                                                      torch_compile=AOT)
    loss = step(xs, ys)
    expected = loss_fn(eager(x), y)
    expected.backward()
    from fxpipe.testing import max_relative_error

    return {"loss_error": max_relative_error(loss, expected), "grad_errors": _grad_errors(held, eager),
            "compiled": sorted(pipe.compile_stats), "keys": [k for k in pipe.state_dict() if "_orig_mod" in k]}
