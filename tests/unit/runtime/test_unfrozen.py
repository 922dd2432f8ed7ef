"""Parameters frozen at compile and unfrozen afterwards: refused where no gradient could reach them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


def _pipe(schedule, frozen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    n = 4 if schedule in ("interleaved", "zbv") else 2
    split = ["2"] if n == 2 else ["1", "2", "4"]
    extra = {"stages_per_rank": 2} if n == 4 else {}
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    pipe = fxpipe.compile(model, n, example_inputs=(x,), chunks=4, schedule=schedule, devices=["cpu"] * n,
                          split_points=split, **extra)
    return model, pipe, x, y


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved", "zbv"])
def test_a_stage_frozen_at_compile_and_unfrozen_is_refused_naming_the_parameter(schedule):
    # the gradient of a stage frozen at compile is never sent back: unfreezing it left .grad None, silently
    model, pipe, x, y = _pipe(schedule, {"0.weight", "0.bias"})
    pipe.step(x, target=y, loss_fn=F.mse_loss)  # frozen: trains the rest
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    model[0].weight.requires_grad_(True)
    with pytest.raises(fxpipe.PipelineInputError, match=r"parameter '0.weight' \(stage 0\) requires grad now but did "
                                                        r"not when the pipe was compiled.* leave the parameter out"):
        pipe.step(x, target=y, loss_fn=F.mse_loss)
    model[0].weight.requires_grad_(False)  # frozen again: the pipe runs
    pipe.step(x, target=y, loss_fn=F.mse_loss)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_unfreezing_where_the_gradient_flows_anyway_trains_as_eager(schedule):
    # the bias alone frozen: stage 0's output carries a gradient for its weight, so the bias gets one too
    model, pipe, x, y = _pipe(schedule, {"0.bias", "2.weight"})
    eager = copy.deepcopy(model)
    for p in list(model.parameters()) + list(eager.parameters()):
        p.requires_grad_(True)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-6
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name


def test_gpipe_in_one_process_runs_the_unfrozen_stage_as_eager():
    # pipe.step's generated GPipe program is one autograd graph: the unfrozen stage gets its gradient
    model, pipe, x, y = _pipe("gpipe", {"0.weight", "0.bias"})
    eager = copy.deepcopy(model)
    for p in list(model.parameters()) + list(eager.parameters()):
        p.requires_grad_(True)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    assert max_relative_error(model[0].weight.grad, eager[0].weight.grad) < 1e-5


class _Adapted(nn.Module):
    """A frozen base weight beside a trained adapter, and a table sent on without a gradient (RoPE's cos)."""

    def __init__(self):
        super().__init__()
        self.base, self.adapter, self.table = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.base(x) + self.adapter(x)
        cos = torch.cos(self.table(torch.ones_like(x)))  # from the frozen table alone: no gradient back
        return self.head(torch.tanh(h)) * cos[:, :4]


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_frozen_weight_beside_a_trained_adapter_unfrozen_trains_and_one_feeding_the_table_is_refused(schedule):
    # a stage sending any value without a gradient had every frozen parameter refused when unfrozen, the base
    # weight beside a LoRA adapter too, whose gradient comes back through the adapter's outputs (exact with it)
    torch.manual_seed(0)
    model = _Adapted()
    for p in [*model.base.parameters(), *model.table.parameters()]:
        p.requires_grad_(False)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule=schedule, devices=["cpu"] * 2,
                          split_points=["head"])
    eager = copy.deepcopy(model)
    for m in (model, eager):
        m.base.weight.requires_grad_(True)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-6
    assert max_relative_error(model.base.weight.grad, eager.base.weight.grad) < 1e-5
    model.table.weight.requires_grad_(True)
    with pytest.raises(fxpipe.PipelineInputError, match=r"parameter 'table.weight' \(stage 0\) requires grad now"):
        pipe.step(x, target=y, loss_fn=F.mse_loss)
