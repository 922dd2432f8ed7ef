"""A gradient hook a forward registers on its own tensors: warned of under export, refused under fx."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Halved(nn.Module):
    """Halve the gradient flowing back through ``h`` (registered where a forward would)."""

    def forward(self, h):
        if torch.is_grad_enabled():  # a recomputed stage's first forward runs without grad: its recomputation hooks
            h.register_hook(lambda g: g * 0.5)
        return h


class Model(nn.Module):
    def __init__(self, leaf: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)
        self.halved = Halved() if leaf else None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.halved is not None:
            h = self.halved(h)
        else:
            h.register_hook(lambda g: g * 0.5)
        return self.b(h)


def test_a_hook_registered_in_forward_is_warned_of_under_export_naming_the_line_and_the_fix():
    # before: torch.export dropped it silently, the first linear's gradient 2x eager's
    with pytest.warns(UserWarning, match=r"Model registers a gradient hook on a tensor in its forward \(.*"
                                         r"test_tensorhooks.py:\d+\), which torch.export does not keep.*leaf_modules="):
        fxpipe.compile(Model(), 2, example_inputs=(torch.randn(8, 16),), tracer="export")


def test_a_hook_registered_in_forward_is_refused_under_fx_naming_the_fix():
    # before: fx's "argument of type: <class 'function'>", suggesting tracer='export', which drops the hook
    with pytest.raises(fxpipe.TraceError, match=r"(?s)registers a gradient hook on a tensor \(tensor.register_hook\).*"
                                                r"test_tensorhooks.py.*leaf_modules=\[ThatModule\]"):
        fxpipe.compile(Model(), 2, example_inputs=(torch.randn(8, 16),))


@pytest.mark.parametrize("split", ["halved", "b"])  # on a stage's input, or inside it
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_hook_in_a_leaf_module_runs_as_in_eager(checkpoint, split):
    torch.manual_seed(0)
    model, x, y = Model(leaf=True), torch.randn(8, 16), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=4, leaf_modules=[Halved],
                          checkpoint=checkpoint, split_points=[split])
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)
