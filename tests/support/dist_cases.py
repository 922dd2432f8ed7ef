"""What each rank runs in the distributed tests (imported by spawned processes)."""

from __future__ import annotations

import copy
from functools import partial
import os
import time
import warnings

import torch
import torch.nn.functional as F
from models import (
    CNN,
    AdaLN,
    AttnBlock,
    BNAct,
    Carrier,
    Mixed,
    Pack,
    PackedLSTM,
    RopeDecoder,
    Spectral,
    TiedTransformer,
    Unpack,
    token_loss,
)
from torch import nn
from unet import UNet

import fxpipe
from fxpipe.materialize.weights import WeightSource, open_weights
from fxpipe.testing import default_step_loss, max_relative_error


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
                       split_points=["down.1", "up.0"][: world - 1])[0]


def tied(rank, world, schedule):
    """A tied embedding on the first and last rank; then labels padded with -100 under loss_reduction="sum"."""
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens, target = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))
    eager = copy.deepcopy(model)
    out, pipe = _check_step(rank, world, model, tokens, target, token_loss, chunks=3, schedule=schedule)
    labels = target.clone()
    for row, keep in enumerate([8, 6, 1, 3, 8, 2, 5]):
        labels[row, keep:] = -100
    n = (labels != -100).sum()

    def share(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum") / n

    loss = pipe.step(tokens if rank == 0 else None, target=labels, loss_fn=share, loss_reduction="sum")
    out["summed_error"] = max_relative_error(loss, token_loss(eager(tokens), labels))
    return out


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

    return _check_step(rank, world, model, tokens, target, token_loss, chunks=4, schedule=schedule,
                       stages_per_rank=2)[0]


def shape(rank, world, schedule):
    """Another spatial size runs equal to eager; another dtype or a target of other rows is refused on every rank; the pipe goes on."""
    torch.manual_seed(0)
    model = UNet(depth=2, base=4).eval()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=2,
                          runtime="distributed", timeout=60, schedule=schedule)
    x, y = torch.randn(4, 3, 16, 12), torch.randn(4, 2, 16, 12)
    loss = pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss)
    out = {"resized_error": max_relative_error(loss, F.mse_loss(eager(x), y))}
    try:
        pipe.step(x.double() if rank == 0 else None, target=y.double(), loss_fn=F.mse_loss)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.update(type=type(exc).__name__, message=str(exc))
    try:  # a target of another batch size, given on every rank: the same refusal everywhere
        pipe.step(x if rank == 0 else None, target=y[:3], loss_fn=F.mse_loss)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["target_rows"] = f"{type(exc).__name__}: {exc}"
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 2, 16, 16)
    out["after"] = float(pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss))  # the refusal did no harm

    def broken(out, target):
        raise RuntimeError("broken loss")

    try:  # a real failure later is reported as itself, not as the old refusal
        pipe.step(x if rank == 0 else None, target=y, loss_fn=broken)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["later"] = f"{type(exc).__name__}: {exc}"
    return out


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


class Positions(nn.Module):
    """Read a table of positions without a batch dim in the first and the last stage."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, pos):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x + pos))))) * pos


def unbatched(rank, world, schedule):
    """``unbatched=["pos"]``: the first rank sends the table whole with each micro-batch; equal to eager."""
    torch.manual_seed(0)
    model, x, pos, target = Positions(), torch.randn(6, 5, 8), torch.randn(5, 8), torch.randn(6, 5, 8)
    eager = copy.deepcopy(model)
    expected = F.mse_loss(eager(x, pos), target)
    expected.backward()
    pipe = fxpipe.compile(model, world, example_inputs=(x, pos), chunks=3, runtime="distributed", timeout=60,
                          schedule=schedule, unbatched=["pos"], tracer="export" if schedule == "zb" else "fx",
                          split_points=["c"])
    last = rank == pipe.plan.stages[-1].on_rank
    loss = pipe.step(x if rank == 0 else None, pos if rank == 0 else None, target=target if last else None,
                     loss_fn=F.mse_loss)
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    grads = dict(eager.named_parameters())
    result = {"loss_error": max_relative_error(loss, expected),
              "grad_errors": {n: max_relative_error(p.grad, grads[n].grad) for n, p in model.named_parameters()
                              if id(p) in held}}
    # pos requiring grad at the step only: the last stage has no gradient route back for it, refused on both ranks
    try:
        pipe.step(x if rank == 0 else None, pos.clone().requires_grad_() if rank == 0 else None,
                  target=target if last else None, loss_fn=F.mse_loss)
    except (fxpipe.PipelineInputError, fxpipe.PeerFailure) as exc:
        result["refused"] = str(exc)
    # requiring grad at compile routes it: the inputs' gradients (on the first rank) equal eager's
    rg = [t.clone().requires_grad_() for t in (x, pos)]
    pipe = fxpipe.compile(copy.deepcopy(eager), world, example_inputs=tuple(rg), chunks=3, runtime="distributed",
                          timeout=60, schedule=schedule, unbatched=["pos"], tracer="export" if schedule == "zb" else "fx",
                          split_points=["c"])
    pipe.step(*(rg if rank == 0 else (None, None)), target=target if last else None, loss_fn=F.mse_loss)
    if rank == 0:
        ex, ep = (t.clone().requires_grad_() for t in (x, pos))
        F.mse_loss(copy.deepcopy(eager)(ex, ep), target).backward()
        result["input_grad_errors"] = [max_relative_error(a.grad, b.grad) for a, b in zip(rg, (ex, ep))]
    return result


class RankOrdered(nn.Module):
    """Build its two tables in an order that depends on the process, as iterating a set of strings does."""

    def __init__(self):
        super().__init__()
        self.full, self.sliding, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        order = ["full", "sliding"] if torch.distributed.get_rank() == 0 else ["sliding", "full"]
        tables = {kind: torch.tanh(getattr(self, kind)(x)) for kind in order}
        return self.out(tables["full"] + 2 * tables["sliding"])


class RankDiffers(RankOrdered):
    """Compute another value on rank 1: a graph no renaming matches."""

    def forward(self, x):
        act = torch.tanh if torch.distributed.get_rank() == 0 else torch.sigmoid
        return self.out(act(self.full(x)) + 2 * act(self.sliding(x)))


def graph_differs(rank, world, schedule):
    """Traces in another order take rank 0's names and equal eager; a trace of other values is refused."""
    fxpipe.init_distributed()  # the models read their rank
    torch.manual_seed(0)
    tracer = "export" if schedule == "gpipe" else "fx"
    res, _ = _check_step(rank, world, RankOrdered(), torch.randn(4, 8), torch.randn(4, 8), F.mse_loss, chunks=2,
                         schedule=schedule, tracer=tracer)
    try:
        fxpipe.compile(RankDiffers(), world, example_inputs=(torch.randn(4, 8),), runtime="distributed", timeout=60,
                       schedule=schedule, tracer=tracer)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        res["refused"] = [type(exc).__name__, str(exc)]
    return res


def values(rank, world, schedule):
    """Values of every kind across a boundary, each model, cut and schedule: pipe(x) and pipe.step."""
    results = {}
    for label, make, shape, tracer, split in [
            ("carrier fx dict", Carrier, (7, 8), "fx", ["getitem"]),
            ("carrier fx items", Carrier, (7, 8), "fx", ["b"]),
            ("carrier export", Carrier, (7, 8), "export", ["b"]),
            ("attention fx", AttnBlock, (4, 5, 8), "fx", ["getitem"]),
            ("attention export", AttnBlock, (4, 5, 8), "export", ["out"]),
            ("complex fx", Spectral, (6, 8), "fx", ["getattr_1"]),
            ("complex conj fx", lambda: Spectral(conj=True), (6, 8), "fx", ["getattr_1"])]:
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


class _Layout(nn.Module):
    """Record whether each input it sees is channels-last (a leaf module)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.is_contiguous(memory_format=torch.channels_last))
        return x


class _ChannelsLast(nn.Module):
    """A convolution stack, its activations channels-last, with a skip across the cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.probe = _Layout()

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(self.probe(h))) + h).mean((2, 3))


def channels_last(rank, world, schedule):
    """A channels-last activation crossing ranks arrives channels-last; its gradient goes back so."""
    results = {}
    for schedule in ("gpipe", "1f1b", "zb"):
        torch.manual_seed(0)
        model = _ChannelsLast().to(memory_format=torch.channels_last)
        x = torch.randn(6, 3, 8, 8).to(memory_format=torch.channels_last)
        res, pipe = _check_step(rank, world, model, x, torch.randn(6, 4), F.mse_loss, chunks=3,
                                schedule=schedule, split_points=["probe"], leaf_modules=[_Layout])
        results[schedule] = {"loss_error": res["loss_error"], "grad_errors": res["grad_errors"],
                             "seen": model.probe.seen if rank == 1 else None}
    return {"cases": results}


class _Recording(WeightSource):
    """A weights source that records the keys it reads."""

    def __init__(self, path):
        self.inner = open_weights(path)
        self.description = self.inner.description
        self.keys: list[str] = []

    def specs(self):
        return self.inner.specs()

    def read(self, into):
        self.keys += list(into)
        self.inner.read(into)


def _meta_step(rank, world, factory, reference, x, target, loss_fn, example=None, **kw):
    """Compile ``factory()`` built on meta; compare loss and this rank's gradients with ``reference``."""
    with torch.device("meta"):
        model = factory()
    expected = loss_fn(reference(x), target)
    expected.backward()
    example = x if example is None else example
    pipe = fxpipe.compile(model, world, example_inputs=(example,), runtime="distributed", timeout=60, **kw)
    held = {id(t) for t in (*pipe.stages[rank].parameters(), *pipe.stages[rank].buffers())}
    tensors = dict(model.state_dict(keep_vars=True))
    wrong = [n for n, t in tensors.items() if t.is_meta == (id(t) in held)]  # held real, the rest meta
    loss = pipe.step(x if rank == 0 else None, target=target, loss_fn=loss_fn)
    grads = dict(reference.named_parameters(remove_duplicate=False))
    errors = {name: max_relative_error(p.grad, grads[name].grad)
              for name, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    own = pipe.state_dict()
    pipe.load_state_dict({**reference.state_dict(), **own})  # every rank's FQNs: its own loaded, the others' ignored
    buffers = dict(reference.named_buffers())
    buffer_errors = {name: max_relative_error(b.double(), buffers[name].double())
                     for name, b in model.named_buffers() if id(b) in held}
    try:  # the model itself, half on meta here: refused naming the pipe (torch's bare meta-device error before)
        model(x)
        called = "ran"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        called = f"{type(exc).__name__}: {exc}"
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": errors, "wrong": wrong,
            "owned": sorted(own), "all": sorted(tensors), "buffer_errors": buffer_errors, "called": called}


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

    source = _Recording(path)
    b = _meta_step(rank, world, TiedTransformer, tied_ref, tokens, target, token_loss, chunks=3,
                   schedule=schedule, weights=source)
    cnn_ref = fxpipe.materialize(_on_meta(CNN), seed=2)  # batch norms: running statistics as eager's
    x, target = torch.randn(6, 3, 8, 8), torch.randn(6, 5)
    c = _meta_step(rank, world, CNN, cnn_ref, x, target, F.mse_loss, chunks=1, schedule=schedule, seed=2,
                   deferred_batch_norm=True)
    return {"unet": a, "tied": b, "cnn": c, "read": source.keys, "missing": _refusal(path, rank, world),
            "one_rank_path": _path_on_rank_0(path, rank, world)}


def _path_on_rank_0(path, rank, world):
    """Compile with a weights= path that only rank 0 sees (a node's local disk); return the error and its seconds."""
    import time

    with torch.device("meta"):
        model = TiedTransformer()
    start = time.monotonic()
    try:
        fxpipe.compile(model, world, example_inputs=(torch.randint(0, 32, (7, 8)),), runtime="distributed",
                       timeout=60, weights=path if rank == 0 else path + ".elsewhere")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, str(exc), time.monotonic() - start]
    return None


def deferred(rank, world, schedule):
    """A decoder built under fxpipe.deferred_init(): each rank replays its stage's recipes only."""
    with fxpipe.deferred_init():
        model = RopeDecoder()
    with fxpipe.deferred_init():
        reference = RopeDecoder()
    fxpipe.materialize(reference, seed=3)
    ids = torch.randint(1, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
    pipe = fxpipe.compile(model, world, example_inputs=(ids,), runtime="distributed", timeout=60, chunks=2,
                          schedule=schedule, seed=3)
    held = {id(t) for t in (*pipe.stages[rank].parameters(), *pipe.stages[rank].buffers())}
    every = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    wrong = [n for n, t in every.items() if t.is_meta == (id(t) in held)]  # held real, the rest meta
    torch.save({n: t.detach() for n, t in every.items() if not t.is_meta},
               os.path.join(os.environ["FXPIPE_TEST_DIR"], f"deferred{rank}.pt"))
    loss = pipe.step(ids if rank == 0 else None, target=target, loss_fn=token_loss)
    expected = token_loss(reference(ids), target)
    expected.backward()
    grads = dict(reference.named_parameters(remove_duplicate=False))
    errors = {name: max_relative_error(p.grad, grads[name].grad)
              for name, p in model.named_parameters(remove_duplicate=False) if id(p) in held}
    return {"wrong": wrong, "loss_error": max_relative_error(loss, expected), "grad_errors": errors}


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


def dropnet_pipe(n_stages, split_points=None):
    """Return a DropNet, its pipe in one process (chunks=2) and an Adam over it."""
    torch.manual_seed(0)
    model = DropNet()
    pipe = fxpipe.compile(model, n_stages, example_inputs=(batch(0)[0],), chunks=2, split_points=split_points)
    return model, pipe, torch.optim.Adam(pipe.parameters(), lr=1e-3)


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
    try:  # every rank refuses an extra= it cannot write, none waits for rank 0
        fxpipe.save(pipe, os.path.join(out, "bad"), extra=object())
    except TypeError as exc:
        refused = str(exc)
    # only rank 1's optimizer is wrong: rank 0 hears of it at once instead of waiting at a barrier
    wrong = torch.optim.Adam([*pipe.parameters(), *([nn.Parameter(torch.zeros(1))] if rank == 1 else [])])
    start = time.monotonic()
    try:
        fxpipe.save(pipe, os.path.join(out, "bad"), optimizer=wrong)
    except fxpipe.CheckpointError as exc:
        told = str(exc)
    return {"own_bytes": own, "refused": refused, "told": told, "told_after": time.monotonic() - start}


def resume_second(rank, world, schedule):
    """New processes: load the checkpoint and run steps 5 to 10."""
    out = os.environ["FXPIPE_TEST_DIR"]
    pipe, opt, losses, extra = train(rank, world, 10, start=5, load=os.path.join(out, "ckpt"))
    torch.save({"losses": losses, **_own(pipe, opt)}, os.path.join(out, f"resumed{rank}.pt"))
    return {"extra": extra}


def sends_let_go(rank, world, schedule):
    """Count how many sent messages a rank holds at most during a step of 8 micro-batches."""
    from fxpipe.runtime.transport.messages import DistTransport

    most = [0]
    send = DistTransport._send

    def counting(self, key, sends, what):
        send(self, key, sends, what)
        most[0] = max(most[0], len(self.sent))

    DistTransport._send = counting
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    x, target = torch.randn(16, 8), torch.randn(16, 8)
    v = 2 if schedule in ("interleaved", "zbv") else 1
    result, _ = _check_step(rank, world, model, x, target, F.mse_loss, stages_per_rank=v, chunks=8,
                            schedule=schedule)
    return {**result, "most_held": most[0]}


def sends_unchanged(rank, world, schedule):
    """An adaLN table added to a one-row stage input: no sent gradient changes before the step ends."""
    from fxpipe.runtime.transport.messages import DistTransport

    sent = []
    send = DistTransport._send

    def keeping(self, key, sends, what):
        sent.extend((t, t.clone()) for t, _, _ in sends)
        send(self, key, sends, what)

    DistTransport._send = keeping
    torch.manual_seed(0)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    result, _ = _check_step(rank, world, AdaLN(), x, target, F.mse_loss, chunks=4, schedule=schedule,
                            split_points=["getitem"])
    return {**result, "changed": sum(not torch.equal(t, kept) for t, kept in sent)}


def marked(rank, world, schedule):
    """torch.distributed.pipelining's markers: pipe_split() and split_spec cut across ranks."""
    from torch.distributed.pipelining import SplitPoint, pipe_split

    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                if i == 2:
                    pipe_split()
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    spec = {"layers.3": SplitPoint.END} if world == 3 else None
    result, _ = _check_step(rank, world, Marked(), x, target, F.mse_loss, chunks=4, schedule=schedule,
                         split_spec=spec)
    model = fxpipe.compile(Marked(), world, split_spec=spec, devices=["cpu"] * world)
    return {**result, "firsts": [s.nodes[0] for s in model.plan.stages]}



def copied(rank, world, schedule):
    """Copy a distributed pipe (refused) and keep an average of the model's weights instead; return both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    try:
        copy.deepcopy(pipe)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    ema = torch.optim.swa_utils.AveragedModel(model)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    ema.update_parameters(model)
    own = [(p, q) for p, q in zip(model.parameters(), ema.module.parameters()) if p.device.type != "meta"]
    return {"refused": refused, "averaged": bool(own) and all(torch.equal(p, q) for p, q in own)}


def on_gpus(case):
    """Run ``case`` letting fxpipe pick the backend (NCCL with CUDA); add what it picked."""
    def run(rank, world, schedule):
        result = case(rank, world, schedule)
        import torch.distributed as dist

        return {**result, "backend": dist.get_backend(), "device": str(torch.cuda.current_device())}
    return run


CASES = {"values": values, "unet": unet, "tied": tied, "unet4": unet4, "tied4": tied4, "shape": shape,
         "raises": raises, "dies": dies, "graph_differs": graph_differs, "unbatched": unbatched, "meta": meta, "deferred": deferred, "resume_first": resume_first, "resume_second": resume_second,
         "marked": marked, "copied": copied, "sends_let_go": sends_let_go, "sends_unchanged": sends_unchanged,
         "unet_nccl": on_gpus(unet), "tied_nccl": on_gpus(tied)}


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
    return {n: max_relative_error(_full(p.grad), grads[n].grad) if p.grad is not None else float("inf") for n, p in held}


def _mlp_pair():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.randn(8, 4), F.mse_loss


def _unet_dp():
    return UNet(depth=2, base=4).eval(), torch.randn(8, 3, 8, 8), torch.randn(8, 2, 8, 8), F.mse_loss


def _tied_dp():
    return TiedTransformer(), torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8)), token_loss


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


def dp_adaln(rank, world, schedule):
    """A one-row micro-batch per replica through an adaLN table: DDP's reduction wrote into t's gradient."""
    schedule, _, chunks = schedule.partition("-")
    make = lambda: (AdaLN(), torch.randn(2 * int(chunks), 8), torch.randn(2 * int(chunks), 4), F.mse_loss)  # noqa: E731
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, make, schedule, chunks=int(chunks),
                                                                       split_points=["getitem"])
    loss = step(xs, ys)
    expected = loss_fn(eager(x), y)
    expected.backward()
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": _grad_errors(held, eager)}


def dp_accumulate(rank, world, schedule):
    """Two steps (the first inside no_sync) equal eager's two backwards; autocast bf16 equals eager's math.

    Two micro-batches per replica: under one autocast around the step, a micro-batch reused an
    earlier one's cached cast of a weight, and FSDP2 dropped the last micro-batch's weight gradient.
    """
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _mlp_pair, schedule, chunks=2,
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
        quarters = [loss_fn(eager(a), b) for a, b in zip(x.split(rows // 2), y.split(rows // 2))]  # the micro-batches
    for q in quarters:
        (q / 4).backward()
    out["autocast_loss_error"] = max_relative_error(got, sum(q.detach() for q in quarters) / 4)
    out["autocast_grad_errors"] = _grad_errors(held, eager)
    float32 = copy.deepcopy(eager)  # the same step without autocast: float32 gradients
    float32.zero_grad()
    loss_fn(float32(x), y).backward()
    out["bf16_vs_fp32"] = max(_grad_errors(held, float32).values())
    return out


def dp_written_then_steps(rank, world, schedule):
    """Parameters written in place after compile (a custom init), then SGD steps: each step's gradients equal eager's.

    Under FSDP2 the first checkpointed forward took the unsharded parameters registered after it
    for writes of the sharded ones before it; the recomputation then put the sharded copies back
    into the unsharded parameters and the second step failed ("data is not allocated yet").
    """
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _mlp_pair, schedule, chunks=2,
                                                                       split_points=["2"])
    with torch.no_grad():
        for p, q in zip(pipe.parameters(), eager.parameters()):
            p.mul_(0.5), q.mul_(0.5)
    ours, theirs = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    errors = []
    for _ in range(3):
        step(xs, ys)
        loss_fn(eager(x), y).backward()
        errors.append(max(_grad_errors(held, eager).values()))
        ours.step(), theirs.step(), ours.zero_grad(), theirs.zero_grad()
    return {"errors": errors}


class _Float64Head(nn.Module):
    """A float64 linear head in a float32 model."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4).double()

    def forward(self, x):
        return self.head(x.double()).float()


def dp_cast(rank, world, schedule):
    """A token model cast to float64 after compile: DDP reduces its float64 gradients (they went unreduced)."""
    def make():
        model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                              nn.Linear(8, 32))
        return model, torch.randint(0, 32, (8, 6)), torch.randint(0, 32, (8, 6)), token_loss

    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, make, schedule, chunks=2,
                                                                       split_points=["3"])
    if schedule.endswith(":shard"):  # FSDP2 gathered the float32 parameters at the first step: a cast is refused
        step(xs, ys)
        model.double()
        try:
            step(xs, ys)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"refused": f"{type(exc).__name__}: {exc}"}
        return {"refused": None}
    model.double(), eager.double()
    step(xs, ys)
    loss_fn(eager(x), y).backward()
    return {"grad_errors": _grad_errors(held, eager)}


def dp_refusals(rank, world, schedule):
    """A layout the world cannot hold; a tie on one rank; replicas with different batch sizes, one replica
    without its inputs, one without its target (each refused on every rank)."""
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
    for label, xs, ys in [("batch", x[:rows] if rank % 2 == 0 else None, y[:rows] if rank % 2 == 1 else None),
                          ("inputs", x[:4] if rank == 0 else None, y[:4]),  # replica 1's first rank has none
                          ("target", x[:4], y[:4] if rank != 3 else None)]:  # nor replica 1's loss rank
        try:
            pipe.step(xs, target=ys, loss_fn=loss_fn)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = f"{type(exc).__name__}: {exc}"
    try:  # an evaluation's short last batch on one replica: padding named, not gradients
        with torch.no_grad():
            pipe(x[:rows] if rank % 2 == 0 else None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["eval_batch"] = f"{type(exc).__name__}: {exc}"
    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 16))
    tied[-1].weight = tied[0].weight  # ZB-V puts the first and the last stage on rank 0
    try:
        fxpipe.compile(tied, 4, example_inputs=(torch.randint(0, 16, (4, 3)),), runtime="distributed",
                       data_parallel=2, stages_per_rank=2, schedule="zbv", chunks=2, timeout=60)
    except ValueError as exc:
        out["tie"] = str(exc)
    ids = torch.randint(0, 16, (4, 3))
    for label, kw in [("sparse shard", dict(data_parallel_shard=True)), ("sparse export", dict(tracer="export"))]:
        torch.manual_seed(0)
        bag = nn.Sequential(nn.Embedding(16, 8, sparse=True), nn.Flatten(), nn.Linear(24, 8))
        try:
            fxpipe.compile(bag, 2, example_inputs=(ids,), runtime="distributed", data_parallel=2, timeout=60, **kw)
        except fxpipe.CompileError as exc:  # on every rank, the ranks without the embedding too
            out[label] = str(exc)
    torch.manual_seed(0)
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).to(memory_format=torch.channels_last)
    try:  # FSDP2 refused its weights on the ranks holding them, naming no fix
        fxpipe.compile(convs, 2, example_inputs=(torch.randn(4, 3, 8, 8),), runtime="distributed", data_parallel=2,
                       data_parallel_shard=True, timeout=60)
    except fxpipe.CompileError as exc:
        out["channels_last shard"] = str(exc)
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _Float64Head())
    try:  # FSDP2 failed at the first step on the ranks holding the float64 head: "uniform original parameter dtype"
        fxpipe.compile(mixed, 2, example_inputs=(x,), runtime="distributed", data_parallel=2,
                       data_parallel_shard=True, timeout=60, split_points=["2"])
    except fxpipe.CompileError as exc:
        out["mixed dtypes shard"] = str(exc)
    torch.manual_seed(0)
    renormed = nn.Sequential(nn.Embedding(16, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxpipe.compile(renormed, 2, example_inputs=(ids,), runtime="distributed", data_parallel=2, timeout=60)
    out["max_norm"] = [str(w.message) for w in caught if "max_norm" in str(w.message)]
    return out


def dp_views(rank, world, schedule):
    """FSDP2 under stages that return views: quiet where fxpipe alone reads the outputs, loud at the last."""
    import warnings

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.Unflatten(1, (4, 4)), nn.Tanh(), nn.Flatten(), nn.Linear(16, 4),
                              nn.Unflatten(1, (2, 2)))
        return model, torch.randn(8, 8), torch.randn(8, 2, 2), F.mse_loss
    pipe, _, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, make, schedule, chunks=2,
                                                                       split_points=["2"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = step(xs, ys)
    expected = loss_fn(eager(x), y)
    expected.backward()
    views = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    return {"loss_error": max_relative_error(loss, expected), "grad_errors": _grad_errors(held, eager),
            "views": len(views), "view_output": pipe.stages[0].code.strip().splitlines()[-1]}


def dp_batch_norm(rank, world, schedule):
    """Batch norm in training under 2 replicas: running statistics equal on both replicas, and with deferred
    batch norm equal to one process running the global batch's micro-batches
    (schedule: 'name:deferred|plain[:shard|:export|:subclass]'; subclass: two of the batch norms are BNAct, whose
    forward fx traces through)."""
    schedule, mode, *more = schedule.split(":")
    shard, tracer = "shard" in more, "export" if "export" in more else "fx"
    torch.manual_seed(0)
    model = CNN().train()
    if "subclass" in more:
        model.bns[0], model.bns[2] = BNAct(8), BNAct(8)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8) * 2 + 1, torch.randint(0, 5, (8,))
    replica, pp_rank = rank // 2, rank % 2
    xs, ys = x[replica * 4:(replica + 1) * 4], y[replica * 4:(replica + 1) * 4]
    pipe = fxpipe.compile(model, 2, example_inputs=(xs,), runtime="distributed", timeout=60, schedule=schedule,
                          chunks=2, data_parallel=2, data_parallel_shard=shard,
                          deferred_batch_norm=mode == "deferred", tracer=tracer)
    pipe.step(xs, target=ys, loss_fn=F.cross_entropy)
    stats = {k: v.tolist() for k, v in pipe.state_dict().items() if "running" in k or "num_batches" in k}
    one = fxpipe.compile(reference, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2, schedule=schedule,
                         deferred_batch_norm=True)  # the global batch's 4 micro-batches in one process
    one.step(x, target=y, loss_fn=F.cross_entropy)
    expected = reference.state_dict()
    errors = {k: max_relative_error(torch.tensor(v), expected[k].to(torch.float64)) for k, v in stats.items()}
    with warnings.catch_warnings(record=True) as seen:  # torch's "copying ... to a meta parameter" for others' norms
        warnings.simplefilter("always")
        pipe.load_state_dict(expected)  # the whole model's: each rank takes what it holds (FSDP2: its shards)
        old = copy.copy(expected)  # as torch before 0.4.1 wrote it: batch norms of version 1, no num_batches_tracked
        old._metadata = {k: {**v, "version": 1} for k, v in expected._metadata.items()}
        for key in [k for k in old if k.endswith("num_batches_tracked")]:
            del old[key]
        pipe.load_state_dict(old, strict=False)
        pipe.load_state_dict(expected)
    loaded = {k: bool(torch.equal(_full(v.detach()), expected[k])) for k, v in pipe.state_dict().items()}
    return {"stats": stats, "errors": errors, "loaded": loaded, "load_warnings": [str(w.message) for w in seen]}


CASES.update(dp_train=dp_train, dp_adaln=dp_adaln, dp_accumulate=dp_accumulate, dp_refusals=dp_refusals, dp_batch_norm=dp_batch_norm,
             dp_views=dp_views)


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
    try:  # torch's own scaler decides alone on each rank: refused before anything runs
        pipe.step(x if rank == 0 else None, target=y if rank == world - 1 else None, loss_fn=loss_fn,
                  scaler=torch.amp.GradScaler("cpu"))
        plain = "ran"
    except TypeError as exc:
        plain = str(exc)
    return {"scale": sc.get_scale(), "skipped": unchanged, "loss": float(loss), "scaled": max(grads_scaled),
            "type": type(sc).__name__, "plain": plain}


CASES.update(scaler=scaler)


def dp_resume(rank, world, schedule):
    """2 replicas x 2 ranks, replicated then sharded: 2 steps, pipe(x), save, load into a fresh pipe, a step equal."""
    out, results = os.environ["FXPIPE_TEST_DIR"], {}
    for shard in (False, True):
        runs = []
        for _ in range(2):  # the trained pipe and a fresh one that loads its checkpoint
            pipe, model, _, _, _, xs, ys, _, step, _ = _dp_setup(rank, world, _mlp_pair, schedule + ":shard" * shard,
                                                                 chunks=2, split_points=["2"])
            runs.append((pipe, model, torch.optim.Adam(pipe.parameters(), lr=1e-2), step))
        pipe, _, opt, step = runs[0]
        for _ in range(2):
            opt.zero_grad()
            step(xs, ys)
            opt.step()
        with torch.no_grad():  # an evaluation: no backward reshards FSDP2's gathered parameters, fxpipe must
            pipe(xs if rank % 2 == 0 else None)
        path = os.path.join(out, f"dp{int(shard)}")
        fxpipe.save(pipe, path, optimizer=opt)
        fxpipe.load(runs[1][0], path, optimizer=runs[1][2])
        for _, _, opt, step in runs:
            opt.zero_grad()
            step(xs, ys)
            opt.step()
        other = dict(runs[1][1].named_parameters())
        results[f"shard{int(shard)}"] = {n: bool(torch.equal(_full(p.detach()), _full(other[n].detach())))
                                         for n, p in runs[0][1].named_parameters() if not p.is_meta}
    return results


CASES.update(dp_resume=dp_resume)


def export_meta(rank, world, schedule):
    """A rotary decoder built on meta, exported (its tensors as fakes on CPU), filled by FQN per rank; examples real or meta."""
    from rotary import RotaryDecoder

    results = {}
    for examples in ("real", "meta"):  # the example inputs given on meta too: exported on CPU, then checked there
        torch.manual_seed(0)
        reference = RotaryDecoder()  # the same weights on every rank
        tokens, target = torch.randint(0, 32, (6, 8)), torch.randint(0, 32, (6, 8))
        results[examples] = _meta_step(rank, world, RotaryDecoder, reference, tokens, target, token_loss, chunks=3,
                                       schedule=schedule, tracer="export", weights=reference.state_dict(),
                                       example=tokens.to(examples if examples == "meta" else "cpu"))
    return results


CASES.update(export_meta=export_meta)


def clip_float64(rank, world, schedule):
    """Clip a float64 model's gradients across ranks; return the norm's dtype and its error against eager's."""
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp_pair()
    model = model.double()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world, example_inputs=(x.double(),), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    pipe.step(x.double(), target=y.double(), loss_fn=loss_fn)
    loss_fn(eager(x.double()), y.double()).backward()
    norm = fxpipe.clip_grad_norm_(pipe, 0.05)
    want = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05)
    return {"dtype": str(norm.dtype), "error": float((norm - want).abs() / want)}


def clip_orders(rank, world, schedule):
    """Take the gradients' norm of orders -inf to inf across ranks; return each one's error against eager's.

    ``SCHEDULE:frozen`` trains the last layer only: the first stage's rank holds no gradient.
    """
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp_pair()
    model = model.double()
    schedule, _, frozen = schedule.partition(":")
    if frozen:
        model[:4].requires_grad_(False)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world, example_inputs=(x.double(),), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    pipe.step(x.double(), target=y.double(), loss_fn=loss_fn)
    loss_fn(eager(x.double()), y.double()).backward()
    errors = {}
    for order in (-float("inf"), -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, float("inf")):
        norm = fxpipe.clip_grad_norm_(pipe, 1e9, norm_type=order)
        want = torch.nn.utils.get_total_norm([p.grad for p in eager.parameters() if p.grad is not None], order)
        errors[str(order)] = float((norm - want).abs() / want)
    return errors


def seeded_per_rank(rank, world, schedule):
    """Build the model from a seed per rank, then from one seed; return the warnings compile gave each time."""
    import warnings

    told = []
    for seed in (rank, 0):
        torch.manual_seed(seed)
        model, x, _, _ = _mlp_pair()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                           schedule=schedule)
        told.append([str(w.message) for w in caught if "other weights" in str(w.message)])
    return {"per_rank": told[0], "alike": told[1]}


def loop_out_of_step(rank, world, schedule):
    """Give every rank the inputs and targets, the last rank one batch ahead at the second step; return what each raised."""
    torch.manual_seed(0)
    model, _, _, loss_fn = _mlp_pair()
    batches = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]
    pipe = fxpipe.compile(model, world, example_inputs=(batches[0][0],), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    pipe.step(*batches[0][:1], target=batches[0][1], loss_fn=loss_fn)
    x, y = batches[2] if rank == world - 1 else batches[1]
    try:
        pipe.step(x, target=y, loss_fn=loss_fn)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - what the rank was told
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised}


def same_batch_target_masked(rank, world, schedule):
    """Reuse one batch for 3 steps whose loss_fn masks its target in place, every rank given the loader's tuple.

    Return the losses against eager's and what each rank raised (nothing: neither is out of step).
    """
    torch.manual_seed(0)
    model, x, y, _ = _mlp_pair()
    model = model.double()
    x, y = x.double(), y.double()
    eager = copy.deepcopy(model)

    def loss_fn(out, t):
        t[t > 1.5] = 0.0  # masking labels in place: the last rank's target changes, the first's does not
        return torch.nn.functional.mse_loss(out, t)

    per_rank = 2 if schedule in ("zbv", "interleaved") else 1  # ZB-V: the first rank computes the loss
    pipe = fxpipe.compile(model, world * per_rank, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, stages_per_rank=per_rank)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    mine, theirs = y.clone(), y.clone()
    errors, raised = [], ""
    try:
        for _ in range(3):
            args = (x,) if rank == 0 else (x, mine)  # the loader's whole tuple on the other ranks
            loss = pipe.step(*args, target=mine, loss_fn=loss_fn)
            opt.step()
            opt.zero_grad()
            want = loss_fn(eager(x), theirs)
            want.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            errors.append(float((loss - want).abs()))
    except Exception as exc:  # noqa: BLE001 - what the rank was told
        raised = f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "raised": raised}


def meta_placeholders(rank, world, schedule):
    """Pass the inputs on meta on the ranks past the first, and the target on meta on the ranks before the last.

    Return the step's loss and the call's output against eager's (those ranks read neither), and what a meta
    target on the loss's rank raised.
    """
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp_pair()
    with torch.no_grad():
        eager_out = copy.deepcopy(model)(x)
    want = loss_fn(eager_out, y)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    first, last = rank == 0, rank == world - 1
    loss = pipe.step(x if first else x.to("meta"), target=y if last else y.to("meta"), loss_fn=loss_fn)
    with torch.no_grad():
        out = pipe(x if first else x.to("meta"))
    raised = ""
    try:
        pipe.step(x if first else x.to("meta"), target=y.to("meta"), loss_fn=loss_fn)
    except Exception as exc:  # noqa: BLE001 - what the rank was told
        raised = f"{type(exc).__name__}: {exc}"
    return {"error": float((loss.detach() - want).abs()), "raised": raised,
            "out": None if out is None else float((out - eager_out).abs().max())}


def forward_to_train(rank, world, schedule):
    """Call pipe(x) in training mode with grad on, twice, then under no_grad; return the warnings each call gave."""
    import warnings

    torch.manual_seed(0)
    model, x, _, _ = _mlp_pair()
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    told = []
    for grad in (True, True, False):
        with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(grad):
            warnings.simplefilter("always")
            pipe(x)
        told.append([str(w.message) for w in caught if "forwards only" in str(w.message)])
    return {"told": told}


def reductions_differ(rank, world, schedule):
    """Pass loss_reduction='sum' on the first rank (replica, with ':dp') only; return what each rank raised, then
    a plain step's loss against eager's on the same batch."""
    schedule, _, dp = schedule.partition(":")
    torch.manual_seed(0)
    model, x, y, _ = _mlp_pair()
    loss_fn = partial(F.mse_loss, reduction="sum")
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world // 2 if dp else world, example_inputs=(x,), chunks=2, runtime="distributed",
                          timeout=60, schedule=schedule, data_parallel=2 if dp else 1)
    first = fxpipe.data_shard(pipe)[1] == 0 if dp else rank == 0
    try:
        pipe.step(x, target=y, loss_fn=loss_fn, loss_reduction="sum" if first else "mean")
        raised = ""
    except Exception as exc:  # noqa: BLE001 - what the rank was told
        raised = f"{type(exc).__name__}: {exc}"
    model.zero_grad()
    loss = pipe.step(x, target=y, loss_fn=loss_fn, loss_reduction="sum")
    return {"raised": raised, "error": float((loss - loss_fn(eager(x), y)).abs())}


def nan_buffer_alike(rank, world, schedule):
    """Build a model holding a NaN buffer alike on every rank; return the weights warnings compile gave."""
    import warnings

    torch.manual_seed(0)
    model, x, _, _ = _mlp_pair()
    model.register_buffer("unset", torch.full((4,), float("nan")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                       schedule=schedule)
    return {"told": [str(w.message) for w in caught if "other weights" in str(w.message)]}


def clip_nan(rank, world, schedule):
    """Put a NaN in one gradient on the last rank; return the inf-norm each rank gets and whether it refused."""
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp_pair()
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule)
    pipe.step(x, target=y, loss_fn=loss_fn)
    if rank == world - 1:
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    norm = fxpipe.clip_grad_norm_(pipe, 1.0, norm_type=float("inf"))
    try:
        fxpipe.clip_grad_norm_(pipe, 1.0, norm_type=float("inf"), error_if_nonfinite=True)
        refused = False
    except RuntimeError:
        refused = True
    return {"nan": bool(norm.isnan()), "refused": refused}


class _ActNorm(nn.BatchNorm2d):
    """A batch norm subclass with its activation (timm's BatchNormAct2d): fx traces through its forward."""

    def forward(self, x):
        return torch.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                       self.training, self.momentum, self.eps))


def replica_norms(rank, world, schedule):
    """Train pp2 x dp2 a step without deferral; return each held norm buffer's values and this rank's replica."""
    tracer = schedule.partition(":")[2] or "fx"
    torch.manual_seed(0)
    widths = [3, 4, 5, 6, 7, 8, 9]  # three norms of other sizes per stage: their order must not be the hash's
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Conv2d(a, b, 3, padding=1), _ActNorm(b))]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(9, 4))
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x[:4],), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule.partition(":")[0], data_parallel=2, split_points=["6"], tracer=tracer)
    _, replica = fxpipe.data_shard(pipe)
    rows = slice(replica * 4, replica * 4 + 4)
    pipe.step(x[rows], target=y[rows], loss_fn=F.cross_entropy)
    stats = {name: b.tolist() for name, b in model.named_buffers() if b.device.type != "meta" and "running" in name}
    return {"replica": replica, "stats": stats}


class _Queued(nn.Module):
    """Keep a queue of the last rows' features, enqueued in place in the forward (MoCo's keys), and a step counter."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 4)
        self.register_buffer("queue", torch.zeros(16, 4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.centre = nn.Parameter(torch.zeros(4), requires_grad=False)  # DINO's centre kept as a parameter

    def forward(self, x):
        z = self.head(self.body(x))
        with torch.no_grad():
            self.queue.copy_(torch.cat([z.detach(), self.queue])[:16])
            self.steps.add_(1)
            self.centre.mul_(0.5).add_(0.5 * z.mean(0))
        return z + self.queue.mean() - self.centre


def replica_written_buffers(rank, world, schedule):
    """Train pp2 x dp2 two steps of a model writing buffers; return the written buffers' values and the replica."""
    schedule, _, tracer = schedule.partition(":")
    torch.manual_seed(0)
    model, x, y = _Queued(), torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x[:4],), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, data_parallel=2, tracer=tracer or "fx", split_points=["head"])
    _, replica = fxpipe.data_shard(pipe)
    rows = slice(replica * 4, replica * 4 + 4)
    for _ in range(2):
        pipe.step(x[rows], target=y[rows], loss_fn=F.mse_loss)
    held = {name: b.tolist() for name, b in [*model.named_buffers(), ("centre", model.centre)]
            if b.device.type != "meta"}
    try:  # refused where a sharded stage writes it; a stage frozen whole is not sharded, and runs
        torch.manual_seed(0)
        again = fxpipe.compile(_Queued(), 2, example_inputs=(x[:4],), chunks=2, runtime="distributed", timeout=60,
                               schedule=schedule, data_parallel=2, data_parallel_shard=True, tracer=tracer or "fx",
                               split_points=["head"])
        again.step(x[rows], target=y[rows], loss_fn=F.mse_loss)
        sharded = ""
    except Exception as exc:  # noqa: BLE001 - the refusal each rank gave
        sharded = f"{type(exc).__name__}: {exc}"
    return {"replica": replica, "held": held, "sharded": sharded}


def _held_error(pipe, rank, model, eager):
    """Return the largest relative error of the gradients of the parameters this rank's stages hold."""
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    return max(max_relative_error(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())
               if id(p) in held)


def _compile_refused(model, example, schedule, **kw):
    """Compile across ranks; return ``[type, message]`` of its refusal, or ``["returned", ""]``."""
    try:
        fxpipe.compile(model, 2, example_inputs=example, runtime="distributed", timeout=60, schedule=schedule, **kw)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, str(exc)]
    return ["returned", ""]


def packed_sequences(rank, world, schedule):
    """A cut after the unpacking trains as eager; values sized by the inputs' values sent between ranks are refused.

    So are a packed sequence, rows a mask picks, rows pooled by a count the values give (with one
    micro-batch too), quantized modules, and a generator input read on the second rank.
    """
    torch.manual_seed(0)
    x, lengths, y = torch.randn(6, 5, 8), torch.tensor([5, 2, 4, 3, 5, 1]), torch.randn(6, 5, 4)
    base = PackedLSTM()
    eager = copy.deepcopy(base)
    F.mse_loss(eager(x, lengths), y).backward()
    out = {}
    for cut in ("head", "rnn2"):
        model = copy.deepcopy(base)  # a model compiled across ranks is not compiled again
        try:
            pipe = fxpipe.compile(model, 2, example_inputs=(x, lengths), chunks=3, runtime="distributed", timeout=60,
                                  schedule=schedule, split_points=[cut], leaf_modules=(Pack, Unpack))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[cut] = [type(exc).__name__, str(exc)]
            continue
        pipe.step(x, lengths, target=y, loss_fn=F.mse_loss)
        out[cut] = _held_error(pipe, rank, model, eager)
    ids, want = torch.randn(8, 8), torch.randn(8, 4)
    for key, chunks in (("scattered", 2), ("scattered_one", 1)):  # nonzero's rows put back in the batch's
        base = Scattered()
        eager = copy.deepcopy(base)
        F.mse_loss(eager(ids), want).backward()
        pipe = fxpipe.compile(base, 2, example_inputs=(ids,), chunks=chunks, runtime="distributed", timeout=60,
                              schedule=schedule, split_points=["b"])
        pipe.step(ids, target=want, loss_fn=F.mse_loss)
        out[key] = _held_error(pipe, rank, base, eager)
    out["masked"] = _compile_refused(Masked(), (torch.randn(8, 8),), schedule, chunks=2, split_points=["b"])
    # one row per graph, as many as batch.max() + 1 says, sent on with one micro-batch
    out["pooled"] = _compile_refused(Pooled(), (torch.randn(12, 8), torch.arange(12) // 3), schedule, chunks=1,
                                     split_points=["mid"])
    quantized = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
                                                       {nn.Linear}, dtype=torch.qint8)
    # no fake kernels to size the values crossing: torch's QuantizedMeta error at the first call
    out["quantized"] = _compile_refused(quantized, (torch.randn(6, 8),), schedule)
    x, want, gen = torch.randn(6, 8), torch.randn(6, 4), torch.Generator()
    for cut in ("full_like", "b"):  # a generator input read on the second rank (refused), on the first (replayed)
        base = Drawn()
        eager = copy.deepcopy(base)
        try:
            pipe = fxpipe.compile(base, 2, example_inputs=(x, gen), chunks=2, runtime="distributed", timeout=60,
                                  schedule=schedule, split_points=[cut], checkpoint="always")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["generator_" + cut] = [type(exc).__name__, str(exc)]
            continue
        gen.manual_seed(3)
        pipe.step(x, gen, target=want, loss_fn=F.mse_loss)
        gen.manual_seed(3)
        for xs, ys in zip(x.tensor_split(2), want.tensor_split(2)):
            (F.mse_loss(eager(xs, gen), ys) / 2).backward()
        out["generator_" + cut] = _held_error(pipe, rank, base, eager)
    return out


class Drawn(nn.Module):
    """A mask drawn from a generator the caller passes in, between ``a`` and ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, gen):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h * torch.bernoulli(torch.full_like(h, 0.6), generator=gen)))
        return self.c(h)


class Pooled(nn.Module):
    """Nodes pooled per graph into ``batch.max() + 1`` rows (a count the values give), read on the next stage."""

    def __init__(self):
        super().__init__()
        self.a, self.mid, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 2)

    def forward(self, x, batch):
        h = torch.relu(self.a(x))
        g = h.new_zeros(batch.max() + 1, h.shape[1]).index_add_(0, batch, h)
        return self.out(torch.cat([h, torch.relu(self.mid(g))[batch]], 1))


class Scattered(nn.Module):
    """Rows nonzero picks, transformed and added back into the batch's rows (every value crossing has B rows)."""

    def __init__(self):
        super().__init__()
        self.a, self.e, self.b, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        idx = torch.nonzero(h[:, 0] > 0).squeeze(1)
        h = h + torch.zeros_like(h).index_add(0, idx, self.e(h[idx]))
        return self.d(torch.relu(self.b(h)))


class Masked(nn.Module):
    """The rows of the input a mask picks, summed on the next stage (their count follows the values)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        picked = x[x[:, 0] > 0]
        return self.d(self.a(x) + self.b(picked).sum(0, keepdim=True))


class PaddedEncoder(nn.Module):
    """An embedding, PyTorch's TransformerEncoder over padded rows (its nested-tensor fast path), a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 4)

    def forward(self, ids, pad):
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=pad))


def nested_fast_path(rank, world, schedule):
    """Infer under no_grad through an encoder whose fast path makes nested tensors; return the error to eager's."""
    torch.manual_seed(0)
    ids, pad = torch.randint(0, 50, (6, 7)), torch.zeros(6, 7, dtype=torch.bool)
    pad[1, 5:] = True
    model = PaddedEncoder()
    eager = copy.deepcopy(model).eval()
    pipe = fxpipe.compile(model, 2, example_inputs=(ids, pad), chunks=3, runtime="distributed", timeout=60,
                          schedule=schedule)
    pipe.eval()
    with torch.no_grad():
        out, want = pipe(ids, pad), eager(ids, pad)
    return {"error": None if out is None else float((out - want).abs().max())}


def prewrapped(rank, world, schedule):
    """A model given to compile after fully_shard (FSDP2) or parallelize_module: refused on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    refused = {}
    for label, wrap in (("fsdp2 root", fully_shard), ("fsdp2 inner", lambda m: fully_shard(m[0], mesh=mesh)),
                        ("tensor parallel", lambda m: parallelize_module(m, mesh, {"0": ColwiseParallel()}))):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        wrap(model)
        try:
            fxpipe.compile(model, world, example_inputs=(torch.randn(4, 8),), runtime="distributed", timeout=30)
            refused[label] = ["returned", ""]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            refused[label] = [type(exc).__name__, str(exc)]
    return {"refused": refused}
