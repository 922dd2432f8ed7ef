"""Cost models: cut widths, the memory model, communication weights, per-kind node costs."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import passes


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        s = self.a(x)                     # 3 x 8 floats, read again at the end
        h = self.b(s)
        h = self.c(h) * self.scale
        return h + s + x.sum()


def test_cut_widths_count_values_made_before_and_read_after():
    x = torch.randn(3, 4)
    gm = passes.annotate(fxpipe.trace(Skip()), (x,))
    order = passes.compute_nodes(gm)
    assert [n.name for n in order] == ["a", "b", "c", "mul", "add", "sum_1", "add_1"]
    row = 3 * 8 * 4
    w = passes.cut_widths(gm, order)
    assert w[0] == 3 * 4 * 4                    # the graph input
    assert w[1] == row + 48                     # s, and x (read late by sum)
    assert w[2] == row + row + 48               # s, h, x
    assert w[4] == row + row + 48               # s, mul, x: the parameter scale never counts
    assert w[5] == row + 48                     # add, x
    assert w[6] == row + 4                      # add, the scalar sum
    assert w[7] == row                          # the output


def test_memory_factors():
    assert passes.memory_factors("never", 4) == (1.0, 0.0)
    assert passes.memory_factors("except_last", 4) == (0.25, 0.75)
    assert passes.memory_factors("always", 4) == (0.25, 1.0)
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        passes.memory_factors("sometimes", 4)


def test_comm_weights_by_kind_and_device():
    assert passes.comm_weights(["cpu", "cpu", "cpu"], "flops") == [0.0, 0.0]
    flops = passes.comm_weights(["cpu", "cpu:0"], "flops")[0]
    assert flops == passes.cost.FLOPS_PER_SECOND["cpu"] / passes.cost.BYTES_PER_SECOND[("cpu", "cpu")]
    assert passes.comm_weights(["cpu", "cpu:0"], "time") == [1e3 / passes.cost.BYTES_PER_SECOND[("cpu", "cpu")]]
    assert passes.comm_weights(["cpu", "cpu:0"], "params") == [0.0]


def test_node_costs_per_kind():
    x = torch.randn(3, 4)
    gm = passes.annotate(fxpipe.trace(Skip()), (x,))
    nodes = {n.name: n for n in passes.compute_nodes(gm)}
    order = [nodes["a"], nodes["mul"]]
    assert passes.node_costs(order, "flops") == [
        n.meta["fxpipe.flops"] + n.meta["fxpipe.flops_bwd"] for n in order]
    assert passes.node_costs(order, "params") == [(4 * 8 + 8) * 4, 8 * 4]  # mul reads scale
    f_act = 0.5
    assert passes.node_costs(order, "memory", f_act) == [
        2 * (4 * 8 + 8) * 4 + f_act * 3 * 8 * 4, 2 * 8 * 4 + f_act * 3 * 8 * 4]
    with pytest.raises(ValueError, match="unknown balance_by='luck'"):
        passes.node_costs(order, "luck")
