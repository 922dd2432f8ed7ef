"""What selective recomputation keeps, how it groups the rest, and the neighbouring cuts."""

import torch
from fxpipe.passes.selective import expensive, selective_plan
from fxpipe.passes.shift import neighbours
from models import DecoderBlock, TableDecoderBlock
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.plan.assign import annotate_graph
from fxpipe.simulate.measure import retain_anywhere


def _plan(model, x, annotate=True, save=None):
    gm = fxpipe.trace(model)
    if annotate:
        annotate_graph(gm, (x,), {})
    return gm, selective_plan(gm, save=save)


def _by_name(plan):
    return {n: (s, seg, c) for n, s, seg, c in zip(plan.names, plan.saved, plan.segment, plan.crossing)}


def test_gemms_and_attention_are_kept_and_the_rest_recomputed():
    _gm, plan = _plan(DecoderBlock(32, 4, 96, 16), torch.randn(2, 16, 32))
    kept = {n for n, s in zip(plan.names, plan.saved) if s}
    assert kept == {"q", "k", "v", "o", "gate", "up", "down", "scaled_dot_product_attention"}
    nodes = _by_name(plan)
    # silu runs before `up` in the graph but after the same level of kept nodes as the mul that reads it
    assert not nodes["silu"][2] and nodes["silu"][1] == nodes["mul_12"][1]
    # the residual stream (add_3: x + o(...)) is read again after the MLP (add_5): kept, so that no
    # recomputation reaches back; the norm reading it (mul_10) is recomputed from it
    assert nodes["add_3"][2] and not nodes["mul_10"][2] and nodes["mul_10"][1] == nodes["add_3"][1]


def test_without_annotation_the_call_target_decides():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Conv1d(8, 8, 1), nn.Tanh())
    gm = fxpipe.trace(model)
    assert [expensive(n) for n in gm.graph.nodes if n.op == "call_module"] == [True, False, True, False]


class Matmuls(nn.Module):
    """A leaf module doing a matmul inside: expensive by its annotated FLOPs per element."""

    def forward(self, x):
        return torch.tanh(x @ x.transpose(-1, -2))


def test_annotated_flops_per_element_make_a_leaf_expensive():
    model = nn.Sequential(Matmuls(), nn.ReLU())
    x = torch.randn(2, 32, 32)
    gm = fxpipe.trace(model, leaf_modules=[Matmuls])
    annotate_graph(gm, (x,), {})
    assert [expensive(n) for n in gm.graph.nodes if n.op == "call_module"] == [True, False]


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.sigmoid(self.a(x))
        h = h * 2
        h.relu_()  # writes h in place: h's node and the write are kept, never recomputed
        return self.b(torch.tanh(h))


def test_an_in_place_write_and_what_it_writes_are_kept():
    _gm, plan = _plan(InPlace(), torch.randn(4, 8))
    nodes = _by_name(plan)
    assert nodes["mul"][0] and nodes["relu_"][0]
    assert not nodes["sigmoid"][0] and not nodes["tanh"][0]


def test_running_statistics_are_updated_once():
    _gm, plan = _plan(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), torch.randn(2, 3, 8, 8))
    assert plan.saved == [True, True, False]


def _kept_with_retains(model, save=None):
    """Return the nodes selective recomputation keeps once backward's retained values are annotated."""
    gm, _plan0 = _plan(model, torch.randn(2, 16, 32))
    retain_anywhere(gm)
    plan = selective_plan(gm, save=save)
    return {n for n, s in zip(plan.names, plan.saved) if s}


def test_rotary_outputs_are_kept_instead_of_q_and_k_when_the_tables_are_buffers():
    # recomputing rope from q and k only hands its outputs back to attention's backward: keeping the
    # outputs (as big as q and k, which are then freed) recomputes nothing
    kept = _kept_with_retains(TableDecoderBlock(32, 4, 96, 16))
    assert kept == {"q", "k", "v", "o", "gate", "up", "down", "scaled_dot_product_attention", "stack", "stack_1"}


def test_no_swap_where_rope_makes_its_tables_per_call_or_a_predicate_decides():
    # tables made per call are retained by rope's own backward: recomputing them needs q and k kept anyway
    assert "stack" not in _kept_with_retains(DecoderBlock(32, 4, 96, 16))
    assert _kept_with_retains(TableDecoderBlock(32, 4, 96, 16), save=lambda n: n.name == "down") == {"down"}


def test_a_predicate_decides_instead():
    _gm, plan = _plan(DecoderBlock(32, 4, 96, 16), torch.randn(2, 16, 32), save=lambda n: n.name == "down")
    assert {n for n, s in zip(plan.names, plan.saved) if s} == {"down"}


def test_neighbouring_cuts_move_one_boundary_to_the_next_narrow_cut():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(6)])
    gm = fxpipe.trace(model)
    annotate_graph(gm, (torch.randn(4, 16),), {})
    cut = passes.partition(gm, 2)
    assert cut.starts == [0, 9]  # three blocks each
    moved = neighbours(gm, cut)
    assert moved == [[0, 6], [0, 12]]  # a block less, a block more for the first stage
    assert all(cut.widths[s[1]] == cut.widths[9] for s in moved)
