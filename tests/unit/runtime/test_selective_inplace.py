"""Selective recomputation around in-place ops that write a norm's output through a module returning its input."""

import copy

import pytest
import torch
import torch.nn.functional as F
from fxpipe.passes.inplace import static_mutations
from fxpipe.passes.selective import selective_plan
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent, max_relative_error


class GroupNormAct(nn.GroupNorm):
    """timm's ``GroupNormAct``: ``F.group_norm``, a drop layer (``nn.Identity``), an in-place activation."""

    def __init__(self, c: int, drop: nn.Module) -> None:
        super().__init__(2, c)
        self.drop, self.act = drop, nn.ReLU6(inplace=True)

    def forward(self, x):
        return self.act(self.drop(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)))


class BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: its own forward over ``F.batch_norm``, then ``nn.Identity`` and ``ReLU6(inplace)``."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.drop, self.act = nn.Identity(), nn.ReLU6(inplace=True)

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps)
        return self.act(self.drop(x))


class Chain(nn.Module):
    """Convolutions and norm-act layers in a chain (no residual between them), as EfficientNet's blocks."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(4))
        self.norms = nn.ModuleList(norm(8) for _ in range(4))

    def forward(self, x):
        h = x
        for conv, norm in zip(self.convs, self.norms):
            h = norm(conv(h))
        return (h + x).mean((2, 3))


@pytest.mark.parametrize("drop", [nn.Identity, lambda: nn.Dropout(0.0)], ids=["identity", "dropout0"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_norm_written_in_place_through_an_identity_is_kept(schedule, drop):
    # the norm was recomputed from its input while the activation had overwritten its output:
    # gradients 129% off (timm's GroupNormAct, BatchNormAct2d under deferred_batch_norm=True)
    torch.manual_seed(0)
    model = Chain(lambda c: GroupNormAct(c, drop()))
    assert_pipeline_equivalent(model, (torch.randn(8, 8, 6, 6),), n_stages=2, chunks=4, checkpoint="selective",
                               devices=["cpu"] * 2, schedules=[schedule])


def test_the_graph_alone_says_an_identity_passes_its_input_through():
    gm = torch.fx.symbolic_trace(Chain(lambda c: GroupNormAct(c, nn.Identity())))
    written = {node.name: [n.name for n in group] for node, group in static_mutations(gm).items()}
    assert written["norms_0_act"] == ["group_norm", "norms_0_drop"]
    plan = selective_plan(gm)
    assert plan.saved[plan.names.index("group_norm")]  # kept: an in-place write reaches it


def test_deferred_batch_norm_traced_through_equals_eager_under_selective():
    torch.manual_seed(0)
    model = Chain(BatchNormAct).train()
    x, y = torch.randn(8, 8, 6, 6), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    for xi, yi in zip(x.chunk(4), y.chunk(4)):  # each micro-batch normalized by its own statistics
        (F.mse_loss(eager(xi), yi) / 4).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2, checkpoint="selective",
                          deferred_batch_norm=True)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name
