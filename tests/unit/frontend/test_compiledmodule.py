"""Modules compiled before fxpipe sees them: torch.compile (a whole model, a submodule), torch.jit.script."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


class Block(nn.Module):
    def __init__(self, compiled: bool):
        super().__init__()
        inner = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.a, self.h = nn.Linear(8, 16), nn.Linear(16, 4)
        self.b = torch.compile(inner, backend="aot_eager") if compiled else inner

    def forward(self, x):
        return self.h(self.b(torch.tanh(self.a(x))))


def _grads_equal(model, eager):
    return all(max_relative_error(p.grad, q.grad) < 1e-5 for p, q in zip(model.parameters(), eager.parameters()))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_torch_compiled_model_is_pipelined_as_the_module_it_wraps(tracer):
    # fx failed ("OptimizedModule is missing the required forward"); export kept '_orig_mod.' in every key
    model = Block(compiled=False)
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with pytest.warns(UserWarning, match="torch.compile'd Block: it pipelines the module that wraps .*torch_compile=True"):
        pipe = fxpipe.compile(torch.compile(model, backend="aot_eager"), 2, example_inputs=(x,), chunks=3,
                              devices=["cpu"] * 2, schedule="1f1b", tracer=tracer)
    assert list(pipe.state_dict()) == list(model.state_dict())
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5 and _grads_equal(model, eager)


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_a_torch_compiled_submodule_runs_compiled_as_one_call_under_fx(schedule):
    torch.manual_seed(0)
    model = Block(compiled=True)
    torch.manual_seed(0)
    eager = Block(compiled=False)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=3, devices=["cpu"] * 3, schedule=schedule)
    assert "b" in [str(n.target) for stage in pipe.stages for n in stage.graph.nodes if n.op == "call_module"]
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5 and _grads_equal(model, eager)


def test_a_scripted_submodule_is_refused_by_export_naming_it_and_runs_under_fx():
    # export's failure read "Sequential.forward() takes 2 positional arguments ... may depend on the batch size"
    class Scripted(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.h = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.Tanh())), nn.Linear(16, 4)

        def forward(self, x):
            return self.h(self.a(x))

    x = torch.randn(6, 8)
    with pytest.raises(fxpipe.TraceError, match="'a' is a torch.jit.ScriptModule, which it cannot export; use "
                                                "tracer='fx'"):
        fxpipe.compile(Scripted(), 2, example_inputs=(x,), devices=["cpu"] * 2, tracer="export")
    model = Scripted()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2)
    assert max_relative_error(pipe(x), model(x)) < 1e-6
