"""Values of every kind cross stage boundaries: None, numbers, strings, nesting, integer tensors.

The action-list runtimes (``pipe.step`` with 1F1B or zero bubble, every schedule across ranks)
detach each value a stage receives and hand back the gradients of its inputs; a value that is
not a tensor must pass through both untouched (:mod:`fxpipe.runtime.stage.worker`).
"""

import pytest
import torch
from models import AttnBlock, Carrier, Mixed, Spectral
from torch import nn

from fxpipe import passes
from fxpipe.runtime.stage.worker import _grad_of, _leaf
from fxpipe.testing import assert_pipeline_equivalent

VALUES = [None, 3, 2.5, "tanh", (None, {"k": [1, None, "s"]}), torch.arange(3), torch.ones(2) > 0]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_leaf_and_grad_pass_non_float_values_through(value):
    for grad in (True, False):
        leaf = _leaf(value, grad)
        assert type(leaf) is type(value)
        if not isinstance(value, torch.Tensor):
            assert leaf == value
    assert _grad_of(_leaf(value, True)) in (None, (None, {"k": [None, None, None]}))


def test_leaf_makes_floats_in_a_structure_require_grad():
    value = (torch.randn(2), None, {"a": torch.arange(2), "b": "x"})
    leaf = _leaf(value, True)
    assert leaf[0].requires_grad and leaf[1] is None and not leaf[2]["a"].requires_grad
    assert _grad_of(leaf)[0] is None and _grad_of(leaf)[2] == {"a": None, "b": None}  # no backward reached it
    leaf[0].sum().backward()
    assert _grad_of(leaf)[0].shape == (2,)


# pipe(x) and pipe.step under every schedule (the fixture runs both); exported graphs (whose
# None, strings and floats are constants) under one schedule each
CASES = [("fx", ["getitem"]),   # cut right after the leaf: the whole dict of mixed values crosses
         ("fx", ["b"]),         # each value crosses on its own
         ("export", ["b"]),     # exported: ints (the row count), integer and no-grad tensors cross
         ("fx", None), ("export", None)]
ONE = {("export", ("b",)): ["1f1b"], ("export", None): ["zb"]}


@pytest.mark.parametrize("tracer,split", CASES)
def test_values_of_every_kind_cross_a_boundary(tracer, split):
    kwargs = dict(leaf_modules=[Mixed]) if tracer == "fx" else {}
    n = 2 if split else 3
    schedules = ONE.get((tracer, tuple(split) if split else None))
    pipe = assert_pipeline_equivalent(Carrier().eval(), (torch.randn(7, 8),), n_stages=n, chunks=3,
                                      split_points=split, devices=["cpu"] * n, tracer=tracer,
                                      schedules=schedules, **kwargs)
    kinds = _kinds_crossing(pipe)
    assert {"int tensor", "float tensor without grad", "int"} <= kinds
    if tracer == "fx" and split:
        assert {"None", "str", "float", "dict"} <= kinds


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_complex_tensor_crossing_a_boundary_carries_its_gradient_back(tracer):
    # 1F1B and zero bubble once gave the stage before a complex value no gradient at all
    split = ["getattr_1"] if tracer == "fx" else ["real"]  # cut right after the FFT
    pipe = assert_pipeline_equivalent(Spectral(), (torch.randn(6, 8),), n_stages=2, chunks=2,
                                      split_points=split, devices=["cpu"] * 2, tracer=tracer)
    assert pipe.plan.stages[1].grad_inputs == ["fft_fft"]


def test_leaf_makes_complex_tensors_require_grad():
    leaf = _leaf((torch.randn(2, dtype=torch.complex64), torch.arange(2)), True)
    assert leaf[0].requires_grad and not leaf[1].requires_grad


def _kinds_crossing(pipe):
    """Return the kinds of the leaves and containers of the values that cross a boundary."""
    nodes = {n.name: n for n in pipe._gm.graph.nodes}
    kinds = set()

    def visit(v):
        if isinstance(v, passes.TensorSpec):
            kinds.add("float tensor" + ("" if v.requires_grad else " without grad")
                      if v.dtype.is_floating_point else "int tensor")
        elif isinstance(v, (tuple, list, dict)):
            kinds.add(type(v).__name__)
            for item in (v.values() if isinstance(v, dict) else v):
                visit(item)
        else:
            kinds.add(type(v).__name__ if v is not None else "None")

    for stage in pipe.plan.stages[1:]:
        for name in stage.inputs:
            visit(nodes[name].meta["fxpipe.value"])
    return kinds


@pytest.mark.parametrize("tracer,split", [("fx", ["getitem"]), ("export", ["out"]), ("fx", None)])
def test_attention_output_with_none_crosses_a_boundary(tracer, split):
    # nn.MultiheadAttention(need_weights=False) returns (out, None); cut right after it
    n = 2 if split else 3
    pipe = assert_pipeline_equivalent(AttnBlock().eval(), (torch.randn(4, 5, 8),), n_stages=n, chunks=2,
                                      split_points=split, devices=["cpu"] * n, tracer=tracer,
                                      schedules=["gpipe"] if tracer == "export" else None)
    if tracer == "fx" and split:
        assert "attn" in pipe.plan.stages[1].inputs  # the tuple (out, None)


class Pair(nn.Module):
    def forward(self, h):
        return h, None


class TupleTwice(nn.Module):
    """A tuple holding None, read by the next stage and again by the one after it (a skip)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.pair = Pair()

    def forward(self, x):
        t = self.pair(self.a(x))
        h = self.b(t[0])
        return self.c(h) + torch.clamp(t[0], min=t[1], max=1.0)


def test_gradients_of_a_tuple_read_by_two_stages_add_up_leaf_by_leaf():
    # before: the gradients of the tuple from its two readers were concatenated as tuples,
    # and the second reader's half was dropped under 1F1B and zero bubble
    pipe = assert_pipeline_equivalent(TupleTwice(), (torch.randn(6, 8),), n_stages=3, chunks=2,
                                      split_points=["getitem", "c"], devices=["cpu"] * 3,
                                      leaf_modules=[Pair])
    assert [r.name for r in pipe.plan.skips] == ["pair"]
