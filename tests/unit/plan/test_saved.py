"""Saved plans: compile(plan=...) reuses the stage assignment; a changed model is refused."""

import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import MLP, TiedTransformer
from torch import nn
from transformer import Block
from unet import UNet

import fxpipe
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.testing import assert_pipeline_equivalent


def _unet(depth=3):
    torch.manual_seed(0)
    return UNet(depth=depth, base=4).eval()


def _layout(plan):
    return [(s.nodes, s.inputs, s.outputs) for s in plan.stages], [(r.name, r.src, r.dst) for r in plan.skips]


def test_saved_plan_is_reused_instead_of_partitioning(tmp_path):
    x = torch.randn(4, 3, 16, 16)
    # split points no cost model would choose, so a re-partition would give other stages
    first = fxpipe.compile(_unet(), 4, example_inputs=(x,), chunks=2, devices=["cpu"] * 4,
                           split_points=["down.0.bn2", "middle", "dec.2.conv2"])
    path = tmp_path / "plan.json"
    first.plan.save(str(path))
    fresh = fxpipe.compile(_unet(), 4, example_inputs=(x,), chunks=2, devices=["cpu"] * 4)
    assert _layout(fresh.plan) != _layout(first.plan)

    again = assert_pipeline_equivalent(_unet(), (x,), n_stages=4, chunks=2, devices=["cpu"] * 4, plan=str(path))
    assert _layout(again.plan) == _layout(first.plan)
    assert again.plan.graph_ops == first.plan.graph_ops and again.plan.graph_targets == first.plan.graph_targets
    # a PipelinePlan object works too, and needs no example inputs
    again = fxpipe.compile(_unet(), 4, devices=["cpu"] * 4, plan=first.plan)
    assert _layout(again.plan) == _layout(first.plan)


def test_plan_records_op_and_target_of_every_node():
    plan = fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(3, 16),), devices=["cpu"] * 2).plan
    assert len(plan.graph_nodes) == len(plan.graph_ops) == len(plan.graph_targets)
    nodes = dict(zip(plan.graph_nodes, zip(plan.graph_ops, plan.graph_targets)))
    assert nodes["layers_0"] == ("call_module", "layers.0 (Linear)")
    assert nodes["relu"] == ("call_function", "torch.nn.functional.relu")
    assert PipelinePlan.from_json(plan.to_json()) == plan


class _Kinds(nn.Module):
    """Build one table per kind in the given order, as ModernBERT builds its rotary tables from a set of strings."""

    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        self.order = order
        self.proj = nn.ModuleDict({k: nn.Linear(8, 8) for k in ("full", "sliding")})
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        tables = {}
        for kind in self.order:  # the trace's node order, and which name means which table, follow the order
            tables[kind] = torch.cos(self.proj[kind](x))
        for i, layer in enumerate(self.layers):
            x = layer(x) * tables["full" if i % 2 else "sliding"]
        return x


def test_a_plan_applies_to_a_trace_in_another_order(tmp_path):
    # a plan saved in one process and loaded in another whose hash seed orders the set otherwise
    x = torch.randn(4, 8)
    first = fxpipe.compile(_Kinds(["full", "sliding"]), 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    path = tmp_path / "plan.json"
    first.plan.save(str(path))
    assert fxpipe.compile(_Kinds(["sliding", "full"]), 2, devices=["cpu"] * 2).plan.graph_nodes != \
        first.plan.graph_nodes
    again = assert_pipeline_equivalent(_Kinds(["sliding", "full"]), (x,), n_stages=2, chunks=2,
                                       devices=["cpu"] * 2, plan=str(path))
    assert again.plan.graph_nodes == first.plan.graph_nodes and _layout(again.plan) == _layout(first.plan)
    # a plan from before the keys were recorded cannot tell the orders apart: refused, as before
    data = json.loads(first.plan.to_json())
    del data["graph_keys"]
    with pytest.raises(fxpipe.PlanMismatchError, match="no longer matches the saved plan"):
        fxpipe.compile(_Kinds(["sliding", "full"]), 2, devices=["cpu"] * 2, plan=PipelinePlan.from_dict(data))


def test_plan_without_ops_from_older_versions_loads_and_is_checked_by_name(tmp_path):
    plan = fxpipe.compile(MLP(), 2, devices=["cpu"] * 2).plan
    data = json.loads(plan.to_json())
    del data["graph_ops"], data["graph_targets"]
    old = PipelinePlan.from_dict(data)
    assert old.graph_ops == [] and old.graph_targets == []
    pipe = fxpipe.compile(MLP(), 2, devices=["cpu"] * 2, plan=old)
    assert _layout(pipe.plan) == _layout(plan)

    class Longer(MLP):
        def forward(self, x):
            return super().forward(x).tanh()

    with pytest.raises(fxpipe.PlanMismatchError, match=r"added \(1\): tanh"):
        fxpipe.compile(Longer(), 2, devices=["cpu"] * 2, plan=old)


def test_removed_nodes_are_named():
    plan = fxpipe.compile(_unet(3), 4, devices=["cpu"] * 4).plan
    with pytest.raises(fxpipe.PlanMismatchError) as info:
        fxpipe.compile(_unet(2), 4, devices=["cpu"] * 4, plan=plan)
    msg = str(info.value)
    assert "no longer matches the saved plan" in msg
    assert "removed (" in msg and "down_2_conv1 (call_module down.2.conv1 (Conv2d))" in msg
    assert "make a new plan" in msg


class _GeluBlock(Block):
    """A block with the second layer norm's output passed through an extra GELU."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(F.gelu(self.norm2(x)))


def test_added_node_is_reported_without_blaming_every_later_node():
    plan = fxpipe.compile(TiedTransformer(), 3, devices=["cpu"] * 3).plan
    changed = TiedTransformer()
    changed.blocks[1].__class__ = _GeluBlock
    with pytest.raises(fxpipe.PlanMismatchError) as info:
        fxpipe.compile(changed, 3, devices=["cpu"] * 3, plan=plan)
    lines = str(info.value).splitlines()
    assert re.fullmatch(r"added \(1\): gelu \(call_function torch\.[\w.]*gelu\)", lines[1].strip())
    assert not any(line.strip().startswith(("removed", "changed")) for line in lines)


class _Swapped(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(4, 4), nn.Linear(4, 4), act

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_changed_op_and_renamed_node_are_reported():
    plan = fxpipe.compile(_Swapped(nn.ReLU()), 2, devices=["cpu"] * 2).plan
    with pytest.raises(fxpipe.PlanMismatchError, match=r"changed \(1\): act: call_module act \(ReLU\) -> "
                                                       r"act: call_module act \(Tanh\)"):
        fxpipe.compile(_Swapped(nn.Tanh()), 2, devices=["cpu"] * 2, plan=plan)

    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU()

        def forward(self, inp):
            return self.b(self.act(self.a(inp)))

    with pytest.raises(fxpipe.PlanMismatchError, match=r"renamed \(1\): x -> inp"):
        fxpipe.compile(Renamed(), 2, devices=["cpu"] * 2, plan=plan)


def test_stage_count_and_arguments_are_checked(tmp_path):
    plan = fxpipe.compile(MLP(), 3, devices=["cpu"] * 3).plan
    with pytest.raises(fxpipe.PlanMismatchError, match="the saved plan has 3 stages but n_stages=2; pass n_stages=3"):
        fxpipe.compile(MLP(), 2, devices=["cpu"] * 2, plan=plan)
    with pytest.raises(ValueError, match="either plan= .* or split_points="):
        fxpipe.compile(MLP(), 3, devices=["cpu"] * 3, plan=plan, split_points=["layers.2", "layers.4"])
    with pytest.raises(TypeError, match="plan= takes a PipelinePlan or the path"):
        fxpipe.compile(MLP(), 3, devices=["cpu"] * 3, plan=3)
    with pytest.raises(FileNotFoundError):
        fxpipe.compile(MLP(), 3, devices=["cpu"] * 3, plan=str(tmp_path / "missing.json"))


def test_plan_that_leaves_a_node_out_is_refused():
    plan = fxpipe.compile(MLP(), 2, devices=["cpu"] * 2).plan
    plan.stages[1].nodes.remove("layers_5")
    with pytest.raises(fxpipe.PlanMismatchError, match="node 'layers_5' is assigned to stage None"):
        fxpipe.compile(MLP(), 2, devices=["cpu"] * 2, plan=plan)


def test_a_saved_plan_fills_the_layout_arguments_left_at_their_defaults(tmp_path):
    x = torch.randn(8, 16)
    first = fxpipe.compile(MLP(), 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=4, schedule="1f1b",
                           checkpoint=["never", "always"])
    path = tmp_path / "plan.json"
    first.plan.save(str(path))
    again = fxpipe.compile(MLP(), 2, example_inputs=(x,), devices=["cpu"] * 2, plan=str(path))
    assert (again.plan.chunks, again.plan.schedule, again.plan.policies()) == (4, "1f1b", ["never", "always"])
    given = fxpipe.compile(MLP(), 2, example_inputs=(x,), devices=["cpu"] * 2, plan=str(path), chunks=2)
    assert given.plan.chunks == 2 and given.plan.schedule == "1f1b"  # an argument given another value wins


def test_a_world_that_cannot_hold_a_saved_plan_s_replicas_names_the_plan(tmp_path, monkeypatch):
    # the generic message suggested data_parallel=1, which cannot undo a plan's replicas (a default takes the plan's)
    plan = fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2).plan
    plan.layout = {"runtime": "distributed", "data_parallel": 2, "data_parallel_shard": False, "tensor_parallel": 1,
                   "stages_per_rank": 1}
    path = tmp_path / "plan.json"
    plan.save(str(path))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun with --nproc-per-node 2, before the group is joined
    with pytest.raises(ValueError, match=re.escape(
            f"the plan '{path}' lays the model out on 4 processes (2 pipeline ranks x 2 replicas, 1 stage(s) per "
            "rank) but 2 are running: launch with --nproc-per-node 4, or make a plan for 2")) as info:
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), runtime="distributed", plan=str(path),
                       data_parallel=1)
    assert "data_parallel=1 cannot undo its replicas" in str(info.value)


def test_a_plan_s_replicas_compiled_in_one_process_are_warned_of(tmp_path):
    # compile(plan=) in one process dropped the plan's dp x tp, silently
    plan = fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2).plan
    plan.layout = {"runtime": "distributed", "data_parallel": 2, "data_parallel_shard": False, "tensor_parallel": 2,
                   "stages_per_rank": 1}
    path = tmp_path / "plan.json"
    plan.save(str(path))
    with pytest.warns(UserWarning, match=r"records data_parallel=2, tensor_parallel=2, which run across ranks: "
                                         r"this pipe runs in one process without them") as record:
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2, plan=str(path))
    assert record[0].filename == __file__  # pointed at the caller's line


def test_a_file_that_is_not_a_plan_is_named(tmp_path):
    # "Expecting value: line 1 column 1 (char 0)", naming nothing
    path = tmp_path / "model.py"
    path.write_text("import torch\n")
    with pytest.raises(ValueError, match=r"model.py' is not a plan \(not JSON: Expecting value"):
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2, plan=str(path))


@pytest.mark.parametrize("key, value", [("chunks", 0), ("stages_per_rank", 0), ("data_parallel", "2"),
                                        ("layout", "distributed"), ("layout.chunks", 2.0)])
def test_a_plan_file_edited_to_a_count_not_positive_names_the_file(tmp_path, key, value):
    # "chunks": 0 written into the file was refused as chunks=0, as if passed to compile
    path = tmp_path / "plan.json"
    fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2).plan.save(str(path))
    data = json.loads(path.read_text())
    where = data if key in ("chunks", "layout") else data["layout"]
    where[key.removeprefix("layout.")] = value
    path.write_text(json.dumps(data))
    shown = key if key in ("chunks", "layout") or key.startswith("layout.") else f"layout.{key}"
    with pytest.raises(ValueError, match=re.escape(f"'{path}' records {shown}={value!r}, where ") + ".* belongs: "
                       "correct the value in the file, or write the plan again"):
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2, plan=str(path))


def test_a_plan_of_your_own_schedule_warns_that_it_runs_gpipe_without_it(tmp_path):
    # the plan records "custom", not the actions: compile(plan=) ran gpipe, silently
    schedule = "0F0 0F1 0I0 0I1 0W0 0W1\n1F0 1B0 1F1 1B1"
    x = torch.randn(4, 16)
    path = tmp_path / "plan.json"
    fxpipe.compile(MLP(), 2, example_inputs=(x,), chunks=2, schedule=schedule, devices=["cpu"] * 2).plan.save(path)
    with pytest.warns(UserWarning, match=r"the plan was compiled with your own schedule, whose actions a plan does not "
                                         r"record: this pipe runs 'gpipe', schedule='s default; pass your schedule's "
                                         r"text as schedule="):
        assert fxpipe.compile(MLP(), 2, example_inputs=(x,), devices=["cpu"] * 2, plan=str(path)).plan.schedule \
            == "gpipe"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # given again: no warning, the schedule runs
        pipe = fxpipe.compile(MLP(), 2, example_inputs=(x,), devices=["cpu"] * 2, plan=str(path), schedule=schedule)
    assert pipe.plan.schedule == "custom"


def test_a_plan_given_another_n_stages_under_torchrun_names_the_stage_count(monkeypatch):
    # a plan of 8 stages (4 ranks x 2) compiled with n_stages=4 was refused as laying the model out on 2 processes
    # ("launch with --nproc-per-node 2"), which was false: the plan is for 4
    plan = fxpipe.compile(MLP(), 4, devices=["cpu"] * 4).plan
    plan.layout = {"stages_per_rank": 2, "data_parallel": 1, "tensor_parallel": 1}
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fxpipe.PlanMismatchError, match=r"the saved plan has 4 stages but n_stages=2; pass n_stages=4 "):
        fxpipe.compile(MLP(), 2, runtime="distributed", plan=plan)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)


def test_a_plan_made_with_a_tensor_for_an_input_fx_fixes_to_none_names_the_input():
    # it said only "renamed (1): mask -> mask_1"
    model, x = _Masked(), torch.randn(4, 8)
    plan = fxpipe.compile(model, 2, example_inputs=(x, torch.rand(4, 8)), devices=["cpu"] * 2).plan
    with pytest.raises(fxpipe.PlanMismatchError, match=r"takes as inputs what this trace fixed to its example's "
                                                       r"value: mask \(to None\).*example inputs like the plan's"):
        fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, plan=plan)
    plan = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2).plan  # and the other way round
    with pytest.raises(fxpipe.PlanMismatchError, match=r"The plan's graph fixed mask to its example's value.*which "
                                                       r"this trace takes as input"):
        fxpipe.compile(model, 2, example_inputs=(x, torch.rand(4, 8)), devices=["cpu"] * 2, plan=plan)
