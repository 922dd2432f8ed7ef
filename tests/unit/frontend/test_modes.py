"""A forward branching on self.training: fx fixes the branch of its mode, so the other mode is refused."""

import copy

import pytest
import torch
from torch import nn

import fxpipe


class DropPath(nn.Module):
    """Stochastic depth written as Python on self.training, as timm's and torchvision's are."""

    def forward(self, x):
        if not self.training:
            return x
        keep = (torch.rand_like(x[:, :1]) > 0.5).to(x.dtype)
        return x * keep * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 8), DropPath(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + self.drop(h))


def test_the_other_mode_is_refused_naming_the_branch_and_the_fixes():
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(Net().train(), 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    pipe.eval()
    with pytest.raises(fxpipe.PipelineInputError, match=r"branches on self.training, and torch.fx fixed the branch "
                                                        r"of training mode.*getitem.*where the other has .add.*leaf_modules="):
        pipe(x)  # the plain trace ran the drop path in eval mode too


def test_a_pipe_compiled_in_eval_mode_equals_eager_and_a_leaf_follows_the_mode():
    model, x = Net().eval(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(x), eager(x))
    trained = Net().train()
    reference = copy.deepcopy(trained).eval()
    leafy = fxpipe.compile(trained, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[DropPath])
    leafy.eval()
    torch.testing.assert_close(leafy(x), reference(x))  # the leaf reads the mode when it runs: no drop in eval


def test_models_without_such_branches_switch_modes_freely():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 8))
    pipe = fxpipe.compile(model.train(), 2, example_inputs=(torch.randn(6, 8),), chunks=2, devices=["cpu"] * 2)
    pipe.eval()
    assert pipe(torch.randn(6, 8)).shape == (6, 8)
    assert "fxpipe.training" not in pipe._gm.meta
