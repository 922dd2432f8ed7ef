"""Propagation for a leaf module fake tensors cannot follow: crossing values for new layouts, and the memory pass."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.passes.annotate import TensorSpec
from fxpipe.passes.failure import PropagationError
from fxpipe.passes.infer import value_specs


class Gate(nn.Module):
    """A leaf module branching on a value: fake tensors cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        if bool((h > -1e9).all()):
            h = torch.relu(h)
        return self.b(h) + x


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(Gate(), Gate(), nn.Linear(16, 4))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 16),), leaf_modules=[Gate], devices=["cpu"] * 2)
    return pipe._gm


def test_a_data_dependent_leaf_gives_its_example_value_with_the_new_rows():
    # across ranks every step was refused: the layout of a new micro-batch is propagated on fake tensors only
    gm = _graph()
    specs = value_specs(gm, [TensorSpec((3, 16), torch.float32)], ["_0", "_1"])
    assert specs["_0"].shape == (3, 16) and specs["_1"].shape == (3, 16)
    assert specs["_1"].dtype == torch.float32


def test_a_data_dependent_leaf_with_other_than_new_rows_is_refused_naming_it():
    with pytest.raises(PropagationError, match="node '_0'"):
        value_specs(_graph(), [TensorSpec((3, 4, 16), torch.float32)], ["_0"])


def test_checkpoint_auto_plans_a_model_with_a_data_dependent_leaf():
    # the memory pass ran on fake tensors only: a raw DataDependentOutputException out of fxpipe.compile
    torch.manual_seed(0)
    model = nn.Sequential(Gate(), Gate(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[Gate],
                          checkpoint="auto", max_memory=1e9)
    assert all(n.meta["fxpipe.retains"].get("_0", 0) > 0 for n in pipe._gm.graph.nodes if n.name == "_0")
    loss = pipe.step(x, target=torch.zeros(8, 4), loss_fn=torch.nn.functional.mse_loss)
    assert torch.isfinite(loss)


class SplitExperts(nn.Module):
    """Experts dispatched by sizes read from the data (``.tolist()``, as transformers' JetMoE does)."""

    def __init__(self, d: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, d) * 0.1)

    def forward(self, h):
        top_w, top_i = self.router(h).topk(self.k, dim=1)
        sizes = nn.functional.one_hot(top_i, self.experts).sum((0, 1)).tolist()
        order = top_i.flatten().argsort()
        rows = order // self.k
        parts = [nn.functional.linear(part, self.w[e]) for e, part in enumerate(h[rows].split(sizes))]
        y = torch.cat(parts) * top_w.softmax(1).flatten()[order].unsqueeze(1)
        return torch.zeros_like(h).index_add(0, rows, y)


def test_values_sized_by_the_data_take_the_rows_of_the_values_computed_beside_them():
    # across ranks every step was refused: the experts' joined outputs, imitated at the example's size, met
    # the micro-batch's gates in a product fake tensors could not broadcast
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), SplitExperts(), nn.Linear(16, 3))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 8),), tracer="export", devices=["cpu"] * 2)
    out = [n.name for n in pipe._gm.graph.nodes if n.op == "call_function" and "index_add" in str(n.target)]
    specs = value_specs(pipe._gm, [TensorSpec((4, 8), torch.float32)], out)
    assert specs[out[0]].shape == (4, 16)


class WithBalance(nn.Module):
    """Experts by sizes read from the data, and a load-balancing loss over the batch's routing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.moe, self.b = nn.Linear(8, 16), SplitExperts(), nn.Linear(16, 3)

    def forward(self, x):
        h = self.a(x)
        balance = self.moe.router(h).softmax(-1).mean(0).pow(2).sum()  # not a mean over the rows
        return self.b(self.moe(h)), balance


def test_a_balance_loss_beside_experts_sized_by_the_data_is_still_warned_of():
    # the micro-batch's propagation failed in torch.export's check of the sizes' sum, so nothing was warned
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"couples the rows of a batch: .*0-dim output that is not a mean"):
        fxpipe.compile(WithBalance(), 2, example_inputs=(torch.randn(8, 8),), tracer="export", chunks=4,
                       devices=["cpu"] * 2)


def test_torch_s_fake_tensor_dispatch_cache_stays_bounded_over_new_layouts(monkeypatch):
    # torch's cache is keyed by shapes and never emptied: a new length at every step grew the first rank's memory
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxpipe.passes import fakemode, infer

    monkeypatch.setattr(fakemode, "_DISPATCH_CACHE_LIMIT", 100)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    gm = torch.fx.symbolic_trace(model)
    fxpipe.passes.annotate(gm, (torch.randn(2, 3, 16),), {})
    prop = infer.Propagator(gm, [n.name for n in gm.graph.nodes if n.op != "output"])
    FakeTensorMode.cache_clear()
    for length in range(1, 31):
        prop([TensorSpec((2, length, 16), torch.float32)])
        assert len(FakeTensorMode.cache) <= 100, length
