"""Which linears zero bubble defers: as the runtime does, only those whose input needs a gradient."""

import torch
from torch import nn

from fxpipe.passes.linears import defers_weight_grad, model_defers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))) + self.frozen(x)


def _deferred(gm, rule):
    return {n.name for n in gm.graph.nodes if rule(gm, n)}


def test_a_linear_on_the_models_input_keeps_its_weight_gradient_in_the_backward():
    # the runtime defers only when x.requires_grad: the model's input needs no gradient
    gm = torch.fx.symbolic_trace(Net())
    assert _deferred(gm, model_defers) == {"second"}
    assert _deferred(gm, defers_weight_grad) == {"first", "second"}  # what a stage rewrites: its inputs may need one
    assert not defers_weight_grad(gm, next(n for n in gm.graph.nodes if n.name == "second"), autocast=True)
