"""What each rank runs in the distributed tests (imported by spawned processes)."""

from __future__ import annotations

import copy
import json
import os
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error
from models import TiedTransformer
from unet import UNet


def _check_step(rank, world, model, x, target, loss_fn, **kw):
    """Compare the loss and this rank's gradients with eager."""
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, world, example_inputs=(x,), runtime="distributed", timeout=60, **kw)
    last = rank == world - 1
    loss = pipe.step(x if rank == 0 else None, target=target if last else None, loss_fn=loss_fn)
    held = {id(p) for p in pipe.stages[rank].parameters()}
    grads = dict(eager.named_parameters(remove_duplicate=False))
    errors = {name: max_relative_error(p.grad, grads[name].grad)
              for name, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": errors,
            "skips": [(r.name, r.src, r.dst) for r in pipe.plan.skips],
            "code": pipe.code, "devices": [s.device for s in pipe.plan.stages]}


def unet(rank, world, schedule):
    torch.manual_seed(0)
    model = UNet(depth=2, base=4).eval()
    x, target = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    return _check_step(rank, world, model, x, target, F.mse_loss, chunks=4, schedule=schedule,
                       split_points=["down.1", "up.0"][: world - 1])


def tied(rank, world, schedule):
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens, target = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return _check_step(rank, world, model, tokens, target, loss_fn, chunks=3, schedule=schedule)


def shape(rank, world, schedule):
    torch.manual_seed(0)
    model = UNet(depth=2, base=4).eval()
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=2,
                          runtime="distributed", timeout=60, schedule=schedule)
    x = torch.randn(4, 3, 16, 12)
    pipe.step(x if rank == 0 else None, target=torch.randn(4, 2, 16, 12), loss_fn=F.mse_loss)
    return {}


class Bomb(nn.Module):
    """Raise on the second call in a chosen process."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("FXPIPE_TEST_BOMB") == os.environ["RANK"] and self.calls > 3:
            if os.environ.get("FXPIPE_TEST_DIE"):
                os._exit(3)  # die without a word, like a killed process
            raise RuntimeError("boom in the bomb")
        return self.lin(x)


class BombNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bomb = Bomb()
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.bomb(torch.relu(self.a(x)))))


def raises(rank, world, schedule):
    torch.manual_seed(0)
    os.environ["FXPIPE_TEST_BOMB"] = "1"
    model = BombNet()
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=4, runtime="distributed",
                          timeout=60, schedule=schedule, split_points=["bomb", "c"][: world - 1],
                          leaf_modules=[Bomb])
    for _ in range(3):
        pipe.step(x if rank == 0 else None, target=torch.randn(8, 8), loss_fn=F.mse_loss)
    return {}


def dies(rank, world, schedule):
    os.environ["FXPIPE_TEST_DIE"] = "1"
    return raises(rank, world, schedule)


def on_gpus(case):
    """Run ``case`` letting fxpipe pick the backend (NCCL with CUDA); add what it picked."""
    def run(rank, world, schedule):
        result = case(rank, world, schedule)
        import torch.distributed as dist

        return {**result, "backend": dist.get_backend(), "device": str(torch.cuda.current_device())}
    return run


CASES = {"unet": unet, "tied": tied, "shape": shape, "raises": raises, "dies": dies,
         "unet_nccl": on_gpus(unet), "tied_nccl": on_gpus(tied)}


def run(rank: int, world: int, port: int, case: str, schedule: str, outdir: str) -> None:
    """Entry point of one spawned rank: run a case, write the result as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if torch.cuda.is_available() and not case.endswith("_nccl"):
        # these cases run on the CPU: with CUDA present fxpipe would pick NCCL and a GPU per rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        result = {"ok": True, **CASES[case](rank, world, schedule)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if not result["ok"] and case == "raises":
        raise SystemExit(1)  # a failing rank exits like a script with an uncaught exception
