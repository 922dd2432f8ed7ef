"""A forward's own torch.autocast blocks, which torch.fx does not record: each call inside runs under them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.mutates import is_mutating


class Float32Block(nn.Module):
    """Keep a projection and a softmax in float32 under any outer autocast (a norm or an attention kept exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        with torch.autocast("cpu", enabled=False):
            p = self.proj(h.float())  # a module, a method
            return torch.softmax(p, -1) + p.relu_()  # functions, an in-place method


class LowPrecision(nn.Module):
    """Turn autocast on for one matmul (a block that enables it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, h):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (h @ self.w).float()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.low, self.c = nn.Linear(8, 8), Float32Block(), LowPrecision(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        y = self.block(h)
        return self.c(torch.relu(h + y + self.low(h))), y


@pytest.mark.parametrize("outer", [None, torch.bfloat16], ids=["no-outer-autocast", "under-bf16"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_the_blocks_run_as_eager_under_any_outer_autocast(schedule, outer):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, devices=["cpu"] * 3, schedule=schedule,
                          checkpoint="always")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer is not None):
        out, ref = pipe(x), eager(x)
        loss = pipe.step(x, target=None, loss_fn=lambda o, _: o[0].float().pow(2).mean())
        expected = 0.5 * sum(eager(m)[0].float().pow(2).mean() for m in x.chunk(2))
    assert out[1].dtype == ref[1].dtype == torch.float32  # the plain trace gave bfloat16 under the outer autocast
    torch.testing.assert_close(out, ref)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        # the bfloat16 matmul's backward rounds the micro-batch's gradient before the pipe weights it
        exact = name != "low.w" and outer is None
        torch.testing.assert_close(p.grad, q.grad, msg=name, **({} if exact else {"rtol": 2e-2, "atol": 1e-3}))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_the_backward_of_pipe_step_runs_outside_the_autocast_around_it_as_eager_s(schedule):
    # before: the backward ran under the caller's autocast, so the float32 block's weight gradient was computed
    # in bfloat16 (4e-3 off eager's, whose loss.backward() runs outside the autocast)
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=1, devices=["cpu"] * 2, schedule=schedule,
                          checkpoint="never")
    loss_fn = lambda o, _: o[0].float().pow(2).mean()  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x, target=None, loss_fn=loss_fn)
        expected = loss_fn(eager(x), None)
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_each_call_inside_a_block_is_wrapped_keeping_its_name_and_mutation():
    gm = fxpipe.trace(Net())
    wrapped = {n.name: n for n in gm.graph.nodes if type(n.target).__name__ == "UnderAutocast"}
    assert {"block_proj", "softmax", "relu_", "matmul"} <= set(wrapped)
    assert is_mutating(wrapped["relu_"]) and not is_mutating(wrapped["softmax"])
    assert "under_autocast_" in gm.code


def test_the_block_as_a_leaf_module_runs_as_eager_does_too():
    model, x = Net(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[Float32Block])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = pipe(x), eager(x)
    torch.testing.assert_close(out, ref)


def test_an_autocast_decorator_on_a_helper_counts_as_a_block():
    class Decorated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @torch.autocast("cpu", enabled=False)
        def exact(self, h):
            return F.linear(h.float(), self.lin.weight, self.lin.bias)

        def forward(self, x):
            return self.exact(x * 2)

    model, x = Decorated(), torch.randn(4, 8)
    pipe = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x,), devices=["cpu"] * 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = pipe(x), model(x)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref)
