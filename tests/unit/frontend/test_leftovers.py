"""A forward that caches a value in a plain attribute keeps no tracing value in it after compile."""

import io

import pytest
import torch
from torch import nn

import fxpipe


class _Cached(nn.Module):
    """Cache a computed bias in eval mode, as timm's LeViT caches its attention biases."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.cache = {}

    def forward(self, x):
        if self.training:
            bias = self.scale * 2
        else:
            if "bias" not in self.cache:
                self.cache["bias"] = self.scale * 2
            bias = self.cache["bias"]
        return self.b(torch.tanh(self.a(x))) + bias


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_cache_filled_while_tracing_is_put_back(tracer):
    # the eval-mode trace left an fx Proxy (a fake tensor under export) in the cache: the model's next
    # eval call and torch.save(model) failed after compile
    torch.manual_seed(0)
    model, x = _Cached(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, tracer=tracer)
    assert model.cache == {}
    model.eval()
    with torch.no_grad():
        expected = model(x)
    assert isinstance(model.cache["bias"], torch.Tensor) and type(model.cache["bias"]) is torch.Tensor
    torch.save(model, io.BytesIO())
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), expected)
