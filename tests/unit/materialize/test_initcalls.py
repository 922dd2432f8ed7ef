"""deferred_init() replays the torch.nn.init functions that do nothing on meta (trunc_normal_, ...)."""

import pytest
import torch
from torch import nn
from torch.nn.init import trunc_normal_  # held by name, as libraries often do

import fxpipe


class Inits(nn.Module):
    """One tensor per init function that returns at once on meta, set up as models do."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 64, 32, dtype=dtype))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, 32, dtype=dtype))
        trunc_normal_(self.cls, std=0.02, a=-0.04, b=0.04)
        self.proj = nn.Linear(32, 32, dtype=dtype)  # Hugging Face ViT's way: through .data, in float32
        self.proj.weight.data = nn.init.trunc_normal_(self.proj.weight.data.to(torch.float32), std=0.02).to(dtype)
        self.rnn = nn.Linear(48, 24)  # QR has no bfloat16 kernel on the CPU
        nn.init.orthogonal_(self.rnn.weight, gain=2.0)
        self.conv = nn.Conv2d(8, 8, 3, dtype=dtype)
        nn.init.dirac_(self.conv.weight)
        self.sparse = nn.Linear(40, 30, dtype=dtype)
        nn.init.sparse_(self.sparse.weight, sparsity=0.5, std=0.01)

    def forward(self, x):
        return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_init_that_skips_meta_is_replayed(dtype):
    torch.manual_seed(0)
    eager = Inits(dtype)
    with fxpipe.deferred_init():
        model = Inits(dtype)
    fxpipe.materialize(model, device="cpu")
    for name in ("pos", "cls", "proj.weight"):  # std 1.0 (randn) and the Linear default, before
        got = model.get_parameter(name).float()
        assert abs(got.std().item() - 0.02) < 0.004, (name, got.std())
    assert model.cls.abs().max().item() <= 0.04
    w = model.rnn.weight.float()
    torch.testing.assert_close(w @ w.T, 4 * torch.eye(24), atol=0.05, rtol=0)  # orthogonal rows, gain 2
    assert torch.equal(model.conv.weight, eager.conv.weight)  # dirac_: no randomness, equal to eager
    zeros = (model.sparse.weight == 0).sum(0)
    assert torch.equal(zeros, torch.full((40,), 15)) and model.sparse.weight.abs().max() < 0.1


def test_the_replay_is_seeded_per_module_and_the_functions_are_restored():
    with fxpipe.deferred_init():
        a, b = Inits(), Inits()
    fxpipe.materialize(a, device="cpu")
    fxpipe.materialize(b, device="cpu")
    assert torch.equal(a.pos, b.pos) and torch.equal(a.rnn.weight, b.rnn.weight)
    assert nn.init.trunc_normal_ is trunc_normal_ and nn.init.orthogonal_.__module__ == "torch.nn.init"
    with torch.device("meta"):
        w = torch.empty(3, 4)
    assert nn.init.trunc_normal_(w) is w  # outside the context: torch's own behaviour on meta
