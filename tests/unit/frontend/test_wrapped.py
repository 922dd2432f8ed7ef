"""A forward that torch.fx cannot read the arguments of (a decorator's ``*args, **kwargs``) is refused naming tracer='export'.

Hugging Face transformers 5 wraps every model's forward this way and dropped its own torch.fx
tracer; these tiny models stand in for it, so CI covers the message without transformers.
"""

import functools

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent


def passes_through(forward):
    """Wrap ``forward`` as transformers 5's output-handling decorators do."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    @passes_through
    def forward(self, input_ids, attention_mask=None):
        return self.b(torch.relu(self.a(input_ids)))


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] != 4:  # shape checks like transformers 5's mask helpers
            raise ValueError("expected 4 features")
        return self.b(self.a(x))


def test_a_decorated_forward_is_refused_naming_export_and_export_equals_eager():
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(Wrapped(), 2, example_inputs=(torch.randn(4, 4),))
    msg = str(info.value)
    assert "wrapped by a decorator taking (*args, **kwargs)" in msg and "tracer='export'" in msg
    assert "Wrapped.forward (input_ids, attention_mask)" in msg and "Hugging Face" not in msg
    # given concrete_args=, torch.fx's "co_varnames is too small" came instead, with a hint to pass concrete_args
    with pytest.raises(fxpipe.TraceError, match=r"wrapped by a decorator taking \(\*args, \*\*kwargs\)"):
        fxpipe.trace(Wrapped(), concrete_args={"attention_mask": None})
    assert_pipeline_equivalent(Wrapped(), (torch.randn(4, 4),), n_stages=2, chunks=2, devices=["cpu"] * 2,
                               tracer="export")


def test_a_transformers_model_that_fx_cannot_trace_is_told_to_use_export(monkeypatch):
    for model in (Wrapped(), Branching()):
        monkeypatch.setattr(type(model), "__module__", "transformers.models.llama.modeling_llama")
        with pytest.raises(fxpipe.TraceError) as info:
            fxpipe.trace(model)
        msg = str(info.value)
        assert "transformers 5 dropped its torch.fx tracer" in msg and "use tracer='export'" in msg, msg


def test_control_flow_in_the_top_level_forward_names_export():
    with pytest.raises(fxpipe.TraceError, match="or use tracer='export'"):
        fxpipe.trace(Branching())
