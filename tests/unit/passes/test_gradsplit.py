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


class _Reshaping(torch.nn.Module):
    """Flatten batch and time by the input's sizes around a linear, as GPT-2's attention projections do."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        b, t, d = x.shape
        h = torch.tanh(self.a(x))
        h = self.b(h.reshape(b * t, d)).reshape(b, t, d)
        return self.c(torch.tanh(h))


def test_w_gets_the_size_arguments_its_input_shapes_are_made_of(monkeypatch):
    # GPT-2 under zb with inductor: W's input of shape (8*s4, 32) had no source for s4, and inductor failed
    # "expected [s4] to have been codegen-ed" (aot_eager generates no code and ran)
    import fxpipe
    import fxpipe.runtime.stage.aotsplit as aotsplit

    missing = []

    def watched(backward, weight_of):
        cut = split_weight_grads(backward, weight_of)
        vals = [n.meta.get("val") for n in cut.weights.graph.nodes if n.op == "placeholder"]
        shapes = {s for v in vals if isinstance(v, torch.Tensor) for d in v.shape if isinstance(d, torch.SymInt)
                  for s in d.node.expr.free_symbols}
        bound = {s for v in vals if isinstance(v, torch.SymInt) for s in v.node.expr.free_symbols}
        bound |= {d.node.expr for v in vals if isinstance(v, torch.Tensor) for d in v.shape
                  if isinstance(d, torch.SymInt) and d.node.expr.is_symbol}
        missing.append(shapes - bound)
        return cut

    monkeypatch.setattr(aotsplit, "split_weight_grads", watched)
    torch.manual_seed(0)
    x = torch.randn(8, 5, 8)
    pipe = fxpipe.compile(_Reshaping(), 2, example_inputs=(x,), chunks=4, schedule="zb", tracer="export",
                          devices=["cpu"] * 2, split_points=["b"], torch_compile={"backend": "aot_eager"})
    pipe.step(x, target=None, loss_fn=lambda out, _: out.pow(2).mean())
    assert missing and not any(missing), missing
