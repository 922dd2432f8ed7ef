"""tracer="export" on models built on meta: traced on fake tensors of the inputs' device, filled per stage."""

import resource

import pytest
import torch
from models import token_loss
from rotary import RotaryDecoder
from torch import nn

import fxpipe
from fxpipe.frontend.exportmeta import target_device
from fxpipe.testing import max_relative_error


def on_meta(factory, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return factory(*args, **kwargs)


def state_of(model: nn.Module) -> dict:
    """Every parameter and buffer object of ``model`` by FQN (duplicates too)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    """The model holds the same tensor objects as ``before``, all still on meta."""
    after = state_of(model)
    assert list(after) == list(before)
    assert all(after[k] is before[k] and after[k].is_meta for k in before)


def assert_graph_holds_the_model_s_own(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    own = {id(t) for t in state_of(model).values()}
    held = [*gm.parameters(), *gm.buffers()]
    assert held and all(id(t) in own for t in held)


class AutocastRotary(nn.Module):
    """Hugging Face's rotary embedding in transformers 4.4x-4.5x: autocast off on the input's device type."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            f = self.inv_freq[None, :] * x[..., :4]
        return self.lin(x)[..., :4] + f.cos()


def test_export_of_a_meta_model_sees_the_inputs_device_type():
    model = on_meta(AutocastRotary)
    before = state_of(model)
    gm = fxpipe.trace(model, tracer="export", example_inputs=(torch.randn(4, 8),))
    autocast = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast]
    assert autocast and autocast[0].args[0] == "cpu"  # device_type=x.device.type: the inputs', not meta
    assert_graph_holds_the_model_s_own(gm, model)
    assert_unchanged(model, before)
    assert all(gm.get_parameter(n) is p for n, p in model.named_parameters())
    # torch.export never saw the model's own tensors, so they can be materialized in place afterwards
    fxpipe.materialize(model, init=lambda m: m.reset_parameters() if isinstance(m, nn.Linear)
                       else m.inv_freq.copy_(torch.arange(4.0)))
    x = torch.randn(3, 8)
    assert gm.get_parameter("lin.weight") is model.lin.weight and torch.equal(gm(x), model(x))


def test_export_of_a_partly_meta_model_presents_only_the_meta_tensors():
    model = AutocastRotary()
    model.inv_freq = torch.empty(4, device="meta")  # a real Linear, a meta buffer
    weight = model.lin.weight
    gm = fxpipe.trace(model, tracer="export", example_inputs=(torch.randn(4, 8),))
    assert gm.get_parameter("lin.weight") is weight and not weight.is_meta
    assert gm.get_buffer("inv_freq") is model.inv_freq and model.inv_freq.is_meta


def test_meta_example_inputs_are_presented_on_the_stages_device():
    model = on_meta(AutocastRotary)
    gm = fxpipe.trace(model, tracer="export", example_inputs=(torch.empty(4, 8, device="meta"),), device="cpu")
    autocast = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast]
    assert autocast[0].args[0] == "cpu"
    assert all(t.is_meta for t in state_of(model).values())
    meta, cpu = torch.empty(2, device="meta"), torch.empty(2)
    assert target_device((meta,), {}, "cuda:1") == torch.device("cuda:1")  # the stages' device
    assert target_device((meta,), {"y": cpu}, "cuda:1") == torch.device("cpu")  # the inputs' first
    assert target_device((meta,), {}, "meta") == torch.device("cpu")
    assert target_device((meta,), {}, "cpu:0") == torch.device("cpu")  # a rank's CPU: the one the fakes use


def test_a_giant_meta_model_exports_without_allocating_its_weights():
    model = on_meta(lambda: nn.Sequential(nn.Embedding(100, 100_000), nn.Linear(100_000, 100_000),
                                          nn.Linear(100_000, 8)))
    assert sum(p.numel() for p in model.parameters()) * 4 > 32 * 2 ** 30  # 37 GiB
    before = state_of(model)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gm = fxpipe.trace(model, tracer="export", example_inputs=(torch.randint(0, 100, (4, 8)),))
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024 < 2 ** 30
    assert_graph_holds_the_model_s_own(gm, model)
    assert_unchanged(model, before)


def _compare(pipe, model, eager, ids, tgt, loss_fn, call):
    """The pipe's output, its step's loss and every gradient equal the eager model's (relative 1e-5)."""
    assert max_relative_error(call(pipe, ids), call(eager, ids)) < 1e-5
    loss = pipe.step(target=tgt, loss_fn=loss_fn, **ids) if isinstance(ids, dict) else \
        pipe.step(ids, target=tgt, loss_fn=loss_fn)
    expected = loss_fn(eager(**ids) if isinstance(ids, dict) else eager(ids), tgt)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    errors = {n: max_relative_error(p.grad, grads[n].grad) for n, p in model.named_parameters()}
    assert errors and max(errors.values()) < 1e-5, errors


def test_a_rotary_decoder_on_meta_exported_and_filled_by_fqn_equals_eager():
    eager = RotaryDecoder()
    model = on_meta(RotaryDecoder)
    with pytest.raises(fxpipe.TraceError):  # the fx front end cannot trace autocast on x.device.type
        fxpipe.trace(model)
    ids, tgt = torch.randint(0, 32, (6, 8)), torch.randint(0, 32, (6, 8))
    pipe = fxpipe.compile(model, 2, example_inputs=(ids,), devices=["cpu"] * 2, chunks=3, schedule="1f1b",
                          tracer="export", weights=eager.state_dict())
    assert pipe._gm.meta["fxpipe.tracer"] == "export"
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta  # still tied, filled
    assert torch.equal(model.rotary.inv_freq, eager.rotary.inv_freq)  # computed by reset_parameters
    _compare(pipe, model, eager, ids, tgt, token_loss, lambda m, x: m(x))


def _rope_init(module: nn.Module) -> None:
    """Compute a Hugging Face rotary embedding's buffers (in no checkpoint) as a fresh one has them."""
    if "RotaryEmbedding" in type(module).__name__:
        fresh = type(module)(module.config)
        for name, buffer in fresh.named_buffers():
            getattr(module, name).copy_(buffer)


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_hugging_face_llama_built_on_meta_exports_and_equals_eager():
    tr = pytest.importorskip("transformers")
    config = tr.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64, max_position_embeddings=16,
                            use_cache=False)
    eager = tr.LlamaForCausalLM(config)
    model = on_meta(tr.LlamaForCausalLM, config)
    ids = {"input_ids": torch.randint(0, 100, (4, 8))}
    before = state_of(model)
    gm = fxpipe.trace(model, tracer="export", example_kwargs=ids)
    assert_graph_holds_the_model_s_own(gm, model)
    assert_unchanged(model, before)  # left on meta after tracing
    pipe = fxpipe.compile(model, 2, example_kwargs=ids, devices=["cpu"] * 2, chunks=2, schedule="1f1b",
                          tracer="export", weights=eager.state_dict(), init=_rope_init)
    _compare(pipe, model, eager, ids, torch.randint(0, 100, (4, 8)),
             lambda out, tgt: token_loss(out["logits"], tgt), lambda m, x: m(**x)["logits"])


class CastingLoss(nn.Module):
    """A language model computing its own loss after ``labels.to(logits.device)``, as Hugging Face's do."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids)))
        labels = labels.to(logits.device)  # exported as a check of the trace's device
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


def test_meta_example_inputs_pass_the_device_checks_the_exported_graph_holds():
    eager = CastingLoss()
    model = on_meta(CastingLoss)
    ids, labels = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    pipe = fxpipe.compile(model, 2, example_inputs=(ids.to("meta"), labels.to("meta")), tracer="export",
                          devices=["cpu"] * 2, chunks=2, weights=eager.state_dict())
    checks = [n for n in pipe._gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert checks and all(n.kwargs["device"] == torch.device("cpu") for n in checks)
    assert torch.equal(pipe(ids, labels), eager(ids, labels))


# -- what cannot work: refused, naming the cause and the fix ---------------------------------------
class PlainTable(nn.Module):
    """A tensor kept as a plain attribute (neither parameter nor buffer): nothing can present or fill it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.table = torch.ones(8)

    def forward(self, x):
        return self.inp(x) * self.table.cos()


class PlainOutput(PlainTable):
    def forward(self, x):
        return self.inp(x), self.table * 2  # the plain meta tensor never meets the inputs


def test_a_plain_meta_tensor_attribute_is_refused_by_name():
    model = on_meta(PlainTable)
    before = state_of(model)
    with pytest.raises(fxpipe.TraceError, match=r"keeps tensor\(s\) \['table'\] on meta as plain attributes"
                                                r".*register_buffer") as info:
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), tracer="export")
    assert info.value.__cause__ is not None
    assert_unchanged(model, before)
    with pytest.raises(fxpipe.TraceError, match=r"holds tensor\(s\) \['table'\] without values.*register_buffer"):
        fxpipe.trace(on_meta(PlainOutput), tracer="export", example_inputs=(torch.randn(4, 8),))
