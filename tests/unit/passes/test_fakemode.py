import warnings

import torch
from torch import nn

import fxpipe
from fxpipe.passes.fakemode import fake_mode


def _quantized() -> nn.Module:
    """Return a small model with dynamically quantized linears (packed parameters: TorchScript objects)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def test_a_quantized_model_compiles_twice():
    # the packed parameters hash but cannot be compared: the second trace met the first's cache entry in __eq__
    model, x = _quantized(), torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=1, devices=["cpu"] * 2)
            torch.testing.assert_close(pipe(x), model(x))


def test_the_dispatch_cache_is_off_only_for_script_objects():
    assert not fake_mode(_quantized()).cache_enabled
    assert fake_mode(nn.Linear(2, 2)).cache_enabled == fake_mode(nn.Sequential()).cache_enabled
