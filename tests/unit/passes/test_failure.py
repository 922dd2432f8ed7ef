"""Propagation failures name the node, its module and the likely cause."""

import pytest
import torch
from torch import nn

import fxpipe


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
    model = nn.Sequential(FlexAttention(), nn.Linear(16, 16)).eval().requires_grad_(False)  # no CPU backward
    with torch.no_grad(), pytest.raises(fxpipe.PropagationError, match=r"runs torch.compile inside.*tracer='export'") \
            as caught:
        fxpipe.compile(model, 2, example_inputs=(torch.randn(2, 8, 16),), devices=["cpu"] * 2,
                       leaf_modules=[FlexAttention])
    assert "Proxy" not in str(caught.value)
