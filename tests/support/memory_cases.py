"""What each rank runs in the distributed tests of the memory policies (imported by spawned processes)."""

from __future__ import annotations

import copy

import torch
from dist_cases import _check_step
from models import TiedTransformer, token_loss
from torch import nn

import fxpipe
from fxpipe.options import MULTI_STAGE_SCHEDULES
from fxpipe.testing import max_relative_error


def _layout(world: int, schedule: str) -> tuple[int, int]:
    """Return the stages and the stages per rank a schedule runs on ``world`` ranks."""
    per = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    return world * per, per


def _tokens() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Return the tied transformer and a batch of tokens with its targets."""
    torch.manual_seed(0)
    model = TiedTransformer()
    return model, torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))


def selective(rank: int, world: int, schedule: str) -> dict:
    """Every stage selective: the loss and this rank's gradients against eager."""
    model, x, y = _tokens()
    _n, per = _layout(world, schedule)
    result, pipe = _check_step(rank, world, model, x, y, token_loss, stages_per_rank=per, chunks=4,
                               schedule=schedule, checkpoint="selective")
    return result | {"policies": pipe.plan.policies()}


def per_stage(rank: int, world: int, schedule: str) -> dict:
    """A policy per stage (selective next to whole-stage checkpointing and none)."""
    model, x, y = _tokens()
    n, per = _layout(world, schedule)
    policies = (["selective", "always", "never", "except_last"] * n)[:n]
    result, pipe = _check_step(rank, world, model, x, y, token_loss, stages_per_rank=per, chunks=4,
                               schedule=schedule, checkpoint=policies)
    return result | {"policies": pipe.plan.policies()}


class DropStack(nn.Module):
    """Linear layers with dropout between them: the recomputation must draw the same masks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = nn.functional.dropout(torch.tanh(layer(x)), 0.5, self.training)
        return x


def replay(rank: int, world: int, schedule: str) -> dict:
    """Selective and no recomputation, from the same seed on every rank: the same loss and gradients."""
    torch.manual_seed(0)
    base = DropStack()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    losses, grads = {}, {}
    for mode in ("never", "selective"):
        model = copy.deepcopy(base)
        pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=60,
                              schedule=schedule, checkpoint=mode)
        torch.manual_seed(1 + rank)
        last = rank == pipe.plan.stages[-1].on_rank
        losses[mode] = pipe.step(x if rank == 0 else None, target=y if last else None,
                                 loss_fn=nn.functional.mse_loss)
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss_error": max_relative_error(losses["selective"], losses["never"]),
            "grad_errors": {n: max_relative_error(grads["selective"][n], g) for n, g in grads["never"].items()}}


def auto(rank: int, world: int, schedule: str) -> dict:
    """A budget between the predicted peaks of always and never: each rank's policy, equal to eager."""
    model, x, y = _tokens()
    peaks = {}
    for mode in ("always", "never"):
        pipe = fxpipe.compile(copy.deepcopy(model), world, example_inputs=(x,), chunks=4, runtime="distributed",
                              timeout=60, schedule=schedule, checkpoint=mode)
        sim = fxpipe.simulate(pipe, device="h100", runtime="distributed")
        peaks[mode] = [s.memory.peak for s in sim.stages]
    budget = (max(peaks["always"]) + max(peaks["never"])) / 2
    result, pipe = _check_step(rank, world, model, x, y, token_loss, chunks=4, schedule=schedule,
                               checkpoint="auto", max_memory=budget)
    return result | {"policies": pipe.plan.policies(), "peaks": [s.peak for s in pipe.plan.stages],
                     "budget": budget, "never": peaks["never"]}
