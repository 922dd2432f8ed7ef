"""Models built on meta: each stage materializes what it owns, from weights by FQN or seeded init."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from models import MLP, TiedTransformer
from torch import nn
from transformer import GPT
from unet import UNet

import fxpipe
from fxpipe.materialize.fill import fill, module_seed
from fxpipe.materialize.weights import WeightSource, open_weights
from fxpipe.testing import max_relative_error


def gpt_init(module: nn.Module) -> None:
    """Initialise a GPT: its own position table by hand, every other module by reset_parameters."""
    if isinstance(module, GPT):
        nn.init.normal_(module.pos, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def on_meta(factory, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return factory(*args, **kwargs)


def all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def assert_step_equal(pipe, model, reference, x, loss_fn):
    """Outputs and every gradient of the pipe equal those of the eager reference."""
    out = pipe(x)
    loss_fn(out).backward()
    expected = reference(x)
    loss_fn(expected).backward()
    assert max_relative_error(out, expected) < 1e-5
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


def weighted_sum(out):
    return (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()


# -- equal to the materialized model --------------------------------------------------------------
def test_meta_unet_in_three_stages_equals_the_materialized_model():
    model = on_meta(UNet, depth=2, base=4).eval()
    x = torch.randn(6, 3, 16, 16)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, seed=7, split_points=["down.1", "up.0"])
    reference = fxpipe.materialize(on_meta(UNet, depth=2, base=4).eval(), seed=7)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert_same_state(model, reference)
    assert any(r.src == 0 and r.dst == 2 for r in pipe.plan.skips)  # a skip from stage 0 to 2
    assert_step_equal(pipe, model, reference, x, weighted_sum)


def test_meta_transformer_with_tied_head_loads_weights_by_fqn(tmp_path):
    real = TiedTransformer()
    state = {k: v for k, v in real.state_dict().items() if k != "head.weight"}  # tied: saved once
    torch.save(state, tmp_path / "weights.pt")
    model = on_meta(TiedTransformer)
    tokens = torch.randint(0, 32, (7, 8))
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=3, weights=tmp_path / "weights.pt")
    assert model.head.weight is model.embed.weight
    assert_same_state(model, real)
    reference = fxpipe.materialize(on_meta(TiedTransformer), weights=tmp_path / "weights.pt")
    assert_step_equal(pipe, model, reference, tokens, weighted_sum)
    assert reference.embed.weight.grad.abs().sum() > 0


def test_per_module_seeds_give_the_same_weights_for_any_split():
    tokens = torch.randint(0, 32, (7, 8))
    states = []
    for n, split in [(2, None), (3, None), (3, ["blocks.0.norm2", "blocks.2.qkv"])]:
        model = on_meta(TiedTransformer)
        fxpipe.compile(model, n, example_inputs=(tokens,), init=gpt_init, seed=3, split_points=split)
        states.append(model)
    whole = fxpipe.materialize(on_meta(TiedTransformer), init=gpt_init, seed=3)
    for model in states:
        assert_same_state(model, whole)
    other = fxpipe.materialize(on_meta(TiedTransformer), init=gpt_init, seed=4)
    assert not torch.equal(other.blocks[0].qkv.weight, whole.blocks[0].qkv.weight)


def test_a_stage_owning_part_of_a_module_draws_the_same_numbers():
    class Split(nn.Module):  # one module's two parameters read in different stages
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.empty(4, 4))
            self.b = nn.Parameter(torch.empty(4, 4))
            self.mid = nn.Linear(4, 4)

        def reset_parameters(self):
            nn.init.normal_(self.a)
            nn.init.normal_(self.b)

        def forward(self, x):
            return self.mid(x @ self.a) @ self.b

    x = torch.randn(3, 4)
    model = on_meta(Split)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), split_points=["mid"])
    assert sorted(n for n, _ in pipe.stages[1].named_parameters()) == ["b", "mid.bias", "mid.weight"]
    whole = fxpipe.materialize(on_meta(Split))
    assert_same_state(model, whole)
    second = on_meta(Split)  # what the rank of stage 1 does: b is its own, a is not
    fill(second, {id(second.b): torch.device("cpu")}, source=None, init=None, seed=0)
    assert second.a.is_meta and torch.equal(second.b, whole.b)


def test_a_tied_embedding_keeps_its_own_init_and_padding_row_whatever_module_comes_later():
    class TiedPad(nn.Module):  # the head, built after the embedding, is tied to it
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6, padding_idx=2)
            self.mid = nn.Linear(6, 6)
            self.head = nn.Linear(6, 11, bias=True)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.relu(self.mid(self.embed(ids))))

    ids = torch.randint(0, 11, (4, 3))
    whole = fxpipe.materialize(on_meta(TiedPad), seed=1)
    assert whole.head.weight is whole.embed.weight and not whole.embed.weight[2].any()
    torch.manual_seed(module_seed(1, "embed"))  # the values the embedding's own init gives
    expected = torch.empty(11, 6).normal_()
    expected[2] = 0
    assert torch.equal(whole.embed.weight, expected)
    model = on_meta(TiedPad)
    fxpipe.compile(model, 2, example_inputs=(ids,), seed=1, split_points=["head"])
    assert_same_state(model, whole)


# -- weight sources --------------------------------------------------------------------------------
def _sources(state, tmp_path):
    """Yield (name, weights=) for every source kind, each holding ``state``."""
    yield "mapping", dict(state)
    torch.save(state, tmp_path / "one.pt")
    yield "torch.save file", tmp_path / "one.pt"
    shard_dir = tmp_path / "hf"
    shard_dir.mkdir()
    keys = list(state)
    weight_map = {}
    for j, part in enumerate([keys[: len(keys) // 2], keys[len(keys) // 2:]]):
        name = f"pytorch_model-0000{j + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, shard_dir / name)
        weight_map.update({k: name for k in part})
    (shard_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    yield "shards with an index", shard_dir
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": dict(state)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    yield "checkpoint directory", tmp_path / "dcp"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_weight_source_fills_the_model(tmp_path):
    real = MLP()
    for name, weights in _sources(real.state_dict(), tmp_path):
        model = fxpipe.materialize(on_meta(MLP), weights=weights)
        assert_same_state(model, real), name


def test_safetensors_files_and_shards(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    real = MLP()
    state = real.state_dict()
    safetensors.save_file(state, str(tmp_path / "model.safetensors"))
    assert_same_state(fxpipe.materialize(on_meta(MLP), weights=tmp_path / "model.safetensors"), real)
    keys = list(state)
    safetensors.save_file({k: state[k] for k in keys[:5]}, str(tmp_path / "a.safetensors"))
    safetensors.save_file({k: state[k] for k in keys[5:]}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(keys)}}
    shards = tmp_path / "shards"
    shards.mkdir()
    for f in ("a.safetensors", "b.safetensors"):
        (tmp_path / f).rename(shards / f)
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_state(fxpipe.materialize(on_meta(MLP), weights=shards), real)


class Spy(WeightSource):
    """A source that records which keys it was asked to read."""

    def __init__(self, inner):
        self.inner = open_weights(inner)
        self.description = self.inner.description
        self.read_keys: list[str] = []

    def specs(self):
        return self.inner.specs()

    def read(self, into):
        self.read_keys += list(into)
        self.inner.read(into)


def test_only_the_placed_fqns_are_read_and_allocated(tmp_path):
    real = TiedTransformer()
    torch.save(real.state_dict(), tmp_path / "w.pt")
    model = on_meta(TiedTransformer)
    placed = [model.blocks[1].qkv.weight, model.blocks[1].qkv.bias, model.head.weight]
    spy = Spy(tmp_path / "w.pt")
    fill(model, {id(t): torch.device("cpu") for t in placed}, source=spy, init=None, seed=0)
    assert sorted(spy.read_keys) == ["blocks.1.qkv.bias", "blocks.1.qkv.weight", "embed.weight"]
    real_now = {n for n, t in model.state_dict(keep_vars=True).items() if not t.is_meta}
    assert real_now == {"blocks.1.qkv.bias", "blocks.1.qkv.weight", "embed.weight", "head.weight"}
    assert torch.equal(model.head.weight, real.embed.weight)


def test_weights_overwrite_a_real_model_too():
    real = MLP()
    model = MLP()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), weights=real.state_dict())
    assert_same_state(pipe, real)
    real = RopeNet()  # its traced graph holds a constant (cos of a buffer), which no FQN names
    model = RopeNet()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 5, 8),), weights=real.state_dict())
    assert_same_state(pipe, real)


# -- non-persistent buffers --------------------------------------------------------------------------
class Rotary(nn.Module):
    """A table computed in __init__ and kept as a non-persistent buffer (no checkpoint holds it)."""

    def __init__(self, d: int = 8, seq: int = 5) -> None:
        super().__init__()
        self.register_buffer("angles", self.table(d, seq), persistent=False)

    @staticmethod
    def table(d: int, seq: int) -> torch.Tensor:
        return torch.outer(torch.arange(seq, dtype=torch.float32), torch.linspace(0.1, 1, d))

    def forward(self, x):
        return x * torch.cos(self.angles)


class RopeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.rope = Rotary()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.relu(self.rope(self.inp(x))))


def rope_init(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.angles = Rotary.table(*reversed(module.angles.shape))  # assigned anew: copied in place
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def test_non_persistent_buffers_are_computed_by_init(tmp_path):
    real = RopeNet()
    assert "rope.angles" not in real.state_dict()
    x = torch.randn(4, 5, 8)
    model = on_meta(RopeNet)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), weights=real.state_dict(), init=rope_init,
                          split_points=["rope"], leaf_modules=[Rotary])
    assert pipe.stages[1].rope.angles is model.rope.angles
    assert torch.equal(model.rope.angles, real.rope.angles)
    assert_step_equal(pipe, model, copy.deepcopy(real), x, weighted_sum)


def test_code_on_meta_buffers_is_traced_and_runs_materialized():
    real = RopeNet()  # fx traces cos(angles) on the buffer: it runs on the materialized one
    x = torch.randn(4, 5, 8)
    model = on_meta(RopeNet)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), weights=real.state_dict(), init=rope_init)
    assert_step_equal(pipe, model, copy.deepcopy(real), x, weighted_sum)


class PlainTable(nn.Module):
    """A tensor kept as a plain attribute (neither parameter nor buffer): fx freezes what it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        self.table = torch.ones(8)

    def forward(self, x):
        return self.out(self.inp(x) * self.table.cos())


def test_a_constant_traced_from_meta_tensors_is_refused():
    model = on_meta(PlainTable)  # fx computes table.cos() while tracing, on meta: a constant with no values
    with pytest.raises(fxpipe.WeightsError, match=r"'_tensor_constant0'.*leaf_modules="):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),))
    assert all_meta(model)


def test_an_unset_non_persistent_buffer_is_refused_by_name():
    model = on_meta(RopeNet)
    with pytest.raises(fxpipe.WeightsError, match=r"'rope.angles' are not persistent.*pass init="):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 5, 8),), weights=RopeNet().state_dict(),
                       leaf_modules=[Rotary])
    assert all_meta(model)


def test_an_init_that_leaves_a_buffer_unset_is_refused_and_nothing_stays_allocated():
    model = on_meta(RopeNet)

    def partial(module):  # forgets the rotary table
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with pytest.raises(fxpipe.WeightsError, match=r"'rope.angles'.*init left them unset"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 5, 8),), init=partial, leaf_modules=[Rotary])
    assert all_meta(model)


# -- refusals ----------------------------------------------------------------------------------------
def test_a_bool_mask_init_leaves_unset_is_refused_not_left_as_garbage():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))
            self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)), persistent=False)

        def reset_parameters(self):  # forgets the mask
            nn.init.normal_(self.w)

    with pytest.raises(fxpipe.WeightsError, match=r"buffer\(s\) \['mask'\] are not persistent"):
        fxpipe.materialize(on_meta(Masked))

    def init(module):
        module.reset_parameters()
        module.mask.copy_(torch.tril(torch.ones(4, 4, dtype=torch.bool)))

    assert torch.equal(fxpipe.materialize(on_meta(Masked), init=init).mask, torch.ones(4, 4).tril().bool())


def test_old_batch_norm_weights_without_num_batches_tracked_load_as_with_load_state_dict():
    from models import CNN

    real = CNN().train()
    real(torch.randn(4, 3, 8, 8))  # running statistics that are not the initial ones
    old = {k: v for k, v in real.state_dict().items() if not k.endswith("num_batches_tracked")}  # torch < 0.4.1
    expected = CNN()
    expected.load_state_dict(old)  # torch fills num_batches_tracked with 0
    assert_same_state(fxpipe.materialize(on_meta(CNN), weights=old), expected)
    with pytest.raises(fxpipe.WeightsError, match=r"lacks 1 FQN\(s\) of the model: 'bns.0.running_mean'"):
        fxpipe.materialize(on_meta(CNN), weights={k: v for k, v in old.items() if k != "bns.0.running_mean"})


def test_a_missing_fqn_is_named_before_anything_is_allocated():
    state = MLP().state_dict()
    del state["layers.3.bias"]
    model = on_meta(MLP)
    with pytest.raises(fxpipe.WeightsError, match=r"lacks 1 FQN\(s\) of the model: 'layers.3.bias'"):
        fxpipe.compile(model, 3, example_inputs=(torch.randn(4, 16),), weights=state)
    assert all_meta(model)



def test_weights_under_other_names_are_said_to_be_in_another_layout():
    # transformers 5 saves Mixtral's experts as block_sparse_moe.experts.N.w1 and fuses them at load
    state = MLP().state_dict()
    state["old.layers.3.bias"] = state.pop("layers.3.bias")
    with pytest.warns(UserWarning, match="holds 1 key"), \
            pytest.raises(fxpipe.WeightsError, match=r"lacks 1 FQN\(s\) of the model: 'layers.3.bias'; it holds 1 "
                                                    r"other key\(s\) \('old.layers.3.bias'\).*another layout"):
        fxpipe.materialize(on_meta(MLP), weights=state)

def test_shape_and_dtype_mismatches_name_the_fqn_and_both():
    state = MLP().state_dict()
    state["layers.1.weight"] = torch.zeros(16, 8)
    with pytest.raises(fxpipe.WeightsError, match=r"'layers.1.weight' has shape \(16, 8\) there but \(16, 16\)"):
        fxpipe.materialize(on_meta(MLP), weights=state)
    state = MLP().state_dict()
    state["layers.2.bias"] = state["layers.2.bias"].double()
    with pytest.raises(fxpipe.WeightsError, match=r"'layers.2.bias' has dtype torch.float64 there but torch.float32"):
        fxpipe.materialize(on_meta(MLP), weights=state)


def test_modules_with_no_init_path_are_listed():
    model = on_meta(TiedTransformer)
    with pytest.raises(fxpipe.WeightsError, match=r"1 module\(s\).*the root module \(GPT: pos\)"):
        fxpipe.compile(model, 2, example_inputs=(torch.randint(0, 32, (4, 8)),))
    assert all_meta(model)


def test_unexpected_keys_warn():
    state = MLP().state_dict()
    state["layers.9.weight"] = torch.zeros(1)
    with pytest.warns(UserWarning, match=r"1 key\(s\) that name no parameter or buffer of MLP.*'layers.9.weight'"):
        fxpipe.materialize(on_meta(MLP), weights=state)


def test_bad_arguments_fail_before_tracing(tmp_path):
    x = torch.randn(4, 16)
    with pytest.raises(fxpipe.WeightsError, match="no such file or directory"):
        fxpipe.compile(on_meta(MLP), 2, example_inputs=(x,), weights=tmp_path / "nowhere.pt")
    with pytest.raises(TypeError, match="weights= must be a state dict, a file or a directory"):
        fxpipe.compile(on_meta(MLP), 2, example_inputs=(x,), weights=3)
    with pytest.raises(TypeError, match="init= must be a function"):
        fxpipe.compile(on_meta(MLP), 2, example_inputs=(x,), init="normal")
    (tmp_path / "empty").mkdir()
    with pytest.raises(fxpipe.WeightsError, match="holds no weights files"):
        fxpipe.materialize(on_meta(MLP), weights=tmp_path / "empty")
    with pytest.raises(ValueError, match="balance_by='time'.*meta"):
        fxpipe.compile(on_meta(MLP), 2, example_inputs=(x,), balance_by="time")


def test_a_directory_of_checkpoints_names_latest_checkpoint(tmp_path):
    # the README saves ckpt/step-500 and loads weights="ckpt/": the refusal did not say what to give instead
    fxpipe.save(MLP(), str(tmp_path / "ckpt" / "step-500"))
    with pytest.raises(fxpipe.WeightsError, match=r"checkpoints saved by fxpipe.save \(step-500\): give one of them, "
                                                  r"e.g. weights=fxpipe.latest_checkpoint\("):
        fxpipe.materialize(on_meta(MLP), weights=tmp_path / "ckpt")
    model = fxpipe.materialize(on_meta(MLP), weights=fxpipe.latest_checkpoint(tmp_path / "ckpt"))
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_failed_compile_can_be_retried(tmp_path):
    model = on_meta(MLP)
    bad = MLP().state_dict()
    bad.pop("layers.0.weight")
    with pytest.raises(fxpipe.WeightsError):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), weights=bad)
    real = MLP()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), weights=real.state_dict())
    assert_same_state(pipe, real)
    loss = pipe.step(torch.randn(4, 16), target=torch.randn(4, 16), loss_fn=F.mse_loss)
    assert torch.isfinite(loss)


# -- one stage per rank ----------------------------------------------------------------------------
