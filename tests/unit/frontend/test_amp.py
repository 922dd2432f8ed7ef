"""A forward's own torch.autocast blocks, which torch.fx does not record: refused where they would differ."""

import copy

import pytest
import torch
from torch import nn

import fxpipe


class Float32Block(nn.Module):
    """Keep a projection in float32 under any outer autocast (a softmax or norm kept exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            return self.proj(h.float())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.c = nn.Linear(8, 8), Float32Block(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.c(torch.relu(h + self.block(h))), self.block(h)


def test_a_step_under_autocast_is_refused_naming_the_block_and_the_fixes():
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(Net(), 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    pipe(x)  # without an outer autocast the block changes nothing
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            fxpipe.PipelineInputError, match=r"changes autocast inside \(.*test_amp.py:\d+\), which torch.fx does "
                                             r"not record.*leaf_modules=.*tracer='export'"):
        pipe(x)


def test_the_block_as_a_leaf_module_runs_as_eager_does():
    model, x = Net(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[Float32Block])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = pipe(x), eager(x)
    assert out[1].dtype == ref[1].dtype == torch.float32  # the plain trace gave bfloat16
    torch.testing.assert_close(out[1], ref[1])
