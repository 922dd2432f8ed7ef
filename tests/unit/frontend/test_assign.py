"""A forward assigning to module attributes: buffers updated in place, the model left intact."""

import copy
import logging

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent


class Counted(nn.Module):
    """Count the calls and keep a running mean by assignment, as Python code often does."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        h = self.lin(x)
        if self.training:
            self.calls += 1  # Python runs it as self.calls = self.calls + 1
            self.mean = 0.9 * self.mean + 0.1 * h.detach().mean(0)
        return h - self.mean


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = Counted(), Counted(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def test_tracing_leaves_the_model_s_buffers_tensors():
    model = Net().train()
    fxpipe.trace(model)
    assert isinstance(model.a.calls, torch.Tensor) and int(model.a.calls) == 0
    assert dict(model.named_buffers()).keys() == dict(Net().named_buffers()).keys()


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_buffers_assigned_in_forward_update_as_in_eager(schedule, checkpoint):
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule=schedule, checkpoint=checkpoint,
                          devices=["cpu"] * 2)
    pipe.step(x, target=None, loss_fn=lambda out, _: out.pow(2).mean())
    for mb in x.chunk(2):  # eager over the same micro-batches: each updates the buffers once
        eager(mb)
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(pipe.state_dict()[name], buf, msg=name)
    assert int(pipe.state_dict()["b.calls"]) == 2


def test_a_pipe_with_buffer_assignments_equals_eager_in_eval_mode():
    assert_pipeline_equivalent(Net().eval(), (torch.randn(6, 8),), n_stages=2, chunks=2, devices=["cpu"] * 2)


class Caching(nn.Module):
    """Keep the last hidden state on ``self`` (for inspection), a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        self.last = None

    def forward(self, x):
        self.last = torch.tanh(self.lin(x))
        return self.out(self.last)


def test_a_plain_attribute_assigned_in_forward_is_put_back_and_named(caplog):
    model = Caching()
    with caplog.at_level(logging.WARNING, logger="fxpipe.frontend.assign"):
        gm = fxpipe.trace(model)
    assert model.last is None  # not the tracer's Proxy
    assert "Caching.forward assigns self.last" in caplog.text
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), model(x))
