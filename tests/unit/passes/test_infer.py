"""Propagation for a leaf module fake tensors cannot follow: crossing values for new layouts, and the memory pass."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.passes.annotate import TensorSpec
from fxpipe.passes.failure import PropagationError
from fxpipe.passes.infer import value_specs


class Gate(nn.Module):
    """A leaf module branching on a value: fake tensors cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        if bool((h > -1e9).all()):
            h = torch.relu(h)
        return self.b(h) + x


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(Gate(), Gate(), nn.Linear(16, 4))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 16),), leaf_modules=[Gate], devices=["cpu"] * 2)
    return pipe._gm


def test_a_data_dependent_leaf_gives_its_example_value_with_the_new_rows():
    # across ranks every step was refused: the layout of a new micro-batch is propagated on fake tensors only
    gm = _graph()
    specs = value_specs(gm, [TensorSpec((3, 16), torch.float32)], ["_0", "_1"])
    assert specs["_0"].shape == (3, 16) and specs["_1"].shape == (3, 16)
    assert specs["_1"].dtype == torch.float32


def test_a_data_dependent_leaf_with_other_than_new_rows_is_refused_naming_it():
    with pytest.raises(PropagationError, match="node '_0'"):
        value_specs(_graph(), [TensorSpec((3, 4, 16), torch.float32)], ["_0"])


def test_checkpoint_auto_plans_a_model_with_a_data_dependent_leaf():
    # the memory pass ran on fake tensors only: a raw DataDependentOutputException out of fxpipe.compile
    torch.manual_seed(0)
    model = nn.Sequential(Gate(), Gate(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[Gate],
                          checkpoint="auto", max_memory=1e9)
    assert all(n.meta["fxpipe.retains"].get("_0", 0) > 0 for n in pipe._gm.graph.nodes if n.name == "_0")
    loss = pipe.step(x, target=torch.zeros(8, 4), loss_fn=torch.nn.functional.mse_loss)
    assert torch.isfinite(loss)
