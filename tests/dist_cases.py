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
                       split_points=["down.1", "up.0"])


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


class _Recording(fxpipe.weights.WeightSource):
    """A weights source that records the keys it reads."""

    def __init__(self, path):
        self.inner = fxpipe.weights.open_weights(path)
        self.description = self.inner.description
        self.keys: list[str] = []

    def specs(self):
        return self.inner.specs()

    def read(self, into):
        self.keys += list(into)
        self.inner.read(into)


def _meta_step(rank, world, factory, reference, x, target, loss_fn, **kw):
    """Compile ``factory()`` built on meta; compare loss and this rank's gradients with ``reference``."""
    with torch.device("meta"):
        model = factory()
    expected = loss_fn(reference(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, world, example_inputs=(x,), runtime="distributed", timeout=60, **kw)
    held = {id(t) for t in (*pipe.stages[rank].parameters(), *pipe.stages[rank].buffers())}
    tensors = dict(model.state_dict(keep_vars=True))
    wrong = [n for n, t in tensors.items() if t.is_meta == (id(t) in held)]  # held real, the rest meta
    loss = pipe.step(x if rank == 0 else None, target=target, loss_fn=loss_fn)
    grads = dict(reference.named_parameters(remove_duplicate=False))
    errors = {name: max_relative_error(p.grad, grads[name].grad)
              for name, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    own = pipe.state_dict()
    pipe.load_state_dict({**own, "not.a.key": torch.zeros(1)})  # a rank loads its own FQNs, ignores others
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": errors, "wrong": wrong,
            "owned": sorted(own), "all": sorted(tensors)}


def meta(rank, world, schedule):
    """A U-Net (seeded init) and a tied transformer (weights by FQN) built on meta, one stage per rank."""
    torch.manual_seed(0)
    unet_ref = fxpipe.materialize(_on_meta(lambda: UNet(depth=2, base=4).eval()), seed=5)
    x, target = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    a = _meta_step(rank, world, lambda: UNet(depth=2, base=4).eval(), unet_ref, x, target, F.mse_loss,
                   chunks=3, schedule=schedule, seed=5)
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], "tied.pt")
    tied_ref = fxpipe.materialize(_on_meta(TiedTransformer), weights=path)
    tokens, target = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    source = _Recording(path)
    b = _meta_step(rank, world, TiedTransformer, tied_ref, tokens, target, loss_fn, chunks=3,
                   schedule=schedule, weights=source)
    return {"unet": a, "tied": b, "read": source.keys, "missing": _refusal(path, rank, world)}


def _refusal(path, rank, world):
    """Compile with weights lacking a tensor of the last stage; return the error this rank raised."""
    state = torch.load(path)
    del state["norm.weight"]
    with torch.device("meta"):
        model = TiedTransformer()
    try:
        fxpipe.compile(model, world, example_inputs=(torch.randint(0, 32, (7, 8)),), runtime="distributed",
                       timeout=60, weights=state)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, str(exc), all(t.is_meta for t in model.state_dict().values())]
    return None


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


class DropNet(nn.Module):
    """Six linear layers with ReLU and dropout (so a resumed run needs each rank's RNG state)."""

    def __init__(self, d: int = 192) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(6)])
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return x


def batch(i: int, d: int = 192):
    """Return step ``i``'s inputs and target (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, d, generator=g), torch.randn(8, d, generator=g)


def train(rank, world, steps, start=0, ckpt=None, save_at=None, load=None):
    """Build, compile and run Adam steps ``start..steps``; save or load a checkpoint on the way."""
    torch.manual_seed(0)
    model = DropNet()
    pipe = fxpipe.compile(model, world, example_inputs=(batch(0)[0],), chunks=2, runtime="distributed",
                          timeout=60, schedule="1f1b")
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    extra = fxpipe.load(pipe, load, optimizer=opt) if load else None
    losses = []
    for i in range(start, steps):
        x, y = batch(i)
        opt.zero_grad()
        losses.append(pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss).item())
        opt.step()
        if save_at == i + 1:
            fxpipe.save(pipe, ckpt, optimizer=opt, extra={"step": i + 1})
    return pipe, opt, losses, extra


def _own(pipe, opt):
    """Return this rank's parameters and optimizer state by FQN."""
    params = {k: v.clone() for k, v in pipe.state_dict().items()}
    names = {id(p): n for n, p in pipe.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {"params": params, "optim": state}


def resume_first(rank, world, schedule):
    """10 steps straight; then, from the same seed, 5 steps and a save."""
    out = os.environ["FXPIPE_TEST_DIR"]
    pipe, opt, straight, _ = train(rank, world, 10)
    torch.save({"losses": straight, **_own(pipe, opt)}, os.path.join(out, f"straight{rank}.pt"))
    pipe, opt, _, _ = train(rank, world, 5, ckpt=os.path.join(out, "ckpt"), save_at=5)
    torch.save(_own(pipe, opt), os.path.join(out, f"saved{rank}.pt"))
    own = sum(p.numel() * p.element_size() for p in pipe.stages[rank].parameters())
    return {"own_bytes": own}


def resume_second(rank, world, schedule):
    """New processes: load the checkpoint and run steps 5 to 10."""
    out = os.environ["FXPIPE_TEST_DIR"]
    pipe, opt, losses, extra = train(rank, world, 10, start=5, load=os.path.join(out, "ckpt"))
    torch.save({"losses": losses, **_own(pipe, opt)}, os.path.join(out, f"resumed{rank}.pt"))
    return {"extra": extra}


CASES = {"unet": unet, "tied": tied, "shape": shape, "raises": raises, "dies": dies, "meta": meta,
         "resume_first": resume_first, "resume_second": resume_second}


def run(rank: int, world: int, port: int, case: str, schedule: str, outdir: str) -> None:
    """Entry point of one spawned rank: run a case, write the result as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), FXPIPE_TEST_DIR=outdir)
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
