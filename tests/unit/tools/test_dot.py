"""The graph picture: nodes clustered by stage, boundary edges and skip routes drawn apart."""

import re

import pytest
import torch
from unet import UNet

import fxpipe
from fxpipe.tools import dot


@pytest.fixture(scope="module")
def unet_pipe():
    model = UNet(depth=3, base=4).eval()
    return fxpipe.compile(model, 4, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=2, devices=["cpu"] * 4)


def _clusters(source):
    """Map each node name to the cluster (stage) whose block declares it."""
    where, stage = {}, None
    for line in source.splitlines():
        m = re.match(r"\s*subgraph cluster_(\d+) \{", line)
        if m:
            stage = int(m.group(1))
        elif line.strip() == "}":
            stage = None
        else:
            m = re.match(r'\s*"([^"]+)" \[label=', line)
            if m and stage is not None:
                where[m.group(1)] = stage
    return where


def _edges(source):
    """Map (producer, consumer) to the edge's attribute text."""
    return {(a, b): attrs or "" for a, b, attrs in
            re.findall(r'^\s*"([^"]+)" -> "([^"]+)"(?: \[(.*)\])?;$', source, flags=re.M)}


def test_nodes_are_clustered_by_their_stage(unet_pipe):
    source = dot.to_dot(unet_pipe._gm, unet_pipe.plan, title="UNet")
    where = _clusters(source)
    for s in unet_pipe.plan.stages:
        own = [n for n in s.nodes if n in where and where[n] == s.index]
        assert own, f"stage {s.index} has no nodes in its cluster"
    compute = {n.name: n.meta["fxpipe.stage"] for n in unet_pipe._gm.graph.nodes}
    assert where == compute
    assert source.count("subgraph cluster_") == 4
    assert 'label="UNet: 4 stages"' in source


def test_boundary_edges_and_skip_routes_are_drawn_distinctly(unet_pipe):
    plan = unet_pipe.plan
    edges = _edges(dot.to_dot(unet_pipe._gm, plan))
    stage = {n.name: n.meta["fxpipe.stage"] for n in unet_pipe._gm.graph.nodes}
    skips = {(r.name, r.dst) for r in plan.skips}
    assert skips, "the example needs skip routes"
    for (a, b), attrs in edges.items():
        hop = stage[b] - stage[a]
        if hop == 0:
            assert "penwidth" not in attrs
        elif hop == 1:
            assert 'color="#d62728"' in attrs and "dashed" not in attrs
        else:
            assert (a, stage[b]) in skips
            assert "style=dashed" in attrs and f"skip {stage[a]}->{stage[b]}" in attrs
    drawn = {(a, stage[b]) for (a, b), attrs in edges.items() if "dashed" in attrs}
    assert drawn == skips
    # labels give bytes per micro-batch, as the plan's skip routes do
    for r in plan.skips:
        label = next(attrs for (a, b), attrs in edges.items() if a == r.name and stage[b] == r.dst)
        assert fxpipe.plan.pipeline.human(r.bytes, "B") in label


@pytest.mark.skipif(not dot.graphviz_available(), reason="Graphviz's dot is not installed")
def test_renders_with_graphviz(unet_pipe, tmp_path):
    path = tmp_path / "unet.svg"
    dot.render(dot.to_dot(unet_pipe._gm, unet_pipe.plan), str(path))
    svg = path.read_text()
    assert "<svg" in svg
    assert svg.count('class="cluster"') == 4
    for r in unet_pipe.plan.skips:
        assert f"<title>{r.name}</title>" in svg


def test_render_without_graphviz_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(dot.shutil, "which", lambda name: None)
    assert not dot.graphviz_available()
    with pytest.raises(FileNotFoundError, match="apt install graphviz"):
        dot.render("digraph {}", str(tmp_path / "x.svg"))
