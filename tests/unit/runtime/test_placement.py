"""Where tensors live across ranks: two parameters sharing storage in stages of different ranks are warned of."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.runtime.placement import warn_shared_storage


class _Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = nn.Parameter(self.a.weight.data)  # the same storage, another Parameter

    def forward(self, x):
        return self.b(torch.tanh(self.mid(torch.tanh(self.a(x)))))


def test_parameters_sharing_storage_on_two_ranks_are_warned_of_naming_the_tie():
    # each rank held its own copy: the frozen one stopped following the trained one, silently (18% off by step 2)
    pipe = fxpipe.compile(_Aliased(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2, split_points=["b"])
    with pytest.warns(UserWarning, match=r"parameters 'a.weight' \(stage 0, rank 0\) and 'b.weight' \(stage 1, rank 1\) "
                                         r"share storage but are different Parameters.*\('b.weight' = 'a.weight'\)"):
        warn_shared_storage(pipe.stages, [0, 1])


def test_one_tensor_read_by_two_ranks_is_a_tie_not_warned_of(recwarn):
    model = _Aliased()
    model.b.weight = model.a.weight  # one Parameter: tied, kept equal across ranks
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2, split_points=["b"])
    warn_shared_storage(pipe.stages, [0, 1])
    warn_shared_storage(pipe.stages, [0, 0])  # one rank: one process shares the storage as eager does
    assert not [w for w in recwarn if "share storage" in str(w.message)]
