"""Measured time: every node timed on the whole graph, state and random numbers untouched, progress."""

import io

import torch
from models import CNN
from torch import nn
from unet import UNet

import fxpipe
from fxpipe import passes
from fxpipe.testing import assert_pipeline_equivalent


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_every_node_timed_on_a_graph_with_skips():
    model = UNet(depth=2, base=4).train()
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    gm = passes.annotate(fxpipe.trace(model), (x,))
    passes.profile(gm, (x,), repeats=1, warmup=0)
    for node in gm.graph.nodes:
        meta = node.meta
        assert meta["fxpipe.time"] == meta["fxpipe.time_fwd"] + meta["fxpipe.time_bwd"]
        if node.op == "call_module":
            assert meta["fxpipe.time_fwd"] > 0 and meta["fxpipe.time_bwd"] > 0, node.name
        if node.op in ("placeholder", "output"):
            assert meta["fxpipe.time"] == 0
    # batch norm ran in training mode on copies: the running statistics are the model's own
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


def test_progress_line_only_after_the_threshold():
    x = torch.randn(2, 3, 8, 8)
    gm = passes.annotate(fxpipe.trace(CNN()), (x,))
    quiet = io.StringIO()
    passes.profile(gm, (x,), repeats=1, progress_after=60.0, stream=quiet)  # well under a minute
    assert quiet.getvalue() == ""
    log = io.StringIO()
    passes.profile(gm, (x,), repeats=1, progress_after=0.0, stream=log)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("fxpipe: profiling node") and "\r" not in log.getvalue()
    assert lines[-1].startswith(f"fxpipe: profiled {len(gm.graph.nodes)} nodes in")
    tty = _Tty()
    passes.profile(gm, (x,), repeats=1, progress_after=0.0, stream=tty)
    assert tty.getvalue().startswith("\rfxpipe: profiling node") and tty.getvalue().endswith(" s\x1b[K\n")


def test_balance_by_time_reports_measured_ms():
    x = torch.randn(4, 3, 8, 8)
    pipe = assert_pipeline_equivalent(CNN().eval(), (x,), n_stages=2, chunks=2, balance_by="time",
                                      devices=["cpu"] * 2)
    assert all(s.time_ms is not None and s.time_ms > 0 for s in pipe.plan.stages)
    text = str(pipe.plan)
    assert text.splitlines()[0].split()[-3:] == ["ms", "stash", "pop"]
    assert "bottleneck (max/mean measured ms)" in text
    assert pipe.plan.bottleneck() == max(s.time_ms for s in pipe.plan.stages) / (
        sum(s.time_ms for s in pipe.plan.stages) / 2)


def test_in_place_module_backward_is_timed():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    gm = passes.annotate(fxpipe.trace(model), (x,))
    passes.profile(gm, (x,), repeats=1, warmup=0)
    assert all(n.meta["fxpipe.time_bwd"] > 0 for n in gm.graph.nodes if n.op == "call_module")
