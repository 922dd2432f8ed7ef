import torch
import torch.fx
from torch import nn

from fxpipe import passes


class Tables(nn.Module):
    """Build one table per kind in the given order, as ModernBERT builds its rotary tables from a set."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.scale = nn.ParameterDict({k: nn.Parameter(torch.ones(4)) for k in ("full", "sliding")})

    def forward(self, x):
        tables = {}
        for kind in self.order:
            tables[kind] = torch.cos(x * self.scale[kind])
        return tables["full"] + 2 * tables["sliding"]


def test_the_same_model_traced_twice_has_one_fingerprint():
    a = passes.fingerprint(torch.fx.symbolic_trace(Tables(["full", "sliding"])))
    b = passes.fingerprint(torch.fx.symbolic_trace(Tables(["full", "sliding"])))
    assert a == b and passes.first_difference(a, b) is None
    assert "0x" not in " ".join(a)  # no object addresses, which differ between processes


def test_a_graph_traced_in_another_order_differs_at_the_first_swapped_node():
    a = passes.fingerprint(torch.fx.symbolic_trace(Tables(["full", "sliding"])))
    b = passes.fingerprint(torch.fx.symbolic_trace(Tables(["sliding", "full"])))
    what = passes.first_difference(a, b)
    assert what == "'scale_sliding = get_attr scale.sliding()' where the other has 'scale_full = get_attr scale.full()'"


def test_constants_count():
    a = passes.fingerprint(torch.fx.symbolic_trace(Tables(["full", "sliding"])))
    assert "mul_2 = call_function _operator.mul(2, cos_1)" in a


def test_a_longer_graph_differs_by_its_length():
    a = passes.fingerprint(torch.fx.symbolic_trace(Tables(["full", "sliding"])))
    assert passes.first_difference(a, a + ["extra = output output(x)"]) == f"{len(a) + 1} nodes where the other has {len(a)}"
