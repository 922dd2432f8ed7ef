"""Compiled stages on CUDA: recomputation replays dropout masks; zero bubble's W; inductor equals eager."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import Stack
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Scale(nn.Module):
    """Scale by a learned vector, then dropout: the gradient is zero exactly where the mask dropped."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * self.w)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recompute_replays_cuda_dropout_masks_in_compiled_stages(backend):
    model = nn.Sequential(_Scale(), _Scale())
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(16, 64),), chunks=1, checkpoint="always",
                          devices=["cuda:0", "cuda:0"], split_points=["1"], torch_compile={"backend": backend})
    for _ in range(2):
        x = torch.randn(16, 64, device="cuda:0", requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        assert torch.equal(out != 0, x.grad != 0)


def test_inductor_zero_bubble_on_cuda_equals_eager_with_w_after_i():
    torch.manual_seed(0)
    model = Stack(d=64, hidden=256, layers=4, out=64)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    eager = copy.deepcopy(model).cuda()
    F.mse_loss(eager(x.cuda()), y.cuda()).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", checkpoint="never",
                          devices=["cuda:0", "cuda:0"], torch_compile=True)
    with fxpipe.timeline() as tl:
        pipe.step(x.cuda(), target=y.cuda(), loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-4, name
    spans = {(e["cat"], e["args"]["stage"], e["args"]["micro_batch"]): e for e in tl.events}
    for j in range(2):
        for i in range(4):
            w, b = spans[("weight", j, i)], spans[("backward", j, i)]
            assert w["ts"] >= b["ts"] + b["dur"] - 1, (j, i)  # stamps in microseconds, CUDA events resolved
