"""fxpipe.deferred_init(): a model built on meta gets, per stage, the values its own __init__ gives."""

import copy
import re

import pytest
import torch
from models import RMSNorm, RopeDecoder, assert_same, deferred, tensors, token_loss
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxpipe
from fxpipe.materialize.fill import fill, module_seed
from fxpipe.testing import max_relative_error

DETERMINISTIC = ("norm.weight", "down.bias", "rope.inv_freq", "mask")  # name endings: ones, zeros, tables
IDS = torch.randint(1, 96, (4, 16), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))


def random_weights(model: nn.Module) -> torch.Tensor:
    """The values of every tensor drawn at random: linear weights and the embedding's rows but the padding one."""
    parts = [m.weight.detach().flatten() for m in model.modules() if isinstance(m, nn.Linear) and m is not model.head]
    return torch.cat([*parts, model.embed.weight.detach()[1:].flatten()])


class Allocations(TorchDispatchMode):
    """Count the bytes of every storage the ops run under it make, and which ops ran on what shapes."""

    def __init__(self):
        super().__init__()
        self.bytes, self.seen, self.kept, self.calls = 0, set(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.kept.append(t.untyped_storage())  # alive, so no later storage reuses its address unseen
                self.bytes += t.untyped_storage().nbytes()
        return out


# -- building ---------------------------------------------------------------------------------------
def test_building_allocates_nothing_and_draws_no_random_numbers():
    state = torch.get_rng_state()
    model = deferred()
    assert all(t.is_meta for t in tensors(model).values())
    assert model.head.weight is model.embed.weight
    assert torch.equal(torch.get_rng_state(), state)  # random inits ran on meta: the generator is untouched
    assert torch.empty(2).device.type == "cpu"  # the context is over


# -- values ------------------------------------------------------------------------------------------
def test_deterministic_tensors_equal_the_eager_build_exactly():
    eager = RopeDecoder()
    model = fxpipe.materialize(deferred())
    expected = tensors(eager)
    checked = [n for n in tensors(model) if n.endswith(DETERMINISTIC)]
    assert len(checked) == 3 * 5 + 1  # per block 2 norms, a bias, inv_freq, a mask, plus the final norm
    for name in checked:
        assert torch.equal(tensors(model)[name], expected[name]), name
    assert model.blocks[0].mask.dtype == torch.bool and model.blocks[0].rope.inv_freq.dtype == torch.float32
    assert not model.embed.weight[0].any()  # padding row, zeroed by the post-init
    assert model.head.weight is model.embed.weight


def test_random_tensors_have_the_eager_distribution_seeded_per_module():
    eager, model = RopeDecoder(std=0.02), fxpipe.materialize(deferred(std=0.02))
    ours, theirs = random_weights(model), random_weights(eager)
    assert abs(float(ours.mean())) < 1e-3 and abs(float(theirs.mean())) < 1e-3
    assert abs(float(ours.std()) - 0.02) < 5e-4 and abs(float(ours.std()) - float(theirs.std())) < 5e-4
    for m in model.modules():  # each weight drawn as the eager init draws it, seeded by its module's FQN
        if isinstance(m, nn.Linear) and m is not model.head:
            assert 0.017 < float(m.weight.detach().std()) < 0.023
    torch.manual_seed(module_seed(0, "blocks.1.q"))  # what nn.Linear's __init__, then the post-init, draw
    expected = nn.Linear(32, 32, bias=False)
    nn.init.normal_(expected.weight, std=0.02)
    assert torch.equal(model.blocks[1].q.weight, expected.weight)
    other = fxpipe.materialize(deferred(), seed=1)
    assert not torch.equal(other.blocks[1].q.weight, model.blocks[1].q.weight)
    assert torch.equal(other.blocks[1].rope.inv_freq, model.blocks[1].rope.inv_freq)


def test_deep_copied_layers_start_equal_as_in_eager():
    def build():  # nn.TransformerEncoder deep-copies one layer; a batch norm's counter is a real torch.tensor(0)
        with fxpipe.deferred_init():
            return nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3),
                                 copy.deepcopy(nn.BatchNorm1d(16)))

    eager = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3)
    assert torch.equal(eager.layers[0].linear1.weight, eager.layers[2].linear1.weight)
    model = fxpipe.materialize(build())
    for a, b in zip(model[0].layers[0].parameters(), model[0].layers[2].parameters()):
        assert torch.equal(a, b)  # the copies' numbers are drawn once, from the first copy's stream
    assert torch.equal(model[1].running_var, torch.ones(16)) and model[1].num_batches_tracked == 0
    alone = build()
    weight = alone[0].layers[2].linear1.weight
    fill(alone, {id(weight): torch.device("cpu")}, source=None, init=None, seed=0)
    assert torch.equal(weight, model[0].layers[2].linear1.weight)
    assert [n for n, t in alone.named_parameters() if not t.is_meta] == ["0.layers.2.linear1.weight"]


# -- pipelines -----------------------------------------------------------------------------------
def test_any_split_gives_the_same_values_and_a_step_equals_eager():
    models = []
    for n, split in [(2, None), (3, ["blocks.1.k", "blocks.2.mlp_norm"])]:
        model = deferred()
        pipe = fxpipe.compile(model, n, example_inputs=(IDS,), chunks=2, seed=3, split_points=split)
        models.append((model, pipe))
    reference = fxpipe.materialize(deferred(), seed=3)
    for model, _ in models:
        assert_same(model, reference)
        assert model.head.weight is model.embed.weight
    model, pipe = models[1]
    assert any(b is model.blocks[2].rope.inv_freq for b in pipe.stages[1].buffers())  # the model's own buffer
    loss = pipe.step(IDS, target=TARGET, loss_fn=token_loss)
    eager = copy.deepcopy(reference)
    expected = token_loss(eager(IDS), TARGET)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


def test_replaying_a_tensor_allocates_its_module_only_and_a_tied_tensor_once():
    model = deferred(layers=4)
    up = model.blocks[2].up.weight
    with Allocations() as spy:
        fill(model, {id(up): torch.device("cpu")}, source=None, init=None, seed=0)
    assert spy.bytes == up.numel() * up.element_size()  # the tensor, replayed into: nothing else
    total = sum(t.numel() * t.element_size() for t in tensors(model).values())
    assert spy.bytes < total / 10  # the up projection is 4% of the model
    assert [n for n, t in tensors(model).items() if not t.is_meta] == ["blocks.2.up.weight"]
    assert torch.equal(up, fxpipe.materialize(deferred(layers=4)).blocks[2].up.weight)
    model = deferred()
    with Allocations() as spy:
        fxpipe.materialize(model)
    drawn = [f for f, shape in spy.calls if f is torch.ops.aten.normal_.default and shape == (96, 32)]
    assert len(drawn) == 2  # the embedding's reset_parameters() and post-init, once; the head's own is gone


def test_weights_win_over_recipes_and_init_over_both():
    eager = RopeDecoder()
    model = deferred()
    fxpipe.compile(model, 2, example_inputs=(IDS,), weights=eager.state_dict())  # non-persistent: from recipes
    assert_same(model, eager)

    def half(module):  # sets the linears onto the model's width only: the rest keep their recipes
        if isinstance(module, nn.Linear) and module.out_features == 32:
            nn.init.constant_(module.weight, 0.5)

    model = fxpipe.materialize(deferred(), init=half)
    recorded = fxpipe.materialize(deferred())
    assert bool((model.blocks[0].q.weight == 0.5).all()) and bool((model.blocks[2].down.weight == 0.5).all())
    for name in ("blocks.0.gate.weight", "embed.weight", "blocks.0.rope.inv_freq", "norm.weight"):
        assert torch.equal(tensors(model)[name], tensors(recorded)[name]), name
    assert torch.equal(model.blocks[0].rope.inv_freq, eager.blocks[0].rope.inv_freq)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_loads_into_a_deferred_model_its_non_persistent_buffers_replayed(tmp_path):
    real = RopeDecoder()
    fxpipe.save(fxpipe.compile(real, 2, example_inputs=(IDS,)), tmp_path / "ckpt")
    model = deferred()
    fxpipe.load(model, tmp_path / "ckpt")  # the checkpoint holds no inv_freq or mask: their recipes run
    assert_same(model, real)


def test_a_failed_compile_keeps_the_recipes():
    model = deferred()
    bad = RopeDecoder().state_dict()
    del bad["norm.weight"]
    with pytest.raises(fxpipe.WeightsError, match="lacks 1 FQN"):
        fxpipe.compile(model, 2, example_inputs=(IDS,), weights=bad)
    assert all(t.is_meta for t in tensors(model).values())
    fxpipe.compile(model, 2, example_inputs=(IDS,))
    assert_same(model, fxpipe.materialize(deferred()))


def test_tensors_made_outside_the_context_are_initialised_as_before():
    class Holder(nn.Module):
        def __init__(self, outside: nn.Module):
            super().__init__()
            self.outside, self.inside = outside, RMSNorm(4)
            self.register_buffer("scaled", outside.weight.sum(0) * 2, persistent=False)  # from a foreign meta tensor

    with torch.device("meta"):
        outside = nn.Linear(4, 4)
    model = deferred(Holder, outside)
    with pytest.raises(fxpipe.WeightsError, match=r"'scaled' were not made under fxpipe.deferred_init\(\).*"
                                                  r"made on meta outside it, or replaced after it"):
        fxpipe.materialize(model)
    model.scaled = torch.zeros(4)
    with pytest.warns(UserWarning, match=r"2 meta tensor\(s\) .* not made inside it.*'outside.weight', 'outside.bias'"):
        fxpipe.materialize(model, seed=2)  # the foreign linear by its reset_parameters(), the norm by its recipe
    torch.manual_seed(module_seed(2, "outside"))
    expected = nn.Linear(4, 4)
    assert torch.equal(model.outside.weight, expected.weight) and torch.equal(model.inside.weight, torch.ones(4))


# -- refusals --------------------------------------------------------------------------------------
class NeedsValues(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        rates = torch.linspace(0, 0.1, 3, device="cpu")
        if how == "item":
            self.rates = [r.item() for r in rates]
        elif how == "tolist":
            self.rates = rates.tolist()
        elif how == "branch" and rates.sum() > 0:
            self.rates = rates


@pytest.mark.parametrize("how, op", [("item", "Tensor.item()"), ("tolist", "Tensor.tolist()"),
                                     ("branch", "Tensor.__bool__()")])
def test_construction_that_needs_values_is_refused_naming_the_op(how, op):
    with pytest.raises(fxpipe.DeferredInitError, match=rf"values of a tensor \({re.escape(op)} at .*test_deferred_init"
                       r".py:\d+\).*build the model on a real device.*init=") as info:
        deferred(NeedsValues, how)
    assert isinstance(info.value, fxpipe.WeightsError)
    assert torch.empty(1).device.type == "cpu"
    NeedsValues(how)  # eager: fine


def test_a_cast_after_the_context_is_named():
    model = deferred().to(torch.float64)  # new tensors, made outside the recording
    with pytest.raises(fxpipe.WeightsError, match=r"'blocks.0.attn_norm.weight'.* were not made under .*model.to"):
        fxpipe.materialize(model)
    model = fxpipe.materialize(_cast_inside())
    assert model.norm.weight.dtype == torch.float64 and torch.equal(model.norm.weight, torch.ones(32).double())


def _cast_inside() -> nn.Module:
    with fxpipe.deferred_init():
        return RopeDecoder().to(torch.float64)


def test_a_real_tensor_used_while_recording_must_not_change_before_the_replay():
    table = torch.arange(4.0)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scaled", table * torch.ones(4))

    model = deferred(Scaled)
    table.add_(1)
    with pytest.raises(fxpipe.DeferredInitError, match="has been written since"):
        fxpipe.materialize(model)


def test_writing_into_a_real_tensor_and_nesting_are_refused():
    real = torch.zeros(3)
    with pytest.raises(fxpipe.DeferredInitError, match=r"aten.copy_.default writes .* into a real tensor"):
        with fxpipe.deferred_init():
            real.copy_(torch.ones(3))
    with pytest.raises(RuntimeError, match="already active"):
        with fxpipe.deferred_init(), fxpipe.deferred_init():
            pass


# -- Hugging Face --------------------------------------------------------------------------------
def test_hugging_face_llama_needs_no_init():
    tr = pytest.importorskip("transformers")
    config = tr.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            use_cache=False, pad_token_id=0)
    eager = tr.LlamaForCausalLM(config)
    model = deferred(tr.LlamaForCausalLM, config)
    assert all(t.is_meta for t in tensors(model).values())
    fxpipe.materialize(model)
    norms = [m.weight for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert len(norms) == 5 and all(torch.equal(w, torch.ones(64)) for w in norms)
    buffers = dict(eager.named_buffers())
    for name, b in model.named_buffers():  # inv_freq and original_inv_freq, non-persistent
        assert torch.equal(b, buffers[name]), name
    linears = torch.cat([m.weight.detach().flatten() for m in model.modules() if isinstance(m, nn.Linear)])
    assert abs(float(linears.std()) - config.initializer_range) < 5e-4 and abs(float(linears.mean())) < 1e-3
    assert not model.model.embed_tokens.weight[0].any()
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(1, 128, (2, 8))
    assert max_relative_error(model(ids).logits, eager(ids).logits) < 1e-6


# -- across ranks ----------------------------------------------------------------------------------


def test_a_default_dtype_set_around_the_build_is_the_one_replayed():
    # the usual pattern: set the default dtype, build, restore it. The replay ran under the restored one and failed
    # with "made a tensor of shape (32,) ... where meta made (32,)": two equal shapes, the dtype not named
    class Scale(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))  # a factory without dtype=

        def forward(self, x):
            return x * self.weight

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with fxpipe.deferred_init():
            model = nn.Sequential(nn.Linear(32, 32), Scale(32))
    finally:
        torch.set_default_dtype(before)
    fxpipe.materialize(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model[1].weight, torch.ones(32, dtype=torch.bfloat16))
    assert torch.get_default_dtype() == before  # the replay's default is put back
