"""checkpoint= takes a mode, one per stage, or "auto" with max_memory=; save= a predicate: bad values fail early."""

import pytest
import torch
from torch import nn

import fxpipe


def _compile(**kw):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    return fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2, **kw)


@pytest.mark.parametrize("checkpoint, error, text", [
    ("sometimes", ValueError, "use one of 'always'"),
    (["selective"], ValueError, "lists 1 modes for 2 stages"),
    (["selective", "auto"], ValueError, "checkpoint\\[1\\]='auto'"),
    (["never", "maybe"], ValueError, "checkpoint\\[1\\]='maybe'"),
    (3, TypeError, "one mode per stage"),
    ("auto", ValueError, "pass max_memory="),
])
def test_bad_checkpoint_is_refused_naming_the_fix(checkpoint, error, text):
    with pytest.raises(error, match=text):
        _compile(checkpoint=checkpoint)


def test_save_must_be_a_predicate():
    with pytest.raises(TypeError, match="save= must be a function"):
        _compile(checkpoint="selective", save="linear")
    # it was accepted without a word where no stage recomputes selectively
    with pytest.warns(UserWarning, match="checkpoint='always' has no selective stage: it is not used"):
        _compile(checkpoint="always", save=lambda node: True)


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_save_predicate_that_raises_is_named_with_the_node():
    # a predicate reading node.target as a string met a function's target: it was a bare AttributeError
    with pytest.raises(TypeError, match=r"save= raised AttributeError: .* on node 'relu' \(op='call_function'.*"
                                        r"check node.op before reading node.target"):
        fxpipe.compile(_Functional(), 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2,
                       checkpoint="selective", save=lambda node: node.target.startswith("a"))


@pytest.mark.parametrize("checkpoint", ["selective", ["selective", "always"], ("never", "selective")])
def test_good_settings_give_each_stage_its_policy(checkpoint):
    pipe = _compile(checkpoint=checkpoint, chunks=2)
    expected = [checkpoint] * 2 if isinstance(checkpoint, str) else list(checkpoint)
    assert pipe.plan.policies() == expected
    assert pipe.plan.checkpoint == (checkpoint if isinstance(checkpoint, str) else "per stage")
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4), loss_fn=nn.functional.mse_loss)


def test_hugging_face_gradient_checkpointing_is_said_to_save_nothing():
    # the trace runs through a model's own torch.utils.checkpoint calls (Hugging Face's
    # gradient_checkpointing_enable()): the stages kept every activation with no word of it
    class Checkpointed(nn.Sequential):
        is_gradient_checkpointing = True

    class Transformers5(nn.Sequential):  # the name transformers 5 reads, the old one deprecated (warning at a read)
        is_activation_checkpointing = True

        @property
        def is_gradient_checkpointing(self):
            raise AssertionError("read the deprecated flag")

    class Wrapper(nn.Module):  # PEFT's PeftModel: forwards unknown attributes to the model inside
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, x):
            return self.inner(x)

    for kind in (Checkpointed, Transformers5, Wrapper):
        layers = (nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        model = Wrapper(Transformers5(*layers)) if kind is Wrapper else kind(*layers)
        with pytest.warns(UserWarning, match=rf"{kind.__name__} has gradient checkpointing on .* saving no memory.*"
                                             r"gradient_checkpointing_disable\(\)"):
            fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2)


def test_timm_grad_checkpointing_is_said_to_save_nothing():
    # timm's set_grad_checkpointing(True) sets grad_checkpointing on the model or its stages: traced through, silently
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))
    model[2].grad_checkpointing = True
    with pytest.warns(UserWarning, match=r"has gradient checkpointing on \(timm's set_grad_checkpointing\(\)\).*"
                                         r"set_grad_checkpointing\(False\)"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2)
