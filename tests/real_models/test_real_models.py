"""Real third-party models, randomly initialised, compiled into 2-4 stages: equal to eager.

torchvision, timm and Hugging Face transformers models from small configurations, traced by
fxpipe's fx front end, by their own tracers (Hugging Face's ``transformers.utils.fx``, timm's
leaf modules and autowrapped functions), or by ``torch.export``. Each is compared with eager in
eval mode, outputs and every parameter's gradient (``fxpipe.testing.assert_pipeline_equivalent``,
which also runs ``pipe.step``, here under one schedule per model in rotation); the
transformer-like ones also run a zero-bubble ``pipe.step`` with a mean loss against eager's
loss and gradients. Nothing downloads weights. Marked ``real_models`` and left out of the default run; run them
with (see the README for the environment)::

    pytest -m real_models tests/test_real_models.py

A test whose package is missing is skipped. ``FXPIPE_COVERAGE_TABLE=path`` writes the table of
what ran (model, front end, parameters, stages, routed skips, seconds) as Markdown.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULES
from fxpipe.testing import assert_pipeline_equivalent

pytestmark = pytest.mark.real_models

_ROWS: list[list[str]] = []


@dataclass
class Case:
    """One model: how to build it and its inputs, which tracer, how many stages."""

    name: str
    package: str
    build: Callable[[], tuple[torch.nn.Module, tuple, dict]]
    tracer: Any = "fx"
    n_stages: int = 3
    note: str = ""


def _img(size: int, batch: int = 2) -> tuple:
    return (torch.randn(batch, 3, size, size),)


def _tv(name: str, size: int = 64, **kwargs) -> Callable:
    def build():
        import torchvision.models as tvm
        return getattr(tvm, name)(weights=None, **kwargs), _img(size), {}
    return build


def _seg(name: str, **kwargs) -> Callable:
    def build():
        import torchvision.models.segmentation as seg
        return getattr(seg, name)(weights=None, weights_backbone=None, num_classes=5, **kwargs), _img(64), {}
    return build


def _fcn_float64():
    import torchvision.models.segmentation as seg
    # A random-init ResNet-50 amplifies float32 rounding a thousandfold in backward: eager on
    # the two halves of a batch differs from eager on the whole batch by about 0.5% in
    # conv1's gradient. In float64 that rounding is far below any tolerance.
    model = seg.fcn_resnet50(weights=None, weights_backbone=None, num_classes=5, aux_loss=True).double()
    return model, (torch.randn(2, 3, 64, 64, dtype=torch.float64),), {}


def _inception_float64():
    import torchvision.models as tvm
    # Random-init Inception-v3 in eval mode gives outputs near 1e8, and pipe.step's loss over
    # two micro-batches differed from eager's over the whole batch by 6e-5 in float32 (torch
    # 2.14.1): summation order alone. In float64 that rounding is far below any tolerance.
    model = tvm.inception_v3(weights=None, aux_logits=True, init_weights=True).double()
    return model, (torch.randn(2, 3, 96, 96, dtype=torch.float64),), {}


def _small_vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=10), _img(32), {}


def timm_trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    """Trace with timm's leaf modules and autowrapped functions (its feature extractor's tracer)."""
    from timm.layers import get_notrace_functions, get_notrace_modules

    leaves = tuple(get_notrace_modules())

    class Tracer(torch.fx.Tracer):
        def __init__(self):
            super().__init__(autowrap_functions=tuple(f for f in get_notrace_functions() if callable(f)))

        def is_leaf_module(self, m, name):
            return isinstance(m, leaves) or super().is_leaf_module(m, name)

    return torch.fx.GraphModule(model, Tracer().trace(model), type(model).__name__)


def _timm(name: str, size: int = 64, **kwargs) -> Callable:
    def build():
        import timm
        return timm.create_model(name, pretrained=False, **kwargs), _img(size), {}
    return build


def _timm_features():
    import timm
    from timm.layers import create_feature_extractor
    model = timm.create_model("resnet10t", pretrained=False)
    gm = create_feature_extractor(model, return_nodes={"layer2": "c3", "layer3": "c4", "layer4": "c5"})
    return gm, _img(64), {}


_IDS = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
_MASK = torch.ones(4, 8, dtype=torch.long)


def _hf(name: str) -> Callable:
    def build():
        import transformers as tr
        if name == "gpt2":
            model = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=4,
                                                     n_head=2, use_cache=False))
        elif name == "bert":
            model = tr.BertForSequenceClassification(tr.BertConfig(
                vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=16))
        elif name == "llama":
            model = tr.LlamaForCausalLM(tr.LlamaConfig(
                vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64, max_position_embeddings=16, use_cache=False))
        else:
            model = tr.T5ForConditionalGeneration(tr.T5Config(
                vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                num_heads=2, use_cache=False))
        kwargs = {"input_ids": _IDS, "attention_mask": _MASK}
        if name == "t5":
            kwargs["decoder_input_ids"] = _IDS
        return model, (), kwargs
    return build


def hf_trace(input_names: list[str]) -> Callable:
    """Return a tracer calling Hugging Face's ``transformers.utils.fx.symbolic_trace``."""
    def trace(model):
        pytest.importorskip("transformers.utils.fx", reason="this transformers has no torch.fx tracer (5.x dropped it)")
        from transformers.utils.fx import symbolic_trace
        return symbolic_trace(model, input_names=input_names)
    return trace


CASES = [
    Case("resnet18", "torchvision", _tv("resnet18"), n_stages=2),
    Case("mobilenet_v3_small", "torchvision", _tv("mobilenet_v3_small"), n_stages=3),
    Case("efficientnet_b0", "torchvision", _tv("efficientnet_b0"), n_stages=4),
    Case("densenet121", "torchvision", _tv("densenet121"), n_stages=3),
    Case("squeezenet1_1", "torchvision", _tv("squeezenet1_1"), n_stages=2),
    Case("shufflenet_v2_x0_5", "torchvision", _tv("shufflenet_v2_x0_5"), n_stages=3),
    Case("regnet_y_400mf", "torchvision", _tv("regnet_y_400mf"), n_stages=4),
    Case("convnext_tiny", "torchvision", _tv("convnext_tiny"), n_stages=4),
    Case("googlenet", "torchvision", _tv("googlenet", aux_logits=True, init_weights=True), n_stages=3),
    Case("inception_v3", "torchvision", _inception_float64, n_stages=4, note="float64"),
    Case("swin_t", "torchvision", _tv("swin_t"), n_stages=3),
    Case("vit (4 layers)", "torchvision", _small_vit, n_stages=3),
    Case("fcn_resnet50 + aux", "torchvision", _fcn_float64, n_stages=4, note="float64"),
    Case("deeplabv3_mobilenet_v3_large + aux", "torchvision", _seg("deeplabv3_mobilenet_v3_large", aux_loss=True),
         n_stages=3),
    Case("lraspp_mobilenet_v3_large", "torchvision", _seg("lraspp_mobilenet_v3_large"), n_stages=2),
    Case("resnet10t", "timm", _timm("resnet10t"), timm_trace, n_stages=2),
    Case("convnext_atto", "timm", _timm("convnext_atto"), timm_trace, n_stages=3),
    Case("mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050"), timm_trace, n_stages=4),
    Case("vit_tiny_patch16_224", "timm", _timm("vit_tiny_patch16_224", 32, img_size=32), timm_trace, n_stages=3),
    Case("mixer_s16_224", "timm", _timm("mixer_s16_224", 32, img_size=32), timm_trace, n_stages=2),
    Case("swin_tiny_patch4_window7_224", "timm",
         _timm("swin_tiny_patch4_window7_224", 56, img_size=56, window_size=7), timm_trace, n_stages=4),
    Case("coat_tiny", "timm", _timm("coat_tiny", img_size=64), timm_trace, n_stages=3),
    Case("cait_xxs24_224", "timm", _timm("cait_xxs24_224", 32, img_size=32), timm_trace, n_stages=4),
    Case("efficientvit_b0", "timm", _timm("efficientvit_b0"), timm_trace, n_stages=2),
    Case("ghostnet_100", "timm", _timm("ghostnet_100"), timm_trace, n_stages=3),
    Case("resnet10t features (create_feature_extractor)", "timm", _timm_features, n_stages=3,
         note="dict of 3 feature maps"),
    Case("GPT-2 (4 layers)", "transformers", _hf("gpt2"), hf_trace(["input_ids", "attention_mask"]), n_stages=3),
    Case("BERT (4 layers)", "transformers", _hf("bert"), hf_trace(["input_ids", "attention_mask"]), n_stages=4),
    Case("Llama (4 layers)", "transformers", _hf("llama"), hf_trace(["input_ids", "attention_mask"]), n_stages=3),
    Case("T5 (2+2 layers)", "transformers", _hf("t5"),
         hf_trace(["input_ids", "attention_mask", "decoder_input_ids"]), n_stages=4),
    Case("resnet18", "torchvision", _tv("resnet18"), "export", n_stages=3),
    Case("vit (4 layers)", "torchvision", _small_vit, "export", n_stages=2),
    Case("GPT-2 (4 layers)", "transformers", _hf("gpt2"), "export", n_stages=3),
    Case("BERT (4 layers)", "transformers", _hf("bert"), "export", n_stages=2),
    Case("Llama (4 layers)", "transformers", _hf("llama"), "export", n_stages=4),
    Case("T5 (2+2 layers)", "transformers", _hf("t5"), "export", n_stages=3),
]


def _front_end(case: Case) -> str:
    """Name the tracer of a case for the table."""
    if case.tracer == "export":
        return "torch.export"
    if case.tracer is timm_trace:
        return "timm tracer"
    if callable(case.tracer):
        return "HF transformers.utils.fx"
    return "fxpipe fx"


def _build(case: Case) -> tuple[torch.nn.Module, tuple, dict]:
    """Skip the case if its packages are missing; else build its model (in eval mode) and inputs."""
    pytest.importorskip(case.package)
    pytest.importorskip("torchvision" if case.package == "timm" else case.package)
    torch.manual_seed(0)
    model, args, kwargs = case.build()
    return model.eval(), args, kwargs


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{_front_end(c)}".replace(" ", "_") for c in CASES])
def test_real_model_equals_eager(case):
    model, args, kwargs = _build(case)
    start = time.perf_counter()
    schedule = SCHEDULES[CASES.index(case) % 3]  # pipe.step too: one schedule per case, in rotation
    pipe = assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=case.n_stages,
                                      chunks=2, devices=["cpu"] * case.n_stages, tracer=case.tracer,
                                      schedules=[schedule])
    seconds = time.perf_counter() - start
    assert len(pipe.stages) == case.n_stages
    assert list(pipe.state_dict().keys()) == list(model.state_dict().keys())
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.0f}k"
    _ROWS.append([case.name, case.package, _front_end(case), size,
                  str(case.n_stages), str(len(pipe._gm.graph.nodes)), str(len(pipe.plan.skips)),
                  f"{seconds:.1f}", case.note])


@pytest.fixture(scope="module", autouse=True)
def _coverage_table():
    yield
    path = os.environ.get("FXPIPE_COVERAGE_TABLE")
    if path and _ROWS:
        head = ["model", "package", "front end", "params", "stages", "graph nodes", "skip routes",
                "seconds", "note"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in _ROWS]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


ZB_CASES = [c for c in CASES if c.package == "transformers"
            or c.name in ("vit (4 layers)", "mixer_s16_224", "vit_tiny_patch16_224")]


def _mean_of_outputs(out: Any, _target: Any = None) -> torch.Tensor:
    """Return a loss from any output structure: the sum of its floating leaves' means."""
    from torch.utils._pytree import tree_leaves

    return sum(t.float().mean() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


@pytest.mark.parametrize("case", ZB_CASES, ids=[f"{c.name}-{_front_end(c)}".replace(" ", "_") for c in ZB_CASES])
def test_real_model_zero_bubble_step_equals_eager(case):
    """schedule='zb': linears defer weight gradients to W steps; loss and gradients equal eager's."""
    import copy

    import fxpipe
    from fxpipe.runtime.stage import wgrad
    from fxpipe.testing import max_relative_error

    model, args, kwargs = _build(case)
    eager = copy.deepcopy(model)
    expected = _mean_of_outputs(eager(*args, **kwargs))
    expected.backward()
    pipe = fxpipe.compile(model, case.n_stages, example_inputs=args, example_kwargs=kwargs or None, chunks=2,
                          devices=["cpu"] * case.n_stages, tracer=case.tracer, schedule="zb")
    deferring = sum(n.target is wgrad.linear for st in pipe.stages for n in wgrad.defer_weight_grads(st).graph.nodes)
    assert deferring > 0  # the model's linears really do defer their weight gradients
    loss = pipe.step(*args, target=None, loss_fn=_mean_of_outputs, **kwargs)
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    # a gradient zero in exact arithmetic (attention's key bias: softmax ignores a constant) is rounding
    # noise in both runs: held to the scale of the model's largest gradient, not to its own
    noise = 1e-6 * max(float(p.grad.abs().max()) for p in eager.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
        elif grads[name].grad.abs().max() < noise:
            assert p.grad.abs().max() < noise, name
        else:
            assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("tracer", ["fx", "timm"])  # fx traces through BatchNormAct2d; timm's tracer keeps it whole
def test_timm_batch_norm_act_defers_in_training(tracer):
    """deferred_batch_norm=True on timm's BatchNormAct2d (batch norm, then its activation), in training: the loss
    and gradients of eager over the same micro-batches, the first batch norm's running statistics those of one
    update from the whole batch (it updated per micro-batch, or lost its activation, before)."""
    import copy

    import torch.nn.functional as F

    import fxpipe

    pytest.importorskip("timm")
    import timm

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", num_classes=10).train()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    whole, micro = copy.deepcopy(model), copy.deepcopy(model)
    whole(x)
    expected = sum(F.cross_entropy(micro(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
    expected.backward()
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, devices=["cpu"] * 3, deferred_batch_norm=True,
                          tracer=timm_trace if tracer == "timm" else "fx", schedule="1f1b")
    assert type(model.bn1).__name__ == "BatchNormAct2d"
    torch.testing.assert_close(pipe.step(x, target=y, loss_fn=F.cross_entropy), expected.detach())
    grads = dict(micro.named_parameters())
    noise = 1e-6 * max(float(p.grad.abs().max()) for p in micro.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=noise, msg=name)
    torch.testing.assert_close(model.bn1.running_mean, whole.bn1.running_mean)
    torch.testing.assert_close(model.bn1.running_var, whole.bn1.running_var)
    assert all(int(m.num_batches_tracked) == 1 for m in model.modules() if hasattr(m, "num_batches_tracked"))


@pytest.mark.parametrize("deferred", [False, True])
def test_exported_batch_norms_reading_statistics_through_a_mode_choice_are_kept_and_deferred(deferred):
    """ShuffleNet under torch.export: its training and eval graphs merge out of step, so batch norms read their
    running statistics through pick(training, ...) or run as training-only nodes. The recomputation updated those
    a second time (40 buffers off, up to 0.8 relative), and deferral skipped them (counted once per micro-batch);
    loss, gradients and eval outputs were right, so nothing showed until evaluation. Deferred, the statistics
    are those of fx's graph (each batch norm reads activations normalised per micro-batch)."""
    import copy

    import torch.nn.functional as F

    import fxpipe

    tvm = pytest.importorskip("torchvision.models")
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    models = {}
    for tracer in ("export", "fx"):
        torch.manual_seed(0)
        models[tracer] = model = tvm.shufflenet_v2_x0_5(num_classes=10).double()
        eager = copy.deepcopy(model)
        pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, tracer=tracer, schedule="1f1b",
                              checkpoint="always", deferred_batch_norm=deferred, devices=["cpu"] * 3)
        pipe.step(x, target=y, loss_fn=F.cross_entropy)
        if not deferred:
            for part in x.chunk(2):  # eager over the same micro-batches
                eager(part)
            models["fx"] = eager
            break
    for (name, got), (_, want) in zip(models["export"].named_buffers(), models["fx"].named_buffers()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_timms_hook_based_feature_extractor_is_refused_under_fx_and_equal_under_export(tracer):
    """timm's features_only with feature_cls='hook' files each feature under its input's device, which fx's proxy
    lacks: the pipe returned an empty list, with only the generic lost-hooks warning. Exported, the features are
    in the graph: equal to eager, and no hook is warned of."""
    import warnings

    import fxpipe

    pytest.importorskip("timm")
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", features_only=True, feature_cls="hook", out_indices=(1, 2, 3)).eval()
    x = torch.randn(4, 3, 32, 32)
    if tracer == "fx":
        with pytest.raises(fxpipe.TraceError, match="tracer='export'"):
            fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hooks on modules")
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, tracer="export")
    with torch.no_grad():
        got, want = pipe(x), model(x)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
