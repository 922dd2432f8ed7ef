"""The plan: a printable table, a JSON round trip, consistent producers and consumers."""

import torch

import fxpipe
from fxpipe.plan import PipelinePlan
from unet import UNet


def _plan():
    model = UNet(depth=3, base=4).eval()
    pipe = fxpipe.compile(model, 4, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=4, devices=["cpu"] * 4)
    return pipe.plan


def test_table_shows_every_stage_and_route():
    plan = _plan()
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    body = [l for l in lines[2:2 + plan.n_stages]]
    assert [int(l.split()[0]) for l in body] == list(range(plan.n_stages))
    assert "bottleneck" in text and "efficiency at chunks=4" in text
    for r in plan.skips:
        assert f"{r.name}: stage {r.src} -> stage {r.dst}" in text


def test_json_round_trip(tmp_path):
    plan = _plan()
    again = PipelinePlan.from_json(plan.to_json())
    assert again == plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert PipelinePlan.load(str(path)) == plan


def test_every_node_in_one_stage_and_values_flow_forward():
    plan = _plan()
    held = [n for s in plan.stages for n in s.nodes]
    compute_and_io = [n for n in plan.graph_nodes]
    assert set(held) == set(compute_and_io)
    producer = plan.producer()
    for s in plan.stages[1:]:
        for v in s.inputs:
            assert producer[v] < s.index


def test_from_dict_refuses_other_data():
    import pytest
    with pytest.raises(ValueError, match="not an fxpipe plan"):
        PipelinePlan.from_dict({"stages": []})
