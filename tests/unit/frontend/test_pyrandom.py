"""A forward drawing Python's or NumPy's random numbers while traced: the graph keeps them, and a warning says so."""

import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

import fxpipe


class LayerDrop(nn.Module):
    """Skip layers at random in training, drawn with Python's random as older audio models do."""

    def __init__(self, draw) -> None:
        super().__init__()
        self.layers, self.draw = nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), draw

    def forward(self, x):
        for layer in self.layers:
            if not self.training or self.draw() > 0.1:
                x = layer(x)
        return x


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("owner", [random, np.random], ids=["random", "numpy"])
def test_a_python_random_draw_is_named_with_its_line_and_the_fixes(tracer, owner, caplog):
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="fxpipe.frontend.pyrandom"):
        fxpipe.compile(LayerDrop(lambda: owner.random()).train(), 2, example_inputs=(x,), devices=["cpu"] * 2,
                       tracer=tracer)
    messages = [r.getMessage() for r in caplog.records if r.name == "fxpipe.frontend.pyrandom"]
    assert len(messages) == 1, messages  # one warning, not one per trace
    assert "draws Python or NumPy random numbers while traced: " in messages[0]
    assert "test_pyrandom.py:" in messages[0] and "keeps or drops the same layers" in messages[0]
    assert ("leaf_modules=" if tracer == "fx" else "tracer='fx'") in messages[0]


def test_torch_random_numbers_warn_nothing(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    with caplog.at_level(logging.WARNING, logger="fxpipe.frontend.pyrandom"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2)
    assert not [r for r in caplog.records if r.name == "fxpipe.frontend.pyrandom"]
    assert random.random is not None and "noted" not in random.random.__name__  # put back after the trace


class BatchMask(nn.Module):
    """Mask rows drawn with NumPy at the batch's size (Wav2Vec2's SpecAugment does so in training)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        keep = np.random.rand(x.shape[0]) < 0.5
        return self.a(x) * torch.as_tensor(keep, dtype=x.dtype).unsqueeze(1)


def test_an_export_refusal_names_the_random_draws_and_the_model_s_line_not_numpy_s():
    # before: the refusal named a line inside NumPy and suggested batch-size fixes only
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(BatchMask(), 2, example_inputs=(torch.randn(8, 4),), tracer="export", devices=["cpu"] * 2)
    message = str(info.value)
    assert "numpy.random.rand (" in message and "test_pyrandom.py" in message and "mask_time_prob=0" in message
    assert "site-packages/numpy" not in message and "numpy/lib" not in message
