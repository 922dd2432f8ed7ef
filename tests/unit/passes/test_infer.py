"""Specs of the values crossing stages for new input layouts, on fake tensors (what a rank sizes its buffers by)."""

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
