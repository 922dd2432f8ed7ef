"""What each rank runs in the tests of parameters the loss does not reach: None, as eager leaves them."""

from __future__ import annotations

import collections
import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


class Sided(nn.Module):
    """A main path the loss reads, and a side output made early (``scale``) and late (``tail``) it ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.scale = nn.Parameter(torch.full((1,), 2.0))
        self.tail = nn.Parameter(torch.full((1,), 3.0))

    def forward(self, x):
        h = self.a(x)
        side = h * self.scale
        h = self.d(self.c(self.b(h)))
        return {"main": h, "side": side + h * self.tail}


class Headed(nn.Module):
    """An auxiliary head made in stage 0 and returned beside the main output: the first output the loss ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.ha = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h0 = self.l0(x)
        a = self.ha(h0)
        h2 = self.l2(self.l1(h0))
        return {"main": h2, "aux": a + h2}


Outputs = collections.namedtuple("Outputs", ["logits", "aux"])  # torchvision's GoogLeNetOutputs


class AuxInTraining(nn.Module):
    """Return the logits and an auxiliary head in a namedtuple in training, the logits alone in eval (GoogLeNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head, self.aux = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))
        aux = self.aux(h)
        if self.training:
            return Outputs(self.head(h), aux)
        return self.head(h)


def logits_only(out, target):
    """Return a cross-entropy of the logits, ignoring the auxiliary head."""
    return F.cross_entropy(out[0], target)


def main_only(out, target):
    """Return a loss of the main output only."""
    return (out["main"] - target).pow(2).mean()


SPLITS = {2: ["b"], 3: ["b", "c"], 4: ["b", "c", "d"]}


def ignored(rank, world, schedule):
    """Train two steps reading the main output only; return the gradient errors and which grads are None."""
    schedule, _, mode = schedule.partition(":")
    dp = 2 if mode else 1
    v = 2 if schedule in ("interleaved", "zbv") else 1
    n = world // dp * v
    torch.manual_seed(0)
    model = Sided()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, n, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, stages_per_rank=v, split_points=SPLITS[n], data_parallel=dp,
                          data_parallel_shard=mode == "shard")
    for _ in range(2):
        pipe.step(x, target=y, loss_fn=main_only)
        main_only(eager(x), y).backward()
    held = dict(eager.named_parameters())
    errors, nones = [], []
    for name, p in model.named_parameters():
        grad = getattr(p.grad, "full_tensor", lambda: p.grad)()
        if p.device.type == "meta":  # another rank's
            continue
        if grad is None or held[name].grad is None:
            nones.append((name, grad is None, held[name].grad is None))
        else:
            errors.append(max_relative_error(grad, held[name].grad))
    return {"errors": errors, "nones": nones}


def disagreeing(rank, world, schedule):
    """Two replicas whose losses read different outputs; return the errors against eager on the global batch."""
    torch.manual_seed(0)
    model = Sided()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, split_points=SPLITS[2], data_parallel=2)
    replicas, replica = fxpipe.data_shard(pipe)
    rows = slice(replica * 4, replica * 4 + 4)
    both = lambda out, target: main_only(out, target) + out["side"].pow(2).mean()  # noqa: E731
    pipe.step(x[rows], target=y[rows], loss_fn=both if replica == 0 else main_only)
    ((both(eager(x[:4]), y[:4]) + main_only(eager(x[4:]), y[4:])) / 2).backward()
    held = dict(eager.named_parameters())
    errors, nones = {}, []
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        if p.grad is None or held[name].grad is None:
            nones.append((name, p.grad is None, held[name].grad is None))
        else:
            errors[name] = max_relative_error(p.grad, held[name].grad)
    return {"errors": errors, "nones": nones, "replicas": replicas}


def auxiliary(rank, world, schedule):
    """Train pp2 x dp2 (DDP) two steps on the logits of :class:`AuxInTraining`; return the errors and Nones."""
    torch.manual_seed(0)
    model = AuxInTraining()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x[:4],), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, split_points=["c"], data_parallel=2)
    _, replica = fxpipe.data_shard(pipe)
    rows = slice(replica * 4, replica * 4 + 4)
    for _ in range(2):
        pipe.step(x[rows], target=y[rows], loss_fn=logits_only)
        logits_only(eager(x), y).backward()
    held = dict(eager.named_parameters())
    errors = {name: max_relative_error(p.grad, held[name].grad) for name, p in model.named_parameters()
              if p.device.type != "meta" and p.grad is not None}
    nones = [name for name, p in model.named_parameters() if p.device.type != "meta" and p.grad is None]
    return {"errors": errors, "nones": nones, "unused": [s.maybe_unused for s in pipe.plan.stages]}


class SkippingExperts(nn.Module):
    """Route each row to its top expert and skip experts given no rows (a leaf: fx cannot trace the skip)."""

    def __init__(self, width: int = 8, experts: int = 6) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        top, out = p.argmax(-1), torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(top == e).squeeze(1)
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(x[idx]) * p[idx, e:e + 1])
        return x + out


class SkippingWeights(nn.Module):
    """:class:`SkippingExperts` holding its experts' weights itself (``register_parameter``), not in submodules."""

    def __init__(self, width: int = 8, experts: int = 6) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(experts, width) * 0.5)
        self.experts = experts
        for e in range(experts):
            self.register_parameter(f"w{e}", nn.Parameter(torch.randn(width, width) * 0.3))

    def forward(self, x):
        p = (x @ self.gate.T).softmax(-1)
        top, out = p.argmax(-1), torch.zeros_like(x)
        for e in range(self.experts):
            idx = torch.nonzero(top == e).squeeze(1)
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, x[idx] @ getattr(self, f"w{e}") * p[idx, e:e + 1])
        return x + out


def skipped_experts(rank, world, schedule, shard=False):
    """pp2 x dp2 with expert leaves whose experts each replica's data reaches differently; errors against eager.

    The first stage's leaf holds its experts in submodules, the second's holds their weights itself.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), SkippingExperts(), nn.Tanh(), SkippingWeights(), nn.Linear(8, 2)).double()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    pipe = fxpipe.compile(model, 2, example_inputs=(x[:4],), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, data_parallel=2, leaf_modules=[SkippingExperts, SkippingWeights],
                          split_points=["2"], data_parallel_shard=shard)
    replicas, replica = fxpipe.data_shard(pipe)
    rows = slice(replica * 4, replica * 4 + 4)
    errors = []
    for _ in range(2):  # the second step failed inside DDP's reducer
        for m in (model, eager):
            m.zero_grad()
        pipe.step(x[rows], target=y[rows], loss_fn=F.mse_loss)
        F.mse_loss(eager(x), y).backward()
        held = dict(eager.named_parameters())
        errors.append(max(max_relative_error(_grad(p), _grad(held[name]))
                          for name, p in model.named_parameters() if p.device.type != "meta"))
    return {"errors": errors, "replicas": replicas}


def skipped_experts_sharded(rank, world, schedule):
    """:func:`skipped_experts` under FSDP2, which reduce-scatters the gradients each replica has."""
    return skipped_experts(rank, world, schedule, shard=True)


def _grad(p):
    """Return ``p``'s gradient whole (a DTensor's full tensor), zeros where it has none."""
    if p.grad is None:
        return torch.zeros(p.shape, dtype=p.dtype)
    return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
