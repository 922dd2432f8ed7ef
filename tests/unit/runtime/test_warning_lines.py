"""Warnings raised while a pipe runs point at the user's call, whichever way it was called."""

import warnings

import pytest
import torch
from torch import nn

import fxpipe


@pytest.mark.parametrize("call", ["pipe", "step"])
def test_the_fewer_micro_batches_warning_names_the_caller_s_line(call):
    # under pipe(x) it pointed into torch's Module.__call__ (a fixed stacklevel, right for pipe.step only)
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, example_inputs=(x,), chunks=3,
                          devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "pipe":
            pipe(x[:2])
        else:
            pipe.step(x[:2], target=x[:2], loss_fn=nn.functional.mse_loss)
    found = [w for w in caught if "fewer than chunks=3" in str(w.message)]
    assert [w.filename for w in found] == [__file__]


def test_compile_warnings_name_the_callers_line():
    # the lost-hooks warning pointed into fxpipe's compiler (a fixed stacklevel)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    model[0].register_forward_hook(lambda m, i, o: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2)
    found = [w for w in caught if "hooks on modules" in str(w.message)]
    assert found and [w.filename for w in found] == [__file__]
