"""Cutting a backward graph into I (input gradients) and W (weight gradients)."""

import operator

import torch
import torch.fx

from fxpipe.passes.gradsplit import split_weight_grads


def _pair(x):
    """Stand in for a multi-output backward op (a batch norm's): the input's gradient and the weight's."""
    return x + 1, x * 2


torch.fx.wrap("_pair")


def test_i_hands_w_the_elements_of_a_tuple_not_the_tuple():
    # inductor compiles I and W apart and returns tensors only: a carried tuple failed its output check
    g = torch.fx.Graph()
    grad = g.placeholder("grad")
    pair = g.call_function(_pair, (grad,))
    g_in = g.call_function(operator.getitem, (pair, 0))
    g_w = g.call_function(torch.mul, (g.call_function(operator.getitem, (pair, 1)), 3))
    g.output((g_in, g_w))
    backward = torch.fx.GraphModule(torch.nn.Module(), g)
    cut = split_weight_grads(backward, [1])
    i_out = next(n for n in cut.inputs.graph.nodes if n.op == "output").args[0]
    assert all(n.target is not _pair for n in i_out), i_out
    x = torch.randn(3)
    from_i = cut.inputs(x)
    assert torch.equal(from_i[0], x + 1)
    (w,) = cut.weights(*from_i[1:])
    assert torch.equal(w, x * 2 * 3)
