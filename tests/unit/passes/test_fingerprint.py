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


def test_a_trace_in_another_order_takes_the_other_s_names_and_still_computes_the_same():
    reference = torch.fx.symbolic_trace(Tables(["full", "sliding"]))
    model = Tables(["sliding", "full"])
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 4)
    expected = gm(x)
    assert passes.rename_like(gm, passes.structure(reference))
    assert passes.fingerprint(gm) == passes.fingerprint(reference)
    torch.testing.assert_close(gm(x), expected)


def test_a_graph_computing_other_values_is_not_renamed():
    reference = torch.fx.symbolic_trace(Tables(["full", "sliding"]))
    gm = torch.fx.symbolic_trace(PerKind())
    before = passes.fingerprint(gm)
    assert not passes.rename_like(gm, passes.structure(reference))
    assert passes.fingerprint(gm) == before


class PerKind(Tables):
    """Tables with another op for one kind: the same node names, another computation."""

    def __init__(self):
        super().__init__(["full", "sliding"])

    def forward(self, x):
        return torch.cos(x * self.scale["full"]) + 2 * torch.sin(x * self.scale["sliding"])


class Repeated(Tables):
    """Compute the same sum once per kind, in the given order: nodes of one key, used by different tables."""

    def forward(self, x):
        tables = {}
        for kind in self.order:
            tables[kind] = torch.cos(x * self.scale[kind] + x.sum(-1, keepdim=True))
        return tables["full"] + 2 * tables["sliding"]


def test_repeated_values_are_matched_whichever_copy_comes_first():
    reference = torch.fx.symbolic_trace(Repeated(["full", "sliding"]))
    gm = torch.fx.symbolic_trace(Repeated(["sliding", "full"]))
    x = torch.randn(3, 4)
    expected = gm(x)
    assert passes.rename_like(gm, passes.structure(reference))
    assert [n.name for n in gm.graph.nodes] == [n.name for n in reference.graph.nodes]
    torch.testing.assert_close(gm(x), expected)
