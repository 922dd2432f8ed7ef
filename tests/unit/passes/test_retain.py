"""The retain pass: what each node's backward keeps, by the value holding it."""

import torch
from torch import nn

import fxpipe
from fxpipe import passes


def test_linear_relu_keeps_the_input_and_the_relu_output_not_the_linear_output():
    gm = fxpipe.trace(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    passes.retain(gm, (torch.randn(5, 8),))
    kept = {n.name: n.meta["fxpipe.retains"] for n in gm.graph.nodes}
    assert kept["_0"] == {"input_1": 5 * 8 * 4}  # the first linear: its input (no parameters)
    assert kept["_1"] == {"_1": 5 * 16 * 4}  # ReLU keeps its own output
    assert kept["_2"] == {"_1": 5 * 16 * 4}  # the second linear: the ReLU's output, again
    assert all("_0" not in k for k in kept.values())  # nobody keeps the first linear's output


def test_storage_no_node_outputs_is_counted_on_the_node():
    gm = fxpipe.trace(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    passes.annotate(gm, (torch.randn(5, 8),))
    passes.retain(gm)  # shapes from the annotations
    norm = gm.graph.find_nodes(op="call_module", target="1")[0]
    assert norm.meta["fxpipe.retains"] == {"_0": 5 * 8 * 4, "": 2 * 5 * 4}  # input, then mean and rstd


def test_nothing_real_runs_and_parameters_are_not_counted():
    model = nn.Linear(8, 8)
    before = model.weight.detach().clone()
    gm = fxpipe.trace(model)
    passes.retain(gm, (torch.randn(3, 8),))
    assert torch.equal(model.weight, before) and model.weight.grad is None
    assert sum(sum(n.meta["fxpipe.retains"].values()) for n in gm.graph.nodes) == 3 * 8 * 4
