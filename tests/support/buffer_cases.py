"""What each test of buffers read by later stages runs: a step counter bumped in stage 0 and read at the end."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


class Counted(nn.Module):
    """Bump a step counter first, scale early by it, and scale the output by it again at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step.add_(1)
        h = torch.relu(self.a(x)) * (1 + 0.01 * self.step)
        h = torch.relu(self.c(torch.relu(self.b(h))))
        return self.d(h) * (1 + self.step)


class ReadFirst(nn.Module):
    """Read a counter in the first layer, bump it in the last: each micro-batch should see the previous one's bump."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        h = self.a(x) * (1 + self.seen)
        out = self.b(torch.relu(h))
        self.seen.add_(1)
        return out


def per_micro_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> float:
    """Run eager on the micro-batches one after another (each updates the counter once); return the loss."""
    total = 0.0
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        loss = F.cross_entropy(model(xs), ys) / chunks
        loss.backward()
        total += loss.item()
    return total


def counted(rank, world, schedule):
    """Train two steps of :class:`Counted`; return the loss and gradient errors against eager per micro-batch."""
    v = 2 if schedule in ("interleaved", "zbv") else 1
    torch.manual_seed(0)
    model = Counted()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    pipe = fxpipe.compile(model, world * v, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, stages_per_rank=v, checkpoint="always")
    errors, losses = [], []
    for _ in range(2):
        loss = pipe.step(x, target=y, loss_fn=F.cross_entropy)
        want = per_micro_batch(eager, x, y, 2)
        if loss is not None:
            losses.append(abs(float(loss) - want) / want)
    held = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        if p.device.type != "meta" and p.grad is not None:
            errors.append(max_relative_error(p.grad, held[name].grad))
    return {"errors": errors, "losses": losses, "skips": [(r.name, r.src, r.dst) for r in pipe.plan.skips]}


class Scaled(nn.Module):
    """Grow a scale in place, then multiply by it in the same stage: backward needs the value as written."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        self.scale.mul_(1.1)
        return self.b(torch.tanh(self.a(x)) * self.scale)


class Normalized(nn.Module):
    """Update a running mean and a count in one no_grad block (an observation normalizer); read the mean later."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("mean", torch.zeros(16))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.mean.copy_(0.5 * self.mean + 0.5 * x.mean(0))
            self.count.add_(1)
        return self.b(torch.tanh(self.a(x))) * (1 + self.mean[:4])


class Chained(nn.Module):
    """Update an EMA with chained in-place ops in a no_grad block (a VQ codebook's); read it in a later layer.

    ``via_data``: through ``self.ema.data`` (older MoCo and VQ-VAE code).
    """

    def __init__(self, via_data: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("ema", torch.ones(16))
        self.via_data = via_data

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            (self.ema.data if self.via_data else self.ema).mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.b(h * self.ema)


class Centered(nn.Module):
    """Read a center, then update it by EMA in a no_grad block (DINO's centering): in the stage that reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("center", torch.zeros(1, 4))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        out = h - self.center
        with torch.no_grad():
            self.center.mul_(0.5).add_(0.5 * h.mean(0, keepdim=True))
        return out


class SharedNorm(nn.Module):
    """Call one batch norm in the first and the last layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.c(self.bn(self.b(torch.relu(self.bn(self.a(x))))))


class SliceSet(nn.Module):
    """Update part of a buffer by slice assignment in a no_grad block, read it after (in the same stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("ema", torch.ones(16))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            self.ema[:8] = self.ema[:8] * 0.5 + h.mean(0)[:8]
        return self.c(torch.tanh(self.b(h)) * self.ema)


class Graph(nn.Module):
    """A graph convolution over a sparse adjacency buffer, beside a dense scale written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
        self.register_buffer("adj", torch.sparse_coo_tensor(edges, torch.rand(4), (16, 16)).coalesce())
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        self.scale.mul_(1.1)
        h = torch.sparse.mm(self.adj, torch.tanh(self.a(x)).t()).t()
        return self.head(torch.tanh(self.mid(h)) * self.scale)


def sparse_buffer(rank, world, schedule):
    """Train two steps of :class:`Graph` on two ranks (compile fingerprinted the sparse buffer with reshape)."""
    torch.manual_seed(0)
    model = Graph()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, split_points=["mid"], checkpoint="always")
    losses = []
    for _ in range(2):
        model.zero_grad()
        eager.zero_grad()
        loss = pipe.step(x, target=y, loss_fn=F.cross_entropy)
        want = per_micro_batch(eager, x, y, 2)
        losses.append(abs(float(loss) - want) / want)
    held = dict(eager.named_parameters())
    errors = [max_relative_error(p.grad, held[n].grad) for n, p in model.named_parameters()
              if p.device.type != "meta"]
    return {"errors": errors, "losses": losses}
