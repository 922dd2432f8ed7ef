"""fxpipe.trace: buffers stay buffers in the graph, so a pipeline follows them when they change."""

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import fxpipe


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        factor = self.scale * 2  # code on the buffer alone
        return self.b(self.a(x) * factor)


def test_code_on_a_buffer_alone_is_traced_not_frozen():
    gm = fxpipe.trace(Scaled())
    assert not any(n.op == "get_attr" and n.target.startswith("_tensor_constant") for n in gm.graph.nodes)
    model = Scaled()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(3, 4),), devices=["cpu"] * 2)
    x = torch.randn(3, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["scale"] = torch.full((4,), 3.0)
    pipe.load_state_dict(state)
    torch.testing.assert_close(pipe(x), model(x))
    assert torch.equal(model.scale, torch.full((4,), 3.0))


def test_a_trace_error_in_a_package_beside_torch_names_its_line():
    # torchvision's files start with torch's directory name (site-packages/torch + "vision/..."):
    # frames there were taken for torch's own, so FasterRCNN's TraceError named no line
    import os

    source = ("class Branchy(nn.Module):\n"
              "    def forward(self, x):\n"
              "        if x.sum() > 0:\n"
              "            return x * 2\n"
              "        return x\n")
    filename = os.path.dirname(torch.__file__) + "vision/models/branchy.py"
    namespace = {"nn": nn}
    exec(compile(source, filename, "exec"), namespace)
    try:
        fxpipe.trace(namespace["Branchy"]())
    except fxpipe.TraceError as exc:
        assert f'File "{filename}", line 3, in forward' in str(exc), str(exc)
    else:
        raise AssertionError("traced a data-dependent branch")


class _Detector(nn.Module):
    """A backbone, then a head that keeps the boxes by their scores (data-dependent), as Faster R-CNN does."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.roi_heads = nn.Linear(4, 4)

    def forward(self, images, targets=None):
        scores = [self.roi_heads(self.backbone(image)) for image in images]
        return [s[s > 0] for s in scores]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_detector_s_refusal_says_to_pipeline_its_backbone(tracer):
    # under export the refusals named unbatched= or tracer='fx', which cannot help either
    images = [torch.randn(3, 4), torch.randn(5, 4)]
    targets = [{"boxes": torch.randn(1, 4), "labels": torch.tensor([1])} for _ in images]
    with pytest.raises((fxpipe.TraceError, fxpipe.PipelineInputError),
                       match=r"pipeline the backbone \(pipe = fxpipe.compile\(model.backbone, ...\), then "
                             r"model.backbone = pipe\)"):
        fxpipe.compile(_Detector(), 2, example_inputs=(images, targets), tracer=tracer)


def test_a_graph_module_without_meta_compiles():
    # torchvision's create_feature_extractor builds its GraphModule skipping GraphModule.__init__,
    # so it has no .meta: compile failed with "'ResNet' object has no attribute 'meta'"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    gm = torch.fx.symbolic_trace(model)
    del gm.meta
    pipe = fxpipe.compile(gm, 2, example_inputs=(torch.randn(4, 4),), chunks=2, unbatched=[])
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("validate", [None, False])
def test_a_distribution_returned_names_the_fix(validate):
    # fx's own words ("symbolically traced variables cannot be used as inputs to control flow", "argument of
    # type: Normal") named neither the distribution nor what to return instead
    class Gaussian(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu, self.sig = nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x):
            return torch.distributions.Normal(self.mu(x), F.softplus(self.sig(x)) + 0.1, validate_args=validate)

    with pytest.raises(fxpipe.TraceError, match=r"(?s)torch.distributions object .*Return the distribution's "
                                                r"parameters .*build it in loss_fn"):
        fxpipe.compile(Gaussian(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2)


class _SamplingPolicy(nn.Module):
    """Sample an action inside forward (returning tensors only)."""

    def __init__(self, validate):
        super().__init__()
        self.pi, self.validate = nn.Linear(6, 4), validate

    def forward(self, x):
        dist = torch.distributions.Categorical(logits=self.pi(x), validate_args=self.validate)
        action = dist.sample()
        return dist.log_prob(action), dist.entropy()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_distribution_sampled_inside_forward_names_the_fixes(tracer):
    # the failing frame was inside torch.distributions (its argument check on values), not the user's: the messages
    # said to rewrite a branch or try the other tracer, naming neither the distribution nor validate_args=False
    with pytest.raises(fxpipe.TraceError, match=r"(?s)torch.distributions object .*validate_args=False under "
                                                r"tracer='export'.*leaf_modules="):
        fxpipe.compile(_SamplingPolicy(True), 2, example_inputs=(torch.randn(8, 6),), devices=["cpu"] * 2,
                       tracer=tracer)
    if tracer == "export":  # the first fix named works
        pipe = fxpipe.compile(_SamplingPolicy(False), 2, example_inputs=(torch.randn(8, 6),), devices=["cpu"] * 2,
                              tracer=tracer, split_points=["pi"])
        log_prob, entropy = pipe(torch.randn(8, 6))
        assert log_prob.shape == entropy.shape == (8,)


class _OptionalMask(nn.Module):
    """An optional input checked with ``is not None`` (true for a traced value)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)


class _CheckedAndPassed(nn.Module):
    """Check ``mask is not None`` and pass it to an op that takes ``None`` (SDPA's ``attn_mask``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is not None:
            h = h * 2
        q = h.view(h.shape[0], 1, 4, 2)
        return self.b(F.scaled_dot_product_attention(q, q, q, attn_mask=mask).reshape(h.shape[0], 8))


@pytest.mark.parametrize("model_type", [_OptionalMask, _CheckedAndPassed])
def test_a_none_input_the_graph_reads_is_fixed_to_none_and_equals_eager(model_type):
    # _OptionalMask was refused (PropagationError: 'FakeTensor' * 'NoneType'); _CheckedAndPassed kept the
    # checked branch (h * 2), which eager skips for None: pipe(x) off eager's, nothing said
    model = model_type()
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
        torch.testing.assert_close(pipe(x, None), model(x))
    with pytest.raises(TypeError, match=r"mask= was fixed to None when the model was traced.*tracer='export'.*"
                                        r"example tensor"):
        pipe(x, torch.ones(8, 8))
    traced = fxpipe.compile(fxpipe.trace(model, concrete_args={"mask": None}), 2, example_inputs=(x,), chunks=2,
                            devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))


class _Namesakes(_OptionalMask):
    def forward(self, x, mask=None, mask_1=None):
        h = super().forward(x, mask)
        return h if mask_1 is None else h + mask_1


def test_an_input_named_like_the_placeholder_of_a_fixed_one_is_refused_naming_the_fix():
    # torch.fx names a fixed `mask`'s placeholder `mask_1`, as the other input: a raw SyntaxError was raised
    model, x = _Namesakes(), torch.randn(8, 8)
    with pytest.raises(fxpipe.TraceError, match=r"inputs 'mask' and 'mask_1'.*Rename the input 'mask_1'.*"
                                                r"tracer='export'"):
        fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"mask_1": x}, chunks=2, devices=["cpu"] * 2)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"mask_1": x}, chunks=2,
                          devices=["cpu"] * 2, tracer="export")
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, mask_1=x), model(x, mask_1=x))


class _Scaled(nn.Module):
    """An optional input whose default is not None."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale=2.0):
        h = self.a(x)
        if scale is not None:
            h = h * scale
        return self.b(h)


class _Required(_OptionalMask):
    def forward(self, x, mask):
        return super().forward(x, mask)


def test_a_call_leaving_out_an_input_fixed_to_none_gets_what_eager_gets():
    # example (x, None) for scale=2.0: pipe(x) ran the None path where eager multiplies by 2.0 (0.84 off), silently
    x = torch.randn(8, 8)
    model = _Scaled()
    pipe = fxpipe.compile(model, 2, example_inputs=(x, None), chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, None), model(x, None))
    with pytest.raises(TypeError, match=r"scale= was fixed to None .*leaves it at forward's default 2.0.*pass "
                                        r"scale=None"):
        pipe(x)
    required = _Required()
    pipe = fxpipe.compile(required, 2, example_inputs=(x, None), chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, None), required(x, None))
    with pytest.raises(TypeError, match=r"missing a value for the model input 'mask' \(forward has no default"):
        pipe(x)  # eager: missing 1 required positional argument


class _UntracedNonePath(nn.Module):
    """Run code fx cannot trace when ``mask`` is None, then pass ``mask`` to an op that takes None."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is None:
            h = h * (float(x.abs().sum() > 0) + 1.0)
        q = h.view(h.shape[0], 1, 4, 2)
        return self.b(F.scaled_dot_product_attention(q, q, q, attn_mask=mask).reshape(h.shape))


def test_a_none_input_the_graph_reads_whose_eager_path_does_not_trace_is_refused():
    # the tensor path's graph was kept and ran on None: pipe(x) 0.53 off eager, silently
    with pytest.raises(fxpipe.TraceError, match=r"Traced with mask=None fixed.*tracer='export'.*example tensor"):
        fxpipe.compile(_UntracedNonePath(), 2, example_inputs=(torch.randn(6, 8),), devices=["cpu"] * 2)


def test_without_examples_a_none_default_the_graph_reads_still_takes_a_tensor():
    # fixing every None default the graph reads refused a later tensor where no example said None: compile
    # without example_inputs=, and fxpipe.trace(model, concrete_args=...) of another input
    model, x, mask = _OptionalMask(), torch.randn(8, 8), torch.rand(8, 8)
    pipe = fxpipe.compile(model, 2, chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, mask=mask), model(x, mask=mask))
    gm = fxpipe.trace(_CheckedAndPassed(), concrete_args={})
    assert "mask" in [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def test_unbatched_may_name_an_input_fixed_to_none():
    # "unbatched=['mask'] names ['mask'], which the traced model has no input for; its inputs are ['x', 'mask_1']"
    model, x = _CheckedAndPassed(), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, unbatched=["mask"])
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


class _MaskOrCausal(nn.Module):
    """Check ``attn_mask is not None or is_causal`` (timm's ViT): the flag is read only once the mask is None."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, attn_mask=None, is_causal=False):
        h = self.a(x)
        q = h.view(h.shape[0], 1, 4, 2)
        if attn_mask is not None or is_causal:
            h = h + F.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask, is_causal=is_causal).reshape(h.shape)
        else:
            h = h * 2
        return self.b(h)


@pytest.mark.parametrize("example_kwargs", [{}, {"is_causal": False}])
def test_a_flag_read_only_once_a_none_input_is_fixed_is_fixed_with_it(example_kwargs):
    # the retrace with attn_mask=None met `or is_causal` traced as a value and was refused naming export (timm's ViT)
    model, x = _MaskOrCausal(), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs=example_kwargs, chunks=2,
                          devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(TypeError, match=r"is_causal= was fixed to False"):
        pipe(x, is_causal=True)


class _LoopedMomentum(torch.nn.Module):
    """Move a frozen target network toward the online one through a loop over .parameters() (BYOL, MoCo)."""

    def __init__(self):
        super().__init__()
        self.online, self.target = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for pt, po in zip(self.target.parameters(), self.online.parameters()):
                pt.mul_(0.9).add_(po, alpha=0.1)
        return self.online(x) * self.target(x)


def test_a_forward_writing_real_parameters_while_fx_traces_is_refused_naming_export():
    # .parameters() gives the real tensors: the update ran once at compile and never in training (0.06 off), silently
    import fxpipe
    from fxpipe.errors import TraceError

    with pytest.raises(TraceError, match=r"wrote target.weight, target.bias in place.*tracer='export'"):
        fxpipe.compile(_LoopedMomentum(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2)


def _pipes_as_eager(model):
    """Compile ``model`` on 2 stages and check ``pipe(x)`` equals a copy of it run eagerly."""
    import copy

    import fxpipe

    torch.manual_seed(0)
    x = torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x))


def test_a_numpy_scalar_attribute_is_traced_as_a_python_number():
    # fx wrote np.float64(4.0) into the stage code: compile passed, then pipe(x) raised NameError: name 'np'
    np = pytest.importorskip("numpy")

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
            self.scale, self.shift = np.sqrt(16.0), np.int64(2)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x)) / self.scale + self.shift)

    _pipes_as_eager(Scaled())


def test_a_numpy_scalar_on_the_left_of_a_tensor_op_is_traced():
    # numpy read __array_struct__ off the proxy: "cannot trace: invalid __array_struct__"
    np = pytest.importorskip("numpy")

    class LeftScaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)
            self.scale = np.float64(0.5)

        def forward(self, x):
            h = self.scale * self.l1(x)
            return self.l2(np.float32(3.0) - np.float32(2.0) / (h.abs() + 1))

    _pipes_as_eager(LeftScaled())


class _Branchy(nn.Module):
    """Branch on a value, which torch.fx cannot trace: a leaf module's job."""

    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(4, 4), _Branchy(), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


def test_a_leaf_module_named_by_its_class_name_is_kept_whole():
    # the fx refusal names the class (leaf_modules=[_Branchy]); its name as a string was refused as no submodule
    gm = fxpipe.trace(_Holder(), leaf_modules=["_Branchy"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["a", "gate", "b"]
    with pytest.raises(ValueError, match=r"names \['Branchy'\] that are not submodules of _Holder, nor the class"):
        fxpipe.trace(_Holder(), leaf_modules=["Branchy"])


class _Shifted(nn.Module):
    """Shift when ``extra`` is given, reading nothing of it (the check alone): fx keeps the shift for a traced value."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, extra=None):
        if extra is not None:
            x = x + 100.0
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("how", ["positional", "keyword", "left-out"])
def test_a_none_input_nothing_reads_is_fixed_to_none_and_equals_eager(how):
    # the `is not None` branch was traced as taken: pipe(x) 11.9 off eager's, nothing said
    torch.manual_seed(0)
    model, x = _Shifted(), torch.randn(6, 8)
    examples = {"positional": {"example_inputs": (x, None)}, "left-out": {"example_inputs": (x,)},
                "keyword": {"example_inputs": (x,), "example_kwargs": {"extra": None}}}[how]
    pipe = fxpipe.compile(model, 2, chunks=2, devices=["cpu"] * 2, **examples)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
        torch.testing.assert_close(pipe(x, None), model(x))
        with pytest.raises(TypeError, match=r"extra= was fixed to None when the model was traced.*tracer='export'.*"
                                            r"example tensor for it"):
            pipe(x, torch.ones(1))


class _UntracedWhenNone(nn.Module):
    """Run code fx cannot trace when ``extra`` is None (eager's path), none of it otherwise."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, extra=None):
        h = self.a(x)
        if extra is None:
            h = h[: int(h.shape[0])]
        return h


def test_a_none_input_whose_eager_path_does_not_trace_is_refused_not_traced_the_other_way():
    # the first trace (the `is not None` path) was kept with a debug log: pipe(x) 0.87 off eager, nothing said
    with pytest.raises(fxpipe.TraceError, match=r"Traced with extra=None fixed.*tracer='export'"):
        fxpipe.compile(_UntracedWhenNone(), 2, example_inputs=(torch.randn(6, 8),), devices=["cpu"] * 2)


class _Used(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, extra):
        return self.a(x + extra)


def test_a_none_input_the_code_uses_is_named_not_the_tensor_beside_it():
    # the advice named 'x' (the add's first input) and concrete_args={'x': None}
    with pytest.raises(fxpipe.PropagationError, match=r"Input 'extra' is None here \(fixed to None.*eager fails the "
                                                      r"same way. Pass extra= a tensor"):
        fxpipe.compile(_Used(), 2, example_inputs=(torch.randn(6, 8), None), devices=["cpu"] * 2)


class _Batch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, batch):
        x = batch["x"]
        if batch["extra"] is not None:
            x = x + 100.0
        return self.a(x)


def test_a_none_entry_of_a_dict_input_nothing_reads_is_warned_of_naming_export():
    batch = {"x": torch.randn(6, 8), "extra": None}
    with pytest.warns(UserWarning, match=r"batch\['extra'\] of _Batch's inputs is None in the example.*tracer='export'"):
        fxpipe.compile(_Batch(), 2, example_inputs=(batch,), devices=["cpu"] * 2)
    model = _Batch()
    pipe = fxpipe.compile(model, 2, example_inputs=(batch,), devices=["cpu"] * 2, tracer="export")
    with torch.no_grad():
        torch.testing.assert_close(pipe(batch), model(batch))
