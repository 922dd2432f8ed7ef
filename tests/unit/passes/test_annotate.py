"""Annotation: shapes, bytes and FLOPs from fake tensors, with the model's state untouched."""

import logging

import torch
from torch import nn

import fxpipe
from fxpipe import passes


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


def test_backward_flops_count_operands_that_need_gradients():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    gm = passes.annotate(fxpipe.trace(model), (torch.randn(4, 8),))
    nodes = {n.name: n for n in gm.graph.nodes}
    # the first layer's input needs no gradient: only the weight gradient, one matmul
    assert nodes["_0"].meta["fxpipe.flops_bwd"] == nodes["_0"].meta["fxpipe.flops"] == 2 * 4 * 8 * 16
    assert nodes["_1"].meta["fxpipe.flops_bwd"] == 4 * 16  # one per element
    # the last layer: input and weight gradients, two matmuls
    assert nodes["_2"].meta["fxpipe.flops_bwd"] == 2 * nodes["_2"].meta["fxpipe.flops"] == 2 * 2 * 4 * 16 * 4
    for p in model.parameters():
        p.requires_grad_(False)
    gm = passes.annotate(fxpipe.trace(model), (torch.randn(4, 8),))
    assert all(n.meta["fxpipe.flops_bwd"] == 0 for n in gm.graph.nodes)


class Views(nn.Module):
    def forward(self, x):
        y = torch.tanh(x)
        return y.view(-1).reshape(2, -1).transpose(0, 1)


def test_saved_bytes_skip_views():
    gm = passes.annotate(fxpipe.trace(Views()), (torch.randn(4, 8),))
    saved = {n.name: n.meta["fxpipe.saved_bytes"] for n in gm.graph.nodes}
    assert saved["tanh"] == 4 * 8 * 4
    assert saved["view"] == saved["reshape"] == saved["transpose"] == 0


class Stack(nn.Module):
    """Identical blocks, so annotation runs one and looks the others up."""

    def __init__(self, n=6):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU())
                                     for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x) * 0.5
        return x


def test_memo_gives_the_same_annotations_as_running_every_node(caplog):
    from models import FACTORIES
    keys = ["fxpipe.value", "fxpipe.bytes", "fxpipe.flops", "fxpipe.flops_bwd", "fxpipe.saved_bytes"]
    cases = [f() for f in FACTORIES.values()] + [(Stack(), (torch.randn(3, 8),), {})]
    for model, args, kwargs in cases:
        with caplog.at_level(logging.DEBUG, logger="fxpipe.passes.annotate"):
            a = passes.annotate(fxpipe.trace(model), args, kwargs)
        b = passes.annotate(fxpipe.trace(model), args, kwargs, memoize=False)
        for na, nb in zip(a.graph.nodes, b.graph.nodes):
            assert [na.meta[k] for k in keys] == [nb.meta[k] for k in keys], na.name
    hits = int(caplog.records[-1].getMessage().split(", ")[1].split()[0])
    # block 0 reads an input that needs no gradient; blocks 2 to 5 repeat block 1
    assert hits >= 4 * 5


class Constants(nn.Module):
    def forward(self, x):
        return torch.full(x.shape, 1), torch.full(x.shape, 1.0)


class Repeat(nn.Module):
    """A leaf module from outside torch.nn whose output depends on a plain attribute."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x.repeat(1, self.k)


def test_memo_keeps_apart_what_differs():
    gm = passes.annotate(fxpipe.trace(Constants()), (torch.randn(2),))
    dtypes = [n.meta["fxpipe.value"].dtype for n in gm.graph.nodes if n.target is torch.full]
    assert dtypes == [torch.int64, torch.float32]
    model = nn.Sequential(Repeat(1), Repeat(2))
    gm = passes.annotate(fxpipe.trace(model, leaf_modules=[Repeat]), (torch.randn(2, 3),))
    shapes = [n.meta["fxpipe.value"].shape for n in gm.graph.nodes if n.op == "call_module"]
    assert shapes == [(2, 3), (2, 6)]


@torch.fx.wrap
def _zero_small(sizes, x):
    """Write into a list argument (as torchvision's 3-D Swin does to its shift sizes), then use it."""
    for i in range(len(sizes)):
        if sizes[i] > x.shape[-1]:
            sizes[i] = 0
    return x * (1 + sum(sizes))


class _WrappedWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(_zero_small([1, 9], self.a(x)))


def test_a_wrapped_function_writing_into_its_list_argument_compiles_and_equals_eager():
    # propagation handed it torch.fx's immutable_list: "'immutable_list' object does not support mutation",
    # reported as a branch dropped by tracing
    model = _WrappedWrite()
    x = torch.randn(6, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
