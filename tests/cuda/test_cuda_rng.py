"""Recomputation replays CUDA's random numbers: dropout masks equal between forward and recompute."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return x


def _dropout_run(model, mode, devices, seed):
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 64),), chunks=4, checkpoint=mode,
                          devices=devices)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)  # seeds every CUDA device too
    out = pipe(x)
    out.square().sum().backward()
    return out.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0", "cpu"], ["cpu", "cuda:0"]])
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputation_replays_cuda_dropout(mode, devices):
    base = DropNet()
    out_ref, grads_ref = _dropout_run(copy.deepcopy(base), "never", devices, seed=7)
    out, grads = _dropout_run(copy.deepcopy(base), mode, devices, seed=7)
    assert torch.equal(out, out_ref)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    out_other, _ = _dropout_run(copy.deepcopy(base), "never", devices, seed=8)
    assert not torch.equal(out_other, out_ref)  # the masks differ between seeds: a bad replay shows


class MaskSpy(nn.Module):
    """Draw a random mask on the input's device; record it with the pass it was drawn in."""

    def __init__(self):
        super().__init__()
        self.masks: list = []

    def forward(self, x):
        mask = torch.rand_like(x)
        self.masks.append((fxpipe.is_recomputing(), mask.detach().cpu()))
        return x * mask


class SpyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.spy, self.b = nn.Linear(16, 16), MaskSpy(), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.spy(self.a(x)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputed_masks_equal_the_forward_masks(schedule):
    chunks = 3
    model = SpyNet()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(6, 16),), chunks=chunks, checkpoint="always",
                          devices=["cuda:0", "cuda:0"], split_points=["spy"], leaf_modules=[MaskSpy],
                          schedule=schedule)
    model.spy.masks.clear()  # compile's shape propagation called it on fake tensors
    pipe.step(torch.randn(6, 16), target=torch.randn(6, 16), loss_fn=F.mse_loss)
    first = [m for again, m in model.spy.masks if not again]
    replayed = [m for again, m in model.spy.masks if again]
    assert len(first) == len(replayed) == chunks
    for r in replayed:
        assert sum(torch.equal(r, f) for f in first) == 1  # each replay equals one forward's mask
