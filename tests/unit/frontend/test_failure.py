"""A node that fails on the example inputs is named with its module, and the likely cause given."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.testing import assert_pipeline_equivalent


class UpCat(nn.Module):
    """Upsample and concatenate a skip when there is one, as MONAI's BasicUNet does."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = nn.Conv2d(cin // 2 + cskip, cout, 3, padding=1)

    def forward(self, x, x_e):
        x0 = self.up(x)
        if x_e is not None and torch.jit.isinstance(x_e, torch.Tensor):  # False for an fx Proxy
            return self.conv(torch.cat([x_e, x0], dim=1))
        return self.conv(x0)


class TinyUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.upcat = UpCat(16, 8, 8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x0 = F.relu(self.inc(x))
        return self.head(F.relu(self.upcat(F.relu(self.down(x0)), x0)))


def test_a_tracer_that_drops_a_branch_is_named_with_the_node_and_module():
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(fxpipe.PropagationError) as info:
        fxpipe.compile(TinyUNet(), 2, example_inputs=(x,))
    msg = str(info.value)
    assert msg.startswith("node 'upcat_conv' (call_module upcat.conv: Conv2d) in module 'upcat' (UpCat) "
                          "fails on the example inputs: RuntimeError: Given groups=1")
    assert "torch.jit.isinstance(x, torch.Tensor)" in msg and "Use tracer='export'" in msg
    assert "leaf_modules=[UpCat]" in msg
    assert isinstance(info.value, RuntimeError) and info.value.node == "upcat_conv"
    assert info.value.module == "upcat"


@pytest.mark.parametrize("kwargs", [dict(tracer="export"), dict(leaf_modules=[UpCat])])
def test_the_suggested_fixes_equal_eager(kwargs):
    assert_pipeline_equivalent(TinyUNet().eval(), (torch.randn(2, 3, 8, 8),), n_stages=2, chunks=2,
                               devices=["cpu"] * 2, schedules=["zb"], **kwargs)


def test_an_exported_graph_is_not_told_to_use_export():
    gm = fxpipe.trace(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tracer="export",
                      example_inputs=(torch.randn(3, 4),))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    err = passes.failure.explain(gm, node, RuntimeError("shapes cannot be multiplied\nmore"))
    assert str(err).startswith(f"node '{node.name}' (call_function ") and "in module '0'" in str(err)
    assert str(err).endswith("RuntimeError: shapes cannot be multiplied")


def test_example_inputs_too_small_for_the_model_are_named_as_a_cause():
    # Inception-v3's aux head at 160 px: a pooling larger than its input fails on the example,
    # and the message blamed only the trace
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AvgPool2d(8), torch.nn.Flatten())
    with pytest.raises(fxpipe.PropagationError, match=r"If it does not, the example inputs do not fit the model "
                                                      r"\(an image too small for its pooling"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(2, 3, 6, 6),))


class FlexAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(flex_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


def test_a_leaf_running_torch_compile_inside_names_export_not_a_dropped_branch():
    # flex_attention compiles itself even when called eagerly: not on fxpipe's fake tensors. The message
    # blamed a check on a traced Proxy or inputs that do not fit
    # (torch 2.14 runs it on fake tensors: the pipe then equals eager)
    model = nn.Sequential(FlexAttention(), nn.Linear(16, 16)).eval().requires_grad_(False)  # no CPU backward
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        try:
            pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, leaf_modules=[FlexAttention])
        except fxpipe.PropagationError as exc:
            assert re.search(r"runs torch.compile inside.*tracer='export'", str(exc), re.S), exc
            assert "Proxy" not in str(exc)
        else:
            torch.testing.assert_close(pipe(x), model(x))
