"""torch.distributed.pipelining's pipe_split() markers and split_spec become fxpipe's split points.

The models follow pipelining's own example models (its test model registry): an MLP pair, a
model whose parameters and linear are aliased under two names, and one whose buffer copy
(needing no gradient) crosses the split.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error

pipelining = pytest.importorskip("torch.distributed.pipelining")
pipe_split, SplitPoint = pipelining.pipe_split, pipelining.SplitPoint

D = 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


class MLPPair(nn.Module):
    """Two MLPs with a marker between them."""

    def __init__(self, marked=True):
        super().__init__()
        self.mlp0, self.mlp1 = MLP(), MLP()
        self.marked = marked

    def forward(self, x):
        x = self.mlp0(x)
        if self.marked:
            pipe_split()
        return self.mlp1(x)


class ParamAlias(nn.Module):
    """The same parameter and linear under two names each, used on both sides of the marker."""

    def __init__(self):
        super().__init__()
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.lin1 = self.lin0 = nn.Linear(D, D)

    def forward(self, x, y):
        x = torch.relu(self.lin0(torch.mm(x, self.mm_param0) + y))
        pipe_split()
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


class BufferCopy(nn.Module):
    """A copy of a buffer, needing no gradient, made before the marker and used after it."""

    def __init__(self):
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.mm_param1 = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.register_buffer("cval", torch.randn(D))
        self.lin0, self.lin1 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, y):
        x = torch.relu(torch.mm(x, self.mm_param0) + y)
        constant = self.cval.clone()
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + constant
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


def _check(model, args, tracer, first_of_stage_1, **kw):
    """Compile at the markers; check the cut, forward and pipe.step against eager."""
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=args, chunks=3, devices=["cpu"] * 2, tracer=tracer, **kw)
    _stage0, stage1 = pipe.plan.stages
    compute = [n for n in stage1.nodes if n not in stage1.inputs]
    gm_nodes = {n.name: n for n in pipe._gm.graph.nodes}
    first = next(n for n in compute if gm_nodes[n].op not in ("get_attr", "placeholder"))
    assert first == first_of_stage_1
    assert max_relative_error(pipe(*args), eager(*args)) < 1e-5
    target = torch.randn(args[0].shape[0], D)
    loss = pipe.step(*args, target=target, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(*args), target)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    return pipe


@pytest.mark.parametrize("tracer, first", [("fx", "mlp1_net1"), ("export", "linear_2")])
def test_mlp_pair_cuts_at_the_marker(tracer, first):
    _check(MLPPair(), (torch.randn(6, D),), tracer, first)


@pytest.mark.parametrize("tracer, first", [("fx", "mm_1"), ("export", "mm_1")])
def test_parameter_alias_cuts_at_the_marker(tracer, first):
    pipe = _check(ParamAlias(), (torch.randn(6, D), torch.randn(6, D)), tracer, first)
    assert set(pipe.state_dict()) == set(ParamAlias().state_dict())


@pytest.mark.parametrize("tracer, first", [("fx", "relu_1"), ("export", "relu_1")])
def test_buffer_copy_crosses_the_marker(tracer, first):
    pipe = _check(BufferCopy(), (torch.randn(6, D), torch.randn(6, D)), tracer, first)
    if tracer == "export":  # fx runs the clone at trace time: a constant, copied into stage 1
        assert "clone" in pipe.plan.stages[1].inputs


@pytest.mark.parametrize("spec, tracer", [({"mlp1": SplitPoint.BEGINNING}, "fx"),
                                          ({"mlp0": SplitPoint.END}, "fx"),
                                          ({"mlp1": SplitPoint.BEGINNING}, "export"),
                                          ({"mlp0.net2": "END"}, "export")])
def test_split_spec_cuts_like_the_marker(spec, tracer):
    first = "mlp1_net1" if tracer == "fx" else "linear_2"
    model = MLPPair(marked=False)
    _check(model, (torch.randn(6, D),), tracer, first, split_spec=spec)
    assert "forward" not in model.mlp1.__dict__  # the model is not patched


def test_split_points_override_the_markers():
    pipe = fxpipe.compile(MLPPair(), 3, split_points=["mlp0.net2", "mlp1.net2"])
    assert [s.nodes[-1] for s in pipe.plan.stages[:2]] == ["relu", "relu_1"]  # not at the marker


@pytest.mark.parametrize("kwargs, match", [
    ({"n_stages": 3}, r"make 2 stages.*pass n_stages=2"),
    ({"n_stages": 2, "split_spec": {"mlp9": SplitPoint.END}}, "no module that forward runs"),
    ({"n_stages": 2, "split_spec": {"mlp0": "MIDDLE"}}, "SplitPoint.BEGINNING or SplitPoint.END"),
    ({"n_stages": 3, "split_spec": {"mlp1": SplitPoint.END}}, "leaves the last stage empty"),
    ({"n_stages": 2, "split_spec": {"mlp0": SplitPoint.BEGINNING}}, "leaves stage 0 empty"),
    ({"n_stages": 2, "split_spec": {"mlp1": SplitPoint.END}, "split_points": ["mlp1"]}, "not both"),
])
def test_bad_markers_are_refused(kwargs, match):
    model = MLPPair()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        fxpipe.compile(model, kwargs.pop("n_stages"), **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
