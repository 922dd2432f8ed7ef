"""A model input requiring grad: its gradient reaches the user's graph under every schedule, as eager's does."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


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
