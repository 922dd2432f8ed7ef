"""A custom autograd.Function the tracers trace through is warned of, naming it and the fix that keeps it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxpipe


class Scaled(torch.autograd.Function):
    """A forward whose backward is not its gradient (a scaled straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0) * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0).float() * 3


class Wrapped(nn.Module):
    """The Function's call in a module of its own: a leaf runs it whole, with its backward."""

    def forward(self, x):
        return Scaled.apply(x)


class Model(nn.Module):
    def __init__(self, wrapped: bool = False, reentrant: bool | None = None):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.act = Wrapped() if wrapped else None
        self.reentrant = reentrant

    def forward(self, x):
        h = self.a(x)
        if self.reentrant is not None:
            h = checkpoint(torch.relu, h, use_reentrant=self.reentrant)
        elif self.act is not None:
            h = self.act(h)
        else:
            h = Scaled.apply(h)
        return self.b(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_custom_function_is_warned_of_naming_it_and_the_leaf_module_fix(tracer):
    # before: traced into clamp and mul, its backward dropped silently: the first linear's gradient was 2/3 of
    # eager's (a memory-efficient activation, whose backward is its forward's gradient, traces right: warned only)
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match=r"applies .*Scaled, a torch.autograd.Function, and "
                                         rf"{tracer} traces through its forward.*leaf_modules=\[ThatModule\]"):
        fxpipe.compile(Model(), 2, example_inputs=(x,), tracer=tracer)


def test_the_function_in_a_leaf_module_keeps_its_backward():
    torch.manual_seed(0)
    model, x, y = Model(wrapped=True), torch.randn(8, 16), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, leaf_modules=[Wrapped])
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)


def test_a_reentrant_checkpoint_is_refused_under_export_and_runs_under_fx():
    # under export every gradient stayed None, silently
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(fxpipe.TraceError, match=r"use_reentrant=True, which torch.export traces .* stay None. "
                                                r"Pass use_reentrant=False"):
        fxpipe.compile(Model(reentrant=True), 2, example_inputs=(x,), tracer="export")
    for tracer, reentrant in (("fx", True), ("export", False)):
        torch.manual_seed(0)
        model = Model(reentrant=reentrant)
        eager = copy.deepcopy(model)
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, tracer=tracer)
        pipe.step(x, target=y, loss_fn=F.mse_loss)
        F.mse_loss(eager(x), y).backward()
        torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)


class MulWeight(torch.autograd.Function):
    """A Function in the ``setup_context`` style (no ``ctx`` in its forward), whose backward is its gradient."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.w, self.b = nn.Linear(16, 16), nn.Parameter(torch.randn(16)), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(MulWeight.apply(self.a(x), self.w)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_setup_context_function_s_forward_keeps_its_gradient(tracer):
    # before: under fx its forward (run with grad off, and no ctx to tell) was detached as a no_grad block's,
    # so every parameter before it got no gradient, silently
    torch.manual_seed(0)
    model, x, y = Weighted(), torch.randn(8, 16), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="MulWeight, a torch.autograd.Function"):
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, tracer=tracer)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, p.grad, msg=name)


class Square(torch.autograd.Function):
    """Old-style (``ctx`` in forward): its exact gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x


class ScaledUnderNoGrad(nn.Module):
    """A Function called inside the user's no_grad block: a constant to eager's backward."""

    def __init__(self, old_style: bool):
        super().__init__()
        self.a, self.b, self.old_style = nn.Linear(16, 16), nn.Linear(16, 16), old_style

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = Square.apply(h) if self.old_style else MulWeight.apply(h, torch.ones(16))
        return self.b(h / (1 + s.abs()))


@pytest.mark.parametrize("old_style", [False, True])
def test_a_function_called_under_the_user_s_no_grad_stays_a_constant(old_style):
    # the gradient went through it under fx (0.076 off eager), for old-style Functions before this session too
    torch.manual_seed(0)
    model, x, y = ScaledUnderNoGrad(old_style), torch.randn(8, 16), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="a torch.autograd.Function"):
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    torch.testing.assert_close(model.a.weight.grad, eager.a.weight.grad)
