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
from fxpipe.testing import default_step_loss, max_relative_error
from models import AttnBlock, Carrier, Mixed, TiedTransformer
from unet import UNet


def _check_step(rank, world, model, x, target, loss_fn, stages_per_rank=1, **kw):
    """Compare the loss and this rank's gradients with eager; return the errors and the pipe."""
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, world * stages_per_rank, example_inputs=(x,), runtime="distributed", timeout=60,
                          stages_per_rank=stages_per_rank, **kw)
    last = rank == pipe.plan.stages[-1].on_rank
    loss = pipe.step(x if rank == 0 else None, target=target if last else None, loss_fn=loss_fn)
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    grads = dict(eager.named_parameters(remove_duplicate=False))
    errors = {name: max_relative_error(p.grad, grads[name].grad)
              for name, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": errors,
            "skips": [(r.name, r.src, r.dst) for r in pipe.plan.skips],
            "code": pipe.code, "devices": [s.device for s in pipe.plan.stages]}, pipe


def unet(rank, world, schedule):
    torch.manual_seed(0)
    model = UNet(depth=2, base=4).eval()
    x, target = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    return _check_step(rank, world, model, x, target, F.mse_loss, chunks=4, schedule=schedule,
                       split_points=["down.1", "up.0"])[0]


def tied(rank, world, schedule):
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens, target = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return _check_step(rank, world, model, tokens, target, loss_fn, chunks=3, schedule=schedule)[0]


def unet4(rank, world, schedule):
    """Two stages per rank: level 0's skip from stage 0 to 3, level 1's from stage 1 to 2."""
    torch.manual_seed(0)
    model = UNet(depth=2, base=4).eval()
    x, target = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    return _check_step(rank, world, model, x, target, F.mse_loss, chunks=4, schedule=schedule,
                       split_points=["down.1", "middle", "up.1"], stages_per_rank=2)[0]


def tied4(rank, world, schedule):
    """Two stages per rank, the embedding tied to the head."""
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens, target = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return _check_step(rank, world, model, tokens, target, loss_fn, chunks=4, schedule=schedule,
                       stages_per_rank=2)[0]


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


def values(rank, world, schedule):
    """Values of every kind across a boundary, each model, cut and schedule: pipe(x) and pipe.step."""
    results = {}
    for label, make, shape, tracer, split in [
            ("carrier fx dict", Carrier, (7, 8), "fx", ["getitem"]),
            ("carrier fx items", Carrier, (7, 8), "fx", ["b"]),
            ("carrier export", Carrier, (7, 8), "export", ["b"]),
            ("attention fx", AttnBlock, (4, 5, 8), "fx", ["getitem"]),
            ("attention export", AttnBlock, (4, 5, 8), "export", ["out"])]:
        for schedule in ("gpipe", "1f1b", "zb"):
            torch.manual_seed(0)
            model, x = make().eval(), torch.randn(shape)
            eager = copy.deepcopy(model)
            expected = eager(x)
            kw = dict(leaf_modules=[Mixed]) if tracer == "fx" else {}
            res, pipe = _check_step(rank, world, model, x, None, default_step_loss, chunks=3,
                                    schedule=schedule, tracer=tracer, split_points=split, **kw)
            out = pipe(x if rank == 0 else None)
            if rank == world - 1:
                first = out[0] if isinstance(out, tuple) else out
                want = expected[0] if isinstance(expected, tuple) else expected
                res["out_error"] = max_relative_error(first, want)
                res["out_rest"] = out[1:] == expected[1:] if isinstance(out, tuple) else True
            results[f"{label} {schedule}"] = {k: res[k] for k in ("loss_error", "grad_errors", "out_error",
                                                                   "out_rest") if k in res}
    return {"cases": results}


CASES = {"values": values, "unet": unet, "tied": tied, "unet4": unet4, "tied4": tied4, "shape": shape, "raises": raises, "dies": dies}


def run(rank: int, world: int, port: int, case: str, schedule: str, outdir: str) -> None:
    """Entry point of one spawned rank: run a case, write the result as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        result = {"ok": True, **CASES[case](rank, world, schedule)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if not result["ok"] and case == "raises":
        raise SystemExit(1)  # a failing rank exits like a script with an uncaught exception


# -- pipeline x data parallel: 4 ranks, 2 replicas of a 2-rank pipeline ------------------------
def _full(t):
    """Return a gradient whole (FSDP2 shards it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _dp_setup(rank, world, make, schedule, pp=2, **kw):
    """Compile ``make()``'s model as 2 replicas; return the pieces every data-parallel case uses."""
    schedule, _, mode = schedule.partition(":")
    torch.manual_seed(0)
    model, x, y, loss_fn = make()
    eager = copy.deepcopy(model)
    dp, replica, pp_rank = world // pp, rank // pp, rank % pp
    rows = x.shape[0] // dp
    xs, ys = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    v = kw.pop("stages_per_rank", 1)
    pipe = fxpipe.compile(model, pp * v, example_inputs=(xs,), runtime="distributed", timeout=60, schedule=schedule,
                          data_parallel=dp, data_parallel_shard=mode == "shard", stages_per_rank=v, **kw)
    last = pipe.plan.stages[-1].on_rank == pp_rank
    step = lambda xs_, ys_: pipe.step(xs_ if pp_rank == 0 else None, target=ys_ if last else None,  # noqa: E731
                                      loss_fn=loss_fn)
    held = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if any(p is q for j in pipe.plan.stages_of(pp_rank) for q in pipe.stages[j].parameters())]
    return pipe, model, eager, x, y, xs, ys, loss_fn, step, held


def _grad_errors(held, eager):
    grads = dict(eager.named_parameters(remove_duplicate=False))
    return {n: max_relative_error(_full(p.grad), grads[n].grad) if p.grad is not None else float(f"inf") for n, p in held}


def _mlp_pair():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.randn(8, 4), F.mse_loss


def _unet_dp():
    return UNet(depth=2, base=4).eval(), torch.randn(8, 3, 8, 8), torch.randn(8, 2, 8, 8), F.mse_loss


def _tied_dp():
    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    return TiedTransformer(), torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8)), loss_fn


def dp_train(rank, world, schedule):
    """One step equals eager on the global batch; clipping equals the whole model's; 5 Adam steps' losses."""
    make = _tied_dp if "tied" in schedule else _unet_dp
    kw = {} if "tied" in schedule else {"split_points": ["down.1"]}
    if "interleaved" in schedule:
        kw["stages_per_rank"] = 2
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(
        rank, world, make, schedule.replace("tied-", ""), chunks=4, **kw)
    counted = []
    if pipe._runtime.grad_sync is not None and not pipe._runtime.grad_sync.shard:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        for ddp in pipe._runtime.grad_sync.wrapped.values():
            group = pipe._runtime.layout.dp_group
            ddp.register_comm_hook(group, lambda g, bucket: (counted.append(1), default_hooks.allreduce_hook(g, bucket))[1])
    loss = step(xs, ys)
    expected = loss_fn(eager(x), y)
    expected.backward()
    out = {"loss_error": max_relative_error(loss, expected), "grad_errors": _grad_errors(held, eager),
           "collectives": len(counted), "stages": len(pipe._runtime.workers)}
    norm = fxpipe.clip_grad_norm_(pipe, 0.05)
    out["norm_error"] = max_relative_error(norm, torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05))
    out["clipped_errors"] = _grad_errors(held, eager)
    opt = torch.optim.Adam(list({id(p): p for _, p in held}.values()), lr=1e-3)
    ref = torch.optim.Adam(eager.parameters(), lr=1e-3)
    losses = []
    for k in range(5):
        opt.zero_grad()
        ref.zero_grad()
        torch.manual_seed(k)
        got = step(xs, ys)
        want = loss_fn(eager(x), y)
        want.backward()
        opt.step()
        ref.step()
        losses.append(abs(float(got) - float(want.detach())))
    out["adam_loss_errors"] = losses
    return out


def dp_accumulate(rank, world, schedule):
    """Two steps (the first inside no_sync) equal eager's two backwards; autocast bf16 equals eager's math."""
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _mlp_pair, schedule, chunks=1,
                                                                       split_points=["2"])
    x2, y2 = torch.randn_like(x), torch.randn_like(y)
    rows = xs.shape[0]
    replica = rank // 2
    with pipe.no_sync():
        step(xs, ys)
    step(x2[replica * rows:(replica + 1) * rows], y2[replica * rows:(replica + 1) * rows])
    loss_fn(eager(x), y).backward()
    loss_fn(eager(x2), y2).backward()
    out = {"grad_errors": _grad_errors(held, eager)}
    # autocast: every stage, both replicas; the reference does the same math (a replica's half each)
    model.zero_grad()
    eager.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step(xs, ys)
        halves = [loss_fn(eager(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows]) for r in range(2)]
    for h in halves:
        (h / 2).backward()
    out["autocast_loss_error"] = max_relative_error(got, sum(h.detach() for h in halves) / 2)
    out["autocast_grad_errors"] = _grad_errors(held, eager)
    float32 = copy.deepcopy(eager)  # the same step without autocast: float32 gradients
    float32.zero_grad()
    loss_fn(float32(x), y).backward()
    out["bf16_vs_fp32"] = max(_grad_errors(held, float32).values())
    return out


def dp_refusals(rank, world, schedule):
    """A layout the world cannot hold; replicas with different batch sizes (refused on every rank)."""
    model, x, y, loss_fn = _mlp_pair()
    out = {}
    try:
        fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x,), runtime="distributed", data_parallel=3,
                       timeout=60)
    except ValueError as exc:
        out["layout"] = str(exc)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), runtime="distributed", data_parallel=2, timeout=60,
                          split_points=["2"])
    rows = 4 if rank // 2 == 0 else 3
    try:
        pipe.step(x[:rows] if rank % 2 == 0 else None, target=y[:rows] if rank % 2 == 1 else None, loss_fn=loss_fn)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["batch"] = f"{type(exc).__name__}: {exc}"
    return out


CASES.update(dp_train=dp_train, dp_accumulate=dp_accumulate, dp_refusals=dp_refusals)


def scaler(rank, world, schedule):
    """fp16 loss scaling across ranks: an inf on one rank makes every rank skip the step."""
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp_pair()
    pipe = fxpipe.compile(model, world, example_inputs=(x,), runtime="distributed", timeout=60, chunks=2,
                          schedule=schedule, split_points=["2"])
    sc = fxpipe.grad_scaler(pipe, init_scale=1024.0)
    opt = torch.optim.SGD([p for p in pipe.stages[rank].parameters()], lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = pipe.step(x if rank == 0 else None, target=y if rank == world - 1 else None, loss_fn=loss_fn,
                         scaler=sc)
    grads_scaled = [float(p.grad.abs().max()) for p in pipe.stages[rank].parameters()]
    if rank == 1:
        next(iter(pipe.stages[rank].parameters())).grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in pipe.stages[rank].parameters()]
    sc.step(opt)
    sc.update()
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, pipe.stages[rank].parameters()))
    return {"scale": sc.get_scale(), "skipped": unchanged, "loss": float(loss), "scaled": max(grads_scaled),
            "type": type(sc).__name__}


CASES.update(scaler=scaler)
