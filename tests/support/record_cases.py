"""What each rank runs in the tests of output structures across ranks: records, batch-independent outputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


@dataclass
class Out:
    logits: torch.Tensor


@dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.l(x))
        return Pair(h, h * 2)


class Crosses(nn.Module):
    """A record crossing the rank boundary (Enc's), and one returned (Out)."""

    def __init__(self):
        super().__init__()
        self.enc, self.blocks = Enc(), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        p = self.enc(x)
        return Out(self.blocks(p.a) + p.b[:, :4])


def records(rank, world, schedule):
    """Train a step and infer once; return the errors against eager on this rank."""
    torch.manual_seed(0)
    model = Crosses()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss_fn = lambda out, t: F.mse_loss(out.logits, t)  # noqa: E731
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=3, runtime="distributed", timeout=60,
                          schedule=schedule, leaf_modules=[Enc], split_points=["blocks"])
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(eager(x), y)
    expected.backward()
    held = dict(eager.named_parameters())
    grads = [max_relative_error(p.grad, held[n].grad) for n, p in model.named_parameters() if p.device.type != "meta"]
    with torch.no_grad():
        out = pipe(x)
    return {"loss": max_relative_error(loss, expected), "grads": max(grads),
            "out": None if out is None else [type(out).__name__, max_relative_error(out.logits, eager(x).logits)]}


class Tempered(nn.Module):
    """Logits and a learned temperature that no row changes (a CLIP-like logit scale)."""

    def __init__(self, shape=()):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.full(shape, 0.5))

    def forward(self, x):
        return {"logits": self.b(torch.tanh(self.a(x))), "scale": self.scale.exp()}


def independent(rank, world, schedule):
    """Infer, then train a step on the temperature; return the errors against eager on this rank."""
    torch.manual_seed(0)
    model = Tempered()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss_fn = lambda out, t: F.mse_loss(out["logits"] * out["scale"], t)  # noqa: E731
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=3, runtime="distributed", timeout=60,
                          schedule=schedule)
    with torch.no_grad():
        out, want = pipe(x), eager(x)
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(eager(x), y)
    expected.backward()
    held = dict(eager.named_parameters())
    grads = [max_relative_error(p.grad, held[n].grad) for n, p in model.named_parameters() if p.device.type != "meta"]
    return {"loss": max_relative_error(loss, expected), "grads": max(grads),
            "out": None if out is None else [max_relative_error(out[k], want[k]) for k in ("logits", "scale")]}
