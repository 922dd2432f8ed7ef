"""A forward that caches a value in a plain attribute keeps no tracing value in it after compile."""

import io
import warnings

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


class _ActNorm(nn.Module):
    """Glow's ActNorm: parameters set from the first batch it sees, then a flag."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.loc, self.logs = nn.Parameter(torch.zeros(1, c)), nn.Parameter(torch.zeros(1, c))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0, keepdim=True))
                self.logs.data.copy_(-torch.log(x.std(0, keepdim=True) + 1e-6))
            self.initialized = True
        return (x + self.loc) * torch.exp(self.logs)


def test_a_flag_the_traced_forward_flips_is_put_back_and_warned_of_with_the_warm_up_fix():
    # before: the flag said initialised though no batch had reached it, and the graph re-initialised the
    # parameters from every micro-batch of every step (losses 0.32 / 0.25 against eager's 0.37 / 0.93), silently
    model = nn.Sequential(_ActNorm(4), nn.Linear(4, 4))
    x = torch.randn(8, 4) * 3 + 1
    with pytest.warns(UserWarning, match=r"flipped '0.initialized' \(_ActNorm: False -> True\) \(put back\).*"
                                         r"Run one eager forward on a real batch before fxpipe.compile"):
        fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2)
    assert model[0].initialized is False
    model(x)  # the warm-up: initialised, and traced as such
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fxpipe.trace(model)


class _WarnOnce(nn.Module):
    """A one-time guard: warn on the first call only (nothing the graph computes depends on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._warned = False

    def forward(self, x):
        if not self._warned:
            warnings.warn("first call")
            self._warned = True
        return self.lin(x)


def test_a_flag_guarding_no_write_of_the_models_state_is_put_back_quietly():
    # a warn-once guard was warned of as a data-dependent initialisation, naming a warm-up it does not need
    model = nn.Sequential(_WarnOnce(), nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 4),), devices=["cpu"] * 2)
    assert not [w for w in caught if "flipped" in str(w.message)]
    assert model[0]._warned is False  # put back: the trace was no call of the model
