"""Outputs and every gradient equal eager for every model, stage count, chunks and checkpoint mode."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import FACTORIES
from torch import nn

import fxpipe

from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULES
from fxpipe.testing import assert_pipeline_equivalent

CHECKPOINTS = ["always", "except_last", "never"]
CHUNKS = [1, 3, 4]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_equal_to_eager(name, n_stages, chunks, checkpoint):
    model, args, kwargs = FACTORIES[name]()
    # pipe.step too, once per (stage count, chunks): under one checkpoint mode and one schedule
    # in rotation, so that each model meets every pair of them
    k = 3 * (n_stages - 1) + CHUNKS.index(chunks)
    stepped = CHECKPOINTS[k % 3] == checkpoint
    pipe = assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=n_stages,
                                      chunks=chunks, checkpoint=checkpoint, devices=["cpu"] * n_stages,
                                      schedules=[SCHEDULES[k // 3 % 3]] if stepped else ())
    assert len(pipe.stages) == n_stages



@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_model_compiled_under_inference_mode_equals_eager(tracer):
    # every value tracing made was an inference tensor: "Inference tensors do not track version counter"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    with torch.inference_mode():
        x = torch.randn(4, 8)
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, tracer=tracer)
        torch.testing.assert_close(pipe(x), model(x))
    model = model[:3].train()  # an example made under inference mode, compiled outside it for training
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, tracer=tracer)
    x = x.clone()
    torch.testing.assert_close(pipe.step(x, target=x, loss_fn=F.mse_loss), F.mse_loss(eager(x), x))


def test_lazy_modules_not_yet_initialised_are_refused_naming_the_warm_up_forward():
    # torch's "Attempted to use an uninitialized parameter in <method 'is_inference'...>" came from fxpipe's compile
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.LazyLinear(4))
    with pytest.raises(fxpipe.CompileError, match=r"lazy modules not yet initialised \('2.weight' of LazyLinear\).*"
                                                  r"Run one forward on a batch before fxpipe.compile"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 5),), devices=["cpu"] * 2)
    model(torch.randn(4, 5))
    fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 5),), devices=["cpu"] * 2)


def test_a_model_built_under_inference_mode_is_refused_naming_the_fix():
    # the tensors of a model built under inference mode failed tracing with torch's "Inference tensors cannot be
    # saved for backward" from a graph pass (fx) or from torch.export
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).eval()
        with pytest.raises(fxpipe.CompileError, match=r"Sequential's tensors were made under torch.inference_mode\(\) "
                                                      r"\('0.weight'\).* Build the model outside"):
            fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=2)
