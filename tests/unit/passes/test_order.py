"""Candidate orders: topological, narrower cuts chosen when bytes cost, unsafe graphs left alone."""

import torch
import torch.nn.functional as F
from fxpipe.passes.order import candidate_orders, is_topological
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.testing import assert_pipeline_equivalent


class Hoisted(nn.Module):
    """A wide value computed first and read last: the traced order carries it across every cut."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(16, 256)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(6)])

    def forward(self, x):
        side = self.side(x)
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h + side[:, :16]


def test_orders_are_topological_and_start_with_the_traced_one():
    x = torch.randn(8, 16)
    gm = passes.annotate(fxpipe.trace(Hoisted()), (x,))
    orders = candidate_orders(gm)
    assert orders[0] == passes.compute_nodes(gm)
    assert len(orders) > 1
    for order in orders:
        assert is_topological(order) and set(order) == set(orders[0])


def test_communication_cost_picks_the_order_with_narrow_cuts():
    x = torch.randn(8, 16)
    # "cpu" and "cpu:0" are different devices, so a crossing byte costs; the wide value stays put
    pipe = assert_pipeline_equivalent(Hoisted(), (x,), n_stages=2, chunks=2, devices=["cpu", "cpu:0"])
    assert "side" in pipe.plan.stages[1].nodes
    assert pipe.plan.stages[0].activation_bytes == 2 * 4 * 16 * 4  # h and x, not the 256-wide side
    traced = passes.annotate(fxpipe.trace(Hoisted()), (x,))
    widths = passes.cut_widths(traced, passes.compute_nodes(traced))
    assert min(widths[1:-2]) >= 4 * 8 * 256  # every cut of the traced order before side's use carries it


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        z = self.b(x)
        y.add_(1)
        return y * z


def test_in_place_graphs_keep_the_traced_order():
    gm = fxpipe.trace(InPlace())
    assert candidate_orders(gm) == [passes.compute_nodes(gm)]


class TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        late = F.dropout(self.a(x), 0.5)  # read last
        h = self.drop(self.b(x))
        return self.c(h) + late


def test_random_ops_keep_their_relative_order():
    gm = fxpipe.trace(TwoDropouts())
    orders = candidate_orders(gm)
    assert len(orders) > 1  # the graph is reorderable ...
    for order in orders:  # ... but the two random draws never swap
        names = [n.name for n in order]
        assert names.index("dropout") < names.index("drop")
