"""Small models for the tests, each with a factory returning (model, args, kwargs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transformer import GPT  # examples/, put on sys.path by conftest
from unet import UNet


class MLP(nn.Module):
    """Six linear layers with ReLU."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(6)])

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class CNN(nn.Module):
    """Three conv-BN-ReLU blocks, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(8) for _ in range(3)])
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = F.adaptive_avg_pool2d(x, 4)
        return self.fc(torch.flatten(x, 1))


class Inception(nn.Module):
    """Four parallel branches merged by concatenation."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, 2, 1), nn.ReLU(), nn.Conv2d(2, 4, 5, padding=2))
        self.pool = nn.Conv2d(cin, 4, 1)

    def forward(self, x):
        pooled = self.pool(F.max_pool2d(x, 3, stride=1, padding=1))
        return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), pooled], dim=1))


class InceptionNet(nn.Module):
    """A stem, two inception blocks and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([Inception(8), Inception(16)])
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def TiedTransformer() -> GPT:
    """Return a small decoder whose output projection shares the input embedding's weight."""
    return GPT(vocab=32, d=16, layers=3, heads=2, seq=8)


def token_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Return the mean cross-entropy over every token (TiedTransformer's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


class MultiIO(nn.Module):
    """Two positional tensors, a keyword tensor, a float argument; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(4, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)
        self.e = nn.Linear(8, 2)

    def forward(self, x, y, *, mask, scale: float = 1.0):
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(y))
        h = torch.relu(self.c(h)) * mask
        main = self.d(h) * scale
        return {"main": main, "aux": (self.e(h), x.sum(dim=1) * scale)}


class Mixed(nn.Module):
    """Return a value of every kind; as a leaf module its output is one node of the fx graph."""

    def forward(self, h):
        return {"out": h, "none": None, "scale": 2.0, "shift": 1, "approx": "tanh",
                "nested": (None, {"idx": h.argmax(-1), "mask": (h > 0).detach(), "const": h.detach() * 2}),
                "pair": (h * 2, 0.5)}


class Carrier(nn.Module):
    """Unpack every value of :class:`Mixed` before ``b`` and use it after: each may cross a cut.

    Cut right after ``mixed`` (fx), the whole dict crosses; cut at ``b``, each value crosses on
    its own: ``None``, a float, an int, a string, nested tuples and dicts, an integer tensor, a
    bool and a float tensor without grad, the micro-batch's row count.
    """

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.mixed = Mixed()

    def forward(self, x):
        v = self.mixed(torch.tanh(self.a(x)))
        out, none, scale, shift, approx = v["out"], v["none"], v["scale"], v["shift"], v["approx"]
        nested, pair = v["nested"], v["pair"]
        idx, mask, const = nested[1]["idx"], nested[1]["mask"], nested[1]["const"]
        rows, width = x.shape[0], x.shape[-1]
        h = F.gelu(self.b(out) * scale, approximate=approx)
        h = torch.roll(torch.clamp(h, min=none, max=width), shifts=shift, dims=-1)
        h = h + F.one_hot(idx, width).to(h.dtype) + torch.where(mask, const, -const)
        h = h.reshape(rows, -1) + pair[0] * pair[1]
        return self.c(h), nested[0], approx


class AttnBlock(nn.Module):
    """``nn.MultiheadAttention(need_weights=False)`` returns ``(out, None)``: a tuple with a None."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        a = self.attn(h, h, h, need_weights=False)
        return self.out(a[0] + h)


def mlp():
    """Return an MLP and its inputs."""
    return MLP(), (torch.randn(7, 16),), {}


def cnn():
    """Return a CNN with batch norm (eval mode) and its inputs."""
    return CNN().eval(), (torch.randn(7, 3, 8, 8),), {}


def unet():
    """Return a U-Net (eval mode for batch norm) and its inputs."""
    return UNet(depth=3, base=4).eval(), (torch.randn(7, 3, 16, 16),), {}


def inception():
    """Return an Inception-style model and its inputs."""
    return InceptionNet(), (torch.randn(7, 3, 8, 8),), {}


def transformer():
    """Return a transformer with tied embeddings and its inputs."""
    return TiedTransformer(), (torch.randint(0, 32, (7, 8)),), {}


def multi_io():
    """Return a several-input, dict-output model and its inputs."""
    return MultiIO(), (torch.randn(7, 6), torch.randn(7, 4)), {"mask": torch.rand(7, 8), "scale": 0.5}


FACTORIES = {"mlp": mlp, "cnn": cnn, "unet": unet, "inception": inception,
             "transformer": transformer, "multi_io": multi_io}
