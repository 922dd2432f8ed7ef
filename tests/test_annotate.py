"""Annotation: shapes, bytes and FLOPs from fake tensors, with the model's state untouched."""

import logging

import torch
from torch import nn

import fxpipe
import passes


def test_shapes_bytes_flops():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    gm = passes.annotate(fxpipe.trace(model), (torch.randn(4, 8),))
    nodes = {n.name: n for n in gm.graph.nodes}
    lin = nodes["_0"]
    assert lin.meta["fxpipe.value"].shape == (4, 16) and lin.meta["fxpipe.value"].dtype == torch.float32
    assert lin.meta["fxpipe.bytes"] == 4 * 16 * 4
    assert lin.meta["fxpipe.flops"] == 2 * 4 * 8 * 16
    assert nodes["_1"].meta["fxpipe.flops"] == 4 * 16  # one per element
    assert lin.meta["fxpipe.param_bytes"] == (8 * 16 + 16) * 4


def test_annotate_leaves_buffers_and_parameters_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    passes.annotate(fxpipe.trace(model), (torch.randn(6, 4) * 5 + 3,))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class Nonzero(nn.Module):
    def forward(self, x):
        return x * (x > 0).nonzero().shape[0]


def test_data_dependent_leaf_falls_back_to_real_kernels(caplog):
    model = nn.Sequential(nn.Linear(4, 4), Nonzero(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING):
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), leaf_modules=[Nonzero], devices=["cpu"] * 2)
    assert "data-dependent" in caplog.text
    torch.testing.assert_close(pipe(x), model(x))
