"""A model input requiring grad: its gradient reaches the user's graph under every schedule, as eager's does.

A later stage reading it directly needs it to require grad at compile (a route back), or the step is refused.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_a_trainable_module_before_the_pipe_and_the_input_get_eager_gradients(schedule, checkpoint):
    # 1f1b and zero bubble cut autograd at the first stage's inputs: the encoder got no gradient
    model, encoder = _stack(), nn.Linear(6, 8)
    eager, eager_encoder = copy.deepcopy(model), copy.deepcopy(encoder)
    n = 4 if schedule in ("interleaved", "zbv") else 2
    pipe = fxpipe.compile(model, n, example_inputs=(torch.randn(8, 8),), chunks=2, devices=["cpu"] * n,
                          schedule=schedule, checkpoint=checkpoint, stages_per_rank=n // 2)
    raw, y = torch.randn(8, 6), torch.randn(8, 4)
    x = torch.randn(8, 8, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    loss = pipe.step(encoder(raw) + x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(eager_encoder(raw) + x_eager), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(x.grad, x_eager.grad)
    for p, q in zip(encoder.parameters(), eager_encoder.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, scale, extra=None):
        return self.b(self.a(x * scale).tanh() + extra["e"])


@pytest.mark.parametrize("compiled", [None, {"backend": "aot_eager"}], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_inputs_requiring_grad_in_a_dict_and_whole_to_every_micro_batch(schedule, compiled):
    torch.manual_seed(0)
    model = _Keywords()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    scale, extra = torch.randn(8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    scale_eager, extra_eager = (t.detach().clone().requires_grad_() for t in (scale, extra))
    pipe = fxpipe.compile(model, 2, example_inputs=(x, scale), example_kwargs={"extra": {"e": extra}}, chunks=2,
                          devices=["cpu"] * 2, schedule=schedule, unbatched=["scale"], torch_compile=compiled)
    pipe.step(x, scale, extra={"e": extra}, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x, scale_eager, extra={"e": extra_eager}), y).backward()
    torch.testing.assert_close(scale.grad, scale_eager.grad)  # summed over the micro-batches it went to whole
    torch.testing.assert_close(extra.grad, extra_eager.grad)


class Skipping(nn.Module):
    """Four linears; the input is read again by the last stage and a shared bias by the second."""

    def __init__(self):
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x, bias):
        h = self.l[1](self.l[0](x)) + bias
        return self.l[3](self.l[2](h)) + x * 2


def _skipping(schedule, grad_at_compile):
    torch.manual_seed(0)
    model = Skipping()
    x, bias = torch.randn(8, 16), torch.randn(16)
    example = (x.clone().requires_grad_(grad_at_compile), bias.clone().requires_grad_(grad_at_compile))
    extra = {"stages_per_rank": 2} if schedule in ("interleaved", "zbv") else {}
    pipe = fxpipe.compile(model, 4, example_inputs=example, chunks=4, schedule=schedule, devices=["cpu"] * 4,
                          unbatched=["bias"], split_points=["l.1", "l.2", "l.3"], **extra)
    return model, pipe, x, bias, torch.randn(8, 16)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_inputs_requiring_grad_at_compile_get_every_stages_share(schedule):
    model, pipe, x, bias, y = _skipping(schedule, True)
    eager = copy.deepcopy(model)
    x1, b1 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    x2, b2 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    pipe.step(x1, b1, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x2, b2), y).backward()
    assert max_relative_error(x1.grad, x2.grad) < 1e-5
    assert max_relative_error(b1.grad, b2.grad) < 1e-5
    model.zero_grad(), eager.zero_grad()
    pipe.step(x, bias, target=y, loss_fn=F.mse_loss)  # and without: the parameters as eager's
    F.mse_loss(eager(x, bias), y).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved"])
def test_an_input_requiring_grad_only_at_the_step_is_refused_where_a_later_stage_reads_it(schedule):
    # no gradient route from stage 3 back to x: x.grad held stage 0's share only, and bias.grad was None
    _model, pipe, x, bias, y = _skipping(schedule, False)
    with pytest.raises(fxpipe.PipelineInputError, match=r"model input 'x' requires grad now but did not in the "
                                                        r"example inputs at compile, and stage 3 reads it or a value "
                                                        r"computed from it alone \('x' \(stage 3\)\).*"
                                                        r"example_inputs=\(x.requires_grad_\(\), ...\)"):
        pipe.step(x.clone().requires_grad_(), bias, target=y, loss_fn=F.mse_loss)
    with pytest.raises(fxpipe.PipelineInputError, match=r"model input 'bias' .* stage 1 reads it .*'bias' \(stage 1\)"):
        pipe.step(x, bias.clone().requires_grad_(), target=y, loss_fn=F.mse_loss)
    pipe.step(x, bias, target=y, loss_fn=F.mse_loss)  # neither requiring grad: the pipe runs


def test_an_input_only_the_first_stage_reads_needs_no_route():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="1f1b", devices=["cpu"] * 2)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    pipe.step(x1, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x2), y).backward()
    assert max_relative_error(x1.grad, x2.grad) < 1e-5


def test_gpipe_in_one_process_gives_every_share_without_it_at_compile():
    model, pipe, x, bias, y = _skipping("gpipe", False)
    eager = copy.deepcopy(model)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    pipe.step(x1, bias, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x2, bias), y).backward()
    assert max_relative_error(x1.grad, x2.grad) < 1e-5


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x):
        xs = x * 2  # made from the input alone in stage 0, read again by the last stage
        return self.l[3](self.l[2](self.l[1](self.l[0](xs)))) + xs


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_value_made_from_the_input_alone_and_read_later_needs_the_route_too(schedule):
    # xs carried no gradient back from stage 3: x.grad was 0.97x off eager, silently
    torch.manual_seed(0)
    model = _Scaled()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=4, schedule=schedule, devices=["cpu"] * 4)
    with pytest.raises(fxpipe.PipelineInputError, match=r"model input 'x' .* stage 3 reads it or a value computed "
                                                        r"from it alone \('mul' \(stage 3\)\)"):
        pipe.step(x.clone().requires_grad_(), target=y, loss_fn=F.mse_loss)
    pipe = fxpipe.compile(model, 4, example_inputs=(x.clone().requires_grad_(),), chunks=4, schedule=schedule,
                          devices=["cpu"] * 4)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    pipe.step(x1, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x2), y).backward()
    assert max_relative_error(x1.grad, x2.grad) < 1e-5
