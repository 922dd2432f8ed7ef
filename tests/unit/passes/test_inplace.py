"""In-place analysis: mutations seen on fake tensors or by name, copies planned, conflicts found."""

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.testing import assert_pipeline_equivalent


class Mutations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x.mul_(2)
        h = self.a(x)
        w = h[:, :2]
        w.add_(1)  # through a view: changes h too
        return self.act(h)


def test_annotate_records_what_each_node_changes_in_place():
    gm = passes.annotate(fxpipe.trace(Mutations()), (torch.randn(3, 4),))
    mutates = {n.name: n.meta["fxpipe.mutates"] for n in gm.graph.nodes}
    assert mutates["mul_"] == ["x"]
    assert mutates["add_"] == ["a", "getitem"]
    assert mutates["act"] == ["a", "getitem", "add_"]  # an inplace module, seen by its effect
    assert mutates["a"] == [] and mutates["getitem"] == []


def test_static_detection_follows_views():
    gm = fxpipe.trace(Mutations())
    found = {n.name: [m.name for m in ms] for n, ms in passes.static_mutations(gm).items()}
    assert found == {"mul_": ["x"], "add_": ["a", "getitem"], "act": ["a", "getitem", "add_"]}


def _plan(model, split_points, annotate=True):
    gm = fxpipe.trace(model)
    if annotate:
        passes.annotate(gm, (torch.randn(3, 4),))
    passes.partition_at(gm, split_points)
    return passes.plan_mutations(gm)


def test_plan_copies_the_changed_inputs_of_each_stage():
    for annotate in (True, False):
        plan = _plan(Mutations(), ["getitem"], annotate)
        assert plan.copies == {0: ["x"], 1: ["a"]} and not plan.conflicts
        assert plan.mutated_model_inputs == ["x"]


class ReadAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x) + 1
        g = self.b(h * 1)
        h.mul_(2)
        return g + h


def test_plan_reports_a_later_reader_as_a_conflict():
    plan = _plan(ReadAfter(), ["b", "mul_", "add_1"])
    assert plan.conflicts == [passes.Conflict("mul_", 2, "add", "add_1", 3, ["add"])]
    assert _plan(ReadAfter(), ["b", "mul_"]).copies == {2: ["add"]}


def test_copy_on_write_rewires_every_use_but_the_copy():
    gm = fxpipe.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)))
    passes.copy_on_write(gm, ["input_1"])
    copy = next(n for n in gm.graph.nodes if n.target is passes.inplace.clone_tree)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert list(x.users) == [copy]
    inp = torch.randn(2, 4)
    before = inp.clone()
    gm(inp)
    assert torch.equal(inp, before)


class _ReluInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return F.relu(self.conv(x), inplace=True)


class _Branches(nn.Module):
    """Four identical branches whose in-place ReLUs each change only their own conv's output."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([_ReluInplace() for _ in range(4)])

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


def test_identical_nodes_do_not_share_values_when_ops_work_in_place():
    # Annotation reuses the result of a node for later nodes of the same signature; had it
    # done so here, the four convs would share one tensor and every in-place ReLU would seem
    # to change all of them (and a stage reading two of them would be refused).
    model = _Branches()
    gm = passes.annotate(fxpipe.trace(model), (torch.randn(4, 4, 5, 5),))
    mutated = {n.name: n.meta["fxpipe.mutates"] for n in gm.graph.nodes if n.meta.get("fxpipe.mutates")}
    assert mutated == {"relu": ["branches_0_conv"], "relu_1": ["branches_1_conv"],
                       "relu_2": ["branches_2_conv"], "relu_3": ["branches_3_conv"]}
    assert_pipeline_equivalent(_Branches(), (torch.randn(4, 4, 5, 5),), n_stages=3, chunks=2,
                               devices=["cpu"] * 3)
