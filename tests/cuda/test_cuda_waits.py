"""Stream waits hold when a stream is made late on purpose, in a pipeline over cuda:0 and the CPU.

:class:`Late` writes its result (and, in backward, its input's gradient) only after the GPU
busy-waits, and the copy streams are kept busy before each pass, so a copy or a stage that
does not wait reads half of the right value, or memory never written::

    stage 0 (GPU): ... Late ──copy──▶ stage 1 (CPU) ──copy──▶ stage 2 (GPU): Late ... Late ──copy──▶ stage 3 (CPU)
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.stage.stream import use_stream
from fxpipe.testing import max_relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIXED = ["cuda:0", "cpu", "cuda:0", "cpu"]
LATE = 20  # milliseconds


class _LateDouble(torch.autograd.Function):
    """2x, in both passes written only after the GPU busy-waits LATE milliseconds."""

    @staticmethod
    def forward(ctx, x, sleep):  # type: ignore[override]
        ctx.sleep = sleep
        y = x * 0.5
        if y.is_cuda:
            sleep(LATE)
        return y.mul_(4.0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = grad * 0.5
        if g.is_cuda:
            ctx.sleep(LATE)
        return g.mul_(4.0), None


class Late(nn.Module):
    """Double the input, late on the GPU (a leaf module: its branch is not traced)."""

    def __init__(self, sleep=None):
        super().__init__()
        self.sleep = sleep

    def forward(self, x):
        return _LateDouble.apply(x, self.sleep)


class LateNet(nn.Module):
    """GPU stages begin and end with :class:`Late`; CPU stages are one linear each."""

    def __init__(self, sleep=None):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.late0 = Late(sleep)
        self.b = nn.Linear(32, 32)
        self.late1, self.c, self.late2 = Late(sleep), nn.Linear(32, 32), Late(sleep)
        self.d = nn.Linear(32, 32)

    def forward(self, x):
        x = self.late0(torch.tanh(self.a(x)))  # stage 0, GPU: its output is late
        x = torch.tanh(self.b(x))  # stage 1, CPU
        x = self.late2(torch.tanh(self.c(self.late1(x))))  # stage 2, GPU: late input gradient, late output
        return self.d(x)  # stage 3, CPU


def _busy_copy_streams(pipe, chunks, sleep):
    """Queue a busy wait on every CUDA stage's copy streams, so every copy lands late."""
    for call in pipe._runtime.calls:
        if call.device.type == "cuda":
            for i in range(chunks):
                with use_stream(call.copy_stream(i)):
                    sleep(LATE)


def _late_pipe(sleep, chunks, **kw):
    model = LateNet(sleep)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 32)
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=chunks, devices=MIXED,
                          split_points=["b", "late1", "d"], leaf_modules=[Late], **kw)
    assert [s.device for s in pipe.plan.stages] == MIXED
    return model, reference, pipe, x


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_gpipe_waits_for_late_streams_both_ways(cuda_sleep, checkpoint):
    chunks = 2
    model, reference, pipe, x = _late_pipe(cuda_sleep, chunks, checkpoint=checkpoint)
    expected = reference(x)
    expected.square().sum().backward()
    _busy_copy_streams(pipe, chunks, cuda_sleep)
    out = pipe(x)
    _busy_copy_streams(pipe, chunks, cuda_sleep)
    out.square().sum().backward()
    assert max_relative_error(out.detach(), expected.detach()) < 1e-5
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_action_schedules_wait_for_late_streams_both_ways(cuda_sleep, schedule):
    chunks = 4
    model, reference, pipe, x = _late_pipe(cuda_sleep, chunks, schedule=schedule, checkpoint="except_last")
    target = torch.randn(8, 32)
    expected = F.mse_loss(reference(x), target)
    expected.backward()
    _busy_copy_streams(pipe, chunks, cuda_sleep)
    loss = pipe.step(x, target=target, loss_fn=F.mse_loss)
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
