"""One mutation detector: ATen ops by schema, Python calls by name, inplace=True and out=.

Every in-place kind (fill_, copy_, index assignment, masked_fill_, in-place activations as
functions and modules, add_/mul_) is found on both front ends, and pipelines with the cut
right after the mutation, right before it, across it and where the partitioner likes
equal eager (or, across it, are refused).
"""

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from fxpipe.passes.cost import COMPUTE_OPS
from fxpipe.passes.mutates import aliases, is_mutating, may_mutate, written_args
from fxpipe.passes.order import candidate_orders
from fxpipe.passes.signature import node_key
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULES
from fxpipe.testing import assert_pipeline_equivalent

KINDS = ["fill_", "copy_", "setitem", "masked_fill_", "relu_", "module", "add_mul"]
TRACERS = ["fx", "export"]


class Mutate(nn.Module):
    """Change ``h`` in place one way, then read it twice: in ``b``, and in the sum after it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, x):
        h = self.a(x)
        if self.kind == "fill_":
            h[:, :4].fill_(0.5)  # through a view
        elif self.kind == "copy_":
            h[:, 4:].copy_(h[:, :4])
        elif self.kind == "setitem":
            h[:, 1] = 0.0
        elif self.kind == "masked_fill_":
            h.masked_fill_(h > 0.5, 0.5)
        elif self.kind == "relu_":
            F.relu(h, inplace=True)
        elif self.kind == "module":
            self.act(h)
        else:
            h.mul_(2).add_(1)
        g = self.b(h)
        return self.c(torch.tanh(g) + h)


class MaskedMLP(nn.Module):
    """The issue's reproduction: a mask built by index assignment (exported as slice + fill_)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(d, d) for _ in range(6))
        self.g = nn.Linear(d, d)

    def forward(self, x):
        h = self.l[0](x)
        m = torch.zeros(1, x.shape[1])
        m[:, :32] = 1.0
        g = self.g(x)
        h = self.l[1](h) * m
        for layer in self.l[2:]:
            h = layer(h)
        return h + g


def _trace(model, tracer, x):
    return fxpipe.trace(model, tracer=tracer, example_inputs=(x,))


def _mutating(gm):
    return [n for n in gm.graph.nodes if is_mutating(n)]


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_found_on_both_front_ends(kind, tracer):
    gm = _trace(Mutate(kind), tracer, torch.randn(4, 8))
    found = _mutating(gm)
    assert found, gm.graph
    nodes = {n.name: n for n in gm.graph.nodes}
    h = nodes["a"] if tracer == "fx" else nodes["linear"]
    # each mutation writes h, or a view of it
    for node in found:
        written = written_args(node)[0]
        while written is not h:
            assert aliases(written), (node, written)
            written = aliases(written)[0]
    assert candidate_orders(gm) == [[n for n in gm.graph.nodes if n.op in COMPUTE_OPS]]
    assert set(passes.static_mutations(gm)) == set(found)


def test_aten_in_place_ops_are_told_by_their_schema():
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    calls = {
        "fill_": g.call_function(aten.fill_.Scalar, (x, 1.0)),
        "index_put_": g.call_function(aten.index_put_.default, (x, [y], y)),
        "add.out": g.call_function(aten.add.out, (x, y), {"out": y}),
        "packet add_": g.call_function(aten.add_, (x, y)),
        "packet add out": g.call_function(aten.add, (x, y), {"out": y}),
        "torch.add out": g.call_function(torch.add, (x, y), {"out": y}),
        "F.relu positional": g.call_function(F.relu, (x, True)),
        "F.relu keyword": g.call_function(F.relu, (x,), {"inplace": True}),
        "add_ method": g.call_method("add_", (x, y)),
        "setitem": g.call_function(operator.setitem, (x, 0, y)),
        "pure add": g.call_function(aten.add.Tensor, (x, y)),
        "packet add": g.call_function(aten.add, (x, y)),
        "slice": g.call_function(aten.slice.Tensor, (x, 1, 0, 2)),
        "keepdim": g.call_function(torch.sum, (x, 1, True)),
        "requires_grad_": g.call_method("requires_grad_", (x,)),
        "F.relu": g.call_function(F.relu, (x, False)),
    }
    gm = torch.fx.GraphModule(nn.Module(), g)
    written = {k: written_args(n) for k, n in calls.items()}
    assert written == {
        "fill_": [x], "index_put_": [x], "add.out": [y], "packet add_": [x], "packet add out": [y],
        "torch.add out": [y], "F.relu positional": [x], "F.relu keyword": [x], "add_ method": [x],
        "setitem": [x], "pure add": [], "packet add": [], "slice": [], "keepdim": [],
        "requires_grad_": [], "F.relu": []}
    assert aliases(calls["slice"]) == [x] and aliases(calls["fill_"]) == [x] and not aliases(calls["pure add"])
    assert node_key(calls["fill_"], {x: 1, y: 2}, {}) is None
    assert not any(may_mutate(n) for n in gm.graph.nodes if n.op == "placeholder")
    del gm


def test_annotation_evidence_counts_too():
    gm = _trace(Mutate("add_mul"), "fx", torch.randn(4, 8))
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "b")
    assert not is_mutating(node)
    node.meta["fxpipe.mutates"] = ["a"]  # as annotation records a leaf module changing its input
    assert is_mutating(node)


def test_the_issue_s_exported_mask_keeps_its_order():
    # before: aten.fill_ passed as pure, the orderer moved the reader before it, and the
    # exported pipeline was off by 9e-2 with no error
    x = torch.randn(4, 64)
    gm = _trace(MaskedMLP(), "export", x)
    assert [n.target for n in _mutating(gm)] == [torch.ops.aten.fill_.Tensor]
    assert len(candidate_orders(gm)) == 1


def _cut(model, tracer, x, where):
    """Return split points: stage 1 begins at the reader ``b`` (after), or right after ``a`` (before)."""
    if where == "after":
        return ["b"]
    gm = _trace(model, tracer, x)
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    last_a = max(i for i, n in enumerate(compute)
                 if any(path == "a" for path, _ in (n.meta.get("nn_module_stack") or {}).values()))
    first = compute[last_a + 1].name
    return [first] if where == "before" else [first, "b"]


CUTS = ["after", "before", "auto"]


@pytest.mark.parametrize("where", CUTS)
@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_pipelines_equal_to_eager(kind, tracer, where):
    x = torch.randn(6, 8)
    split = None if where == "auto" else _cut(Mutate(kind), tracer, x, where)
    n = 3 if split is None else len(split) + 1
    schedule = SCHEDULES[(KINDS.index(kind) + TRACERS.index(tracer) + CUTS.index(where)) % 3]
    pipe = assert_pipeline_equivalent(Mutate(kind), (x,), n_stages=n, chunks=3, tracer=tracer,
                                      split_points=split, devices=["cpu"] * n, schedules=[schedule])
    if where == "before":  # stage 1 changes h, its input: it works on a private copy
        assert any(node.target is passes.inplace.clone_tree for node in pipe.stages[1].graph.nodes)


@pytest.mark.parametrize("kind,tracer", [("fill_", "fx"), ("setitem", "fx"), ("relu_", "fx"),
                                         ("module", "fx"), ("fill_", "export"), ("setitem", "export")])
def test_a_change_read_by_a_later_stage_is_refused(kind, tracer):
    x = torch.randn(6, 8)
    split = _cut(Mutate(kind), tracer, x, "across")  # stage 1 changes h, stage 2 reads h
    with pytest.raises(fxpipe.MutationError, match="in place, and stage 2 reads it afterwards"):
        fxpipe.compile(Mutate(kind), 3, example_inputs=(x,), tracer=tracer, split_points=split)


@pytest.mark.parametrize("kind", ["relu_", "module"])
def test_exported_in_place_results_flow_on_as_values(kind):
    # torch.export makes later readers of h read the in-place op's result, not h: the same cut
    # that fx refuses sends the changed value on, from stage 1 to stage 2
    x = torch.randn(6, 8)
    split = _cut(Mutate(kind), "export", x, "across")
    pipe = assert_pipeline_equivalent(Mutate(kind), (x,), n_stages=3, chunks=3, tracer="export",
                                      split_points=split, devices=["cpu"] * 3, schedules=["zb"])
    assert pipe.plan.stages[1].outputs


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("split", [None, ["l.1"], "setitem"])
def test_masked_mlp_equals_eager(tracer, split):
    x = torch.randn(4, 64)
    if split == "setitem":  # stage 1 begins where the mask is filled: it fills its input
        gm = _trace(MaskedMLP(), tracer, x)
        split = [next(n for n in gm.graph.nodes if n.op != "get_attr" and n.name.startswith(
            "setitem" if tracer == "fx" else "slice")).name]
    n = 3 if split is None else 2
    assert_pipeline_equivalent(MaskedMLP().eval(), (x,), n_stages=n, chunks=2, tracer=tracer,
                               split_points=split, devices=["cpu"] * n)


def test_the_partitioner_keeps_a_mutation_with_what_it_changes():
    # copy_ writes a view of h: a stage beginning between h and copy_ would make stage 1 change
    # stage 0's value, which the sum after b reads again; the automatic cut avoids that
    gm = passes.annotate(_trace(Mutate("copy_"), "fx", torch.randn(6, 8)), (torch.randn(6, 8),))
    order = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    joined = passes.inplace.joined_positions(gm, order)
    assert [order[p].name for p in sorted(joined)] == ["getitem", "getitem_1", "copy_"]
    passes.partition(gm, 3)
    assert len({n.meta["fxpipe.stage"] for n in order[:4]}) == 1  # a, both views and copy_
    assert not passes.plan_mutations(gm).conflicts
