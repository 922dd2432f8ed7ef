"""Bad input either works exactly like eager or is refused, clearly, before anything changes."""

import copy
import logging
import warnings

import pytest
import torch
from models import CNN, MLP, TiedTransformer
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe import passes
from fxpipe.testing import assert_pipeline_equivalent


def _snapshot(model):
    """Record what a refused compile must leave as it was."""
    return ([id(p) for p in model.parameters()], set(vars(model)),
            {k: (v.clone(), v.device) for k, v in model.state_dict().items()})


def _assert_unchanged(model, snapshot):
    params, attrs, state = snapshot
    assert [id(p) for p in model.parameters()] == params
    assert set(vars(model)) == attrs
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k][0]) and v.device == state[k][1], k


# -- in place ---------------------------------------------------------------------------

class MutatesInput(nn.Module):
    """Scales its input in place, then reads it twice (the second read in a later stage)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        return self.c(h)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_model_that_mutates_its_input_equals_eager(checkpoint, caplog):
    x = torch.randn(6, 8)
    with caplog.at_level(logging.WARNING):
        pipe = assert_pipeline_equivalent(MutatesInput(), (x,), n_stages=3, chunks=3,
                                          checkpoint=checkpoint, devices=["cpu"] * 3)
    assert "changes its input(s) ['x'] in place" in caplog.text
    before = x.clone()
    pipe(x)
    assert torch.equal(x, before)  # it ran on a copy: the caller's tensor is left alone


class LaterStageMutatesInput(nn.Module):
    """Stage 1 scales the model's input in place; stage 2 reads the input afterwards."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x * 1)  # Linear would save x itself, and eager's backward would then refuse
        x.mul_(2)
        h = self.b(h) + x
        return self.c(h) + x


def test_input_changed_in_place_and_read_by_a_later_stage_is_refused():
    model = LaterStageMutatesInput()
    snap = _snapshot(model)
    with pytest.raises(fxpipe.MutationError, match=r"node 'mul_' in stage 1 changes 'x' \(a model "
                                                   r"input\) in place, and stage 2 reads it afterwards"):
        fxpipe.compile(model, 3, example_inputs=(torch.randn(4, 8),), split_points=["mul_", "c"])
    _assert_unchanged(model, snap)
    # with the change and every later read in one stage it is fine
    assert_pipeline_equivalent(model, (torch.randn(4, 8),), n_stages=2, chunks=2,
                               split_points=["mul_"], devices=["cpu"] * 2)


class StashedSkip(nn.Module):
    """``s`` skips from stage 0 to the last stage; ``where`` says which stage changes it in place."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        s = self.a(x) + 1  # add saves nothing for backward, so eager may change s in place
        if self.where == "producer":
            t = s * 3
            s.mul_(2)
            s = s + t
        h = torch.tanh(self.b(s * 1))  # b would save s itself for backward
        if self.where == "middle":
            s.mul_(2)
        h = torch.tanh(self.c(h))
        if self.where == "consumer":
            s.mul_(2)
        return self.d(h) * s


@pytest.mark.parametrize("where", ["producer", "consumer"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("devices", [["cpu"] * 4, ["cpu", "cpu:0", "cpu", "cpu:0"]])
def test_in_place_on_a_stashed_skip_equals_eager(where, checkpoint, devices):
    # changed by the stage that makes it (before stashing it), or by the last stage that reads it
    split = ["b", "c", "d"] if where == "producer" else ["b", "c", "mul_"]
    pipe = assert_pipeline_equivalent(StashedSkip(where), (torch.randn(6, 8),), n_stages=4, chunks=3,
                                      checkpoint=checkpoint, split_points=split, devices=devices)
    assert any(r.src == 0 and r.dst == 3 for r in pipe.plan.skips)  # it really is a stashed skip


def test_in_place_on_a_stashed_skip_read_later_is_refused():
    model = StashedSkip("middle")
    snap = _snapshot(model)
    with pytest.raises(fxpipe.MutationError) as info:
        fxpipe.compile(model, 4, example_inputs=(torch.randn(6, 8),), split_points=["b", "mul_", "d"])
    msg = str(info.value)
    assert "node 'mul_' in stage 2 changes 'add' (a value of stage 0) in place, and stage 3 reads it" in msg
    assert "x = x.mul(2) rather than x.mul_(2)" in msg and "split_points=" in msg
    _assert_unchanged(model, snap)


class InPlaceOnStageInput(nn.Module):
    """The stage that starts at ``mul_`` doubles its input in place, which is not idempotent."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x))) + 1
        h.mul_(2)
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_stage_that_changes_its_input_in_place_equals_eager(checkpoint):
    pipe = assert_pipeline_equivalent(InPlaceOnStageInput(), (torch.randn(4, 8),), n_stages=2, chunks=2,
                                      checkpoint=checkpoint, split_points=["mul_"], devices=["cpu"] * 2)
    assert any(n.target is passes.inplace.clone_tree for n in pipe.stages[1].graph.nodes)


def test_recomputation_sees_the_inputs_of_the_first_forward(monkeypatch):
    # stage 0 begins with x.mul_(2): without its private copy of x, recomputing stage 0 in
    # backward would start from 4x: with the copy switched off, backward fails or differs
    kwargs = dict(n_stages=2, chunks=2, checkpoint="always", devices=["cpu"] * 2)
    x = torch.randn(4, 8)
    model = MutatesInput()
    broken = copy.deepcopy(model)
    pipe = assert_pipeline_equivalent(model, (x,), **kwargs)
    assert any(n.target is passes.inplace.clone_tree for n in pipe.stages[0].graph.nodes)
    monkeypatch.setattr(passes, "copy_on_write", lambda stage, names: stage)
    with pytest.raises((AssertionError, RuntimeError), match="differs from eager|modified by an inplace"):
        assert_pipeline_equivalent(broken, (x,), diagnose=False, **kwargs)


class AliasedInputs(nn.Module):
    """Stage 1 changes a view of ``h`` in place and reads ``h``: two inputs share storage."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) + 1
        v = h[:, :4]
        v.add_(1)
        return self.b(h)


def test_in_place_on_aliased_stage_inputs_is_refused():
    with pytest.raises(fxpipe.MutationError, match=r"changes in place storage shared by the stage "
                                                   r"inputs \['add', 'getitem'\]"):
        fxpipe.compile(AliasedInputs(), 2, example_inputs=(torch.randn(4, 8),), split_points=["add_"])
    assert_pipeline_equivalent(AliasedInputs(), (torch.randn(4, 8),), n_stages=2, chunks=2,
                               split_points=["b"], devices=["cpu"] * 2)


class InplaceReLUNet(nn.Module):
    """``nn.ReLU(inplace=True)`` after every layer, as in torchvision's models."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x)) * 2
        return x


@pytest.mark.parametrize("annotated", [True, False])
def test_inplace_relu_found_with_and_without_example_inputs(annotated):
    model = InplaceReLUNet()
    kwargs = dict(example_inputs=(torch.randn(4, 8),)) if annotated else {}
    # a cut right before each act: the ReLU changes the stage's input in place
    pipe = fxpipe.compile(model, 4, split_points=["act", "act_1", "act_2"], chunks=2,
                          checkpoint="always", devices=["cpu"] * 4, **kwargs)
    for stage in pipe.stages[1:]:
        assert any(n.target is passes.inplace.clone_tree for n in stage.graph.nodes)
    assert_pipeline_equivalent(InplaceReLUNet(), (torch.randn(4, 8),), n_stages=4, chunks=2,
                               checkpoint="always", split_points=["act", "act_1", "act_2"],
                               devices=["cpu"] * 4)


# -- outputs, batch, shapes, dtypes --------------------------------------------------------

class NonTensorOutputs(nn.Module):
    def __init__(self, batch_dependent=False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.batch_dependent = batch_dependent

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        extra = x.shape[0] if self.batch_dependent else x.shape[1]
        return {"y": y, "label": "logits", "width": extra, "none": None}


def test_non_tensor_outputs():
    pipe = assert_pipeline_equivalent(NonTensorOutputs(), (torch.randn(6, 4),), n_stages=2, chunks=3,
                                      devices=["cpu"] * 2)
    out = pipe(torch.randn(6, 4))
    assert (out["label"], out["width"], out["none"]) == ("logits", 4, None)
    with pytest.warns(UserWarning, match="an int that follows the batch size"):  # seen at compile
        pipe = fxpipe.compile(NonTensorOutputs(batch_dependent=True), 2, example_inputs=(torch.randn(5, 4),),
                              chunks=3, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match=r"\['width'\] \(node 'getitem'\): 5 for 5 rows but 2 for 2: "
                                                        r"an int that follows the batch size"):
        pipe(torch.randn(5, 4))  # refused before anything runs
    assert pipe.plan.chunks == 3
    pipe = fxpipe.compile(NonTensorOutputs(batch_dependent=True), 2, chunks=3, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"output leaf 2 is a int that differs between micro-batches "
                                         r"\(2 in the first, 1 in another\)"):
        pipe(torch.randn(5, 4))  # without example inputs: found when joined (micro-batches of 2, 2 and 1 rows)
    fxpipe.compile(NonTensorOutputs(batch_dependent=True), 2, chunks=1, devices=["cpu"] * 2)


def test_batch_size_zero():
    model = MLP()
    snap = _snapshot(model)
    with pytest.raises(fxpipe.PipelineInputError, match="'x' has batch size 0"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(0, 16),))
    _assert_unchanged(model, snap)
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match="'x' has batch size 0"):
        pipe(torch.randn(0, 16))
    with pytest.raises(fxpipe.PipelineInputError, match="'x' has batch size 0"):  # named as the forward's input
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(0, 16),), tracer="export")


def test_other_non_batch_shapes_work_with_the_fx_graph():
    model = CNN().eval()
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(torch.randn(4, 3, 8, 8),), chunks=2, devices=["cpu"] * 3)
    x = torch.randn(5, 3, 12, 12)
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-6)
    tied = TiedTransformer()
    reference = copy.deepcopy(tied)
    pipe = fxpipe.compile(tied, 2, example_inputs=(torch.randint(0, 32, (4, 8)),), chunks=2, devices=["cpu"] * 2)
    tokens = torch.randint(0, 32, (3, 5))
    torch.testing.assert_close(pipe(tokens), reference(tokens), rtol=0, atol=1e-6)


def test_an_exported_graph_keeps_only_the_dims_the_model_fixes():
    model = CNN().eval()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 3, 8, 8),), chunks=2,
                          devices=["cpu"] * 2, tracer="export")
    x = torch.randn(4, 3, 12, 12)  # the image size is free: torch.export keeps it dynamic
    torch.testing.assert_close(pipe(x), model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 'x' has shape \(4, 4, 8, 8\) but the "
                                                        r"exported graph is fixed to \('\*', 3, '\*', '\*'\)"):
        pipe(torch.randn(4, 4, 8, 8))  # the channels are fixed by the first convolution's weight
    with pytest.raises(fxpipe.PipelineInputError, match=r"has dtype torch.float64 .*: cast it "
                                                        r"\(x.to\(torch.float32\)\), or compile with an example"):
        pipe(torch.randn(4, 3, 8, 8, dtype=torch.float64))
    assert pipe(torch.randn(3, 3, 8, 8)).shape == (3, 5)  # another batch size is fine


class _Timestep(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.emb = nn.Linear(8, 8), nn.Linear(8, 8), nn.Embedding(1000, 8)

    def forward(self, x, t):
        if not torch.is_tensor(t):  # a diffusion model's timestep: an int, a float or a tensor
            t = torch.tensor([t], device=x.device)
        return self.b(torch.relu(self.a(x) + self.emb(t.expand(x.shape[0]))))


def test_a_python_number_an_exported_graph_fixed_is_refused_naming_the_input():
    # torch's own "Guard failed: t == 10" from inside stage 0 on the second step of every denoising loop
    model, x = _Timestep(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, 10), chunks=2, devices=["cpu"] * 2, tracer="export")
    torch.testing.assert_close(pipe(x, 10), model(x, 10))
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 't' is 500 but torch.export fixed it to the "
                                                        r"example's 10: .*torch.tensor\(500\), at compile too"):
        pipe(x, 500)
    torch.testing.assert_close(pipe(x, torch.tensor(10)), model(x, 10))  # the value it fixed, as a tensor
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 't' is a tensor of shape \(\) but torch.export "
                                                        r"fixed it to the example's 10"):
        pipe(x, torch.tensor(500))  # was torch's "Guard failed: t == 10" from inside stage 0
    by_tensor = fxpipe.compile(model, 2, example_inputs=(x, torch.tensor(10)), chunks=2, devices=["cpu"] * 2,
                               tracer="export")
    torch.testing.assert_close(by_tensor(x, torch.tensor(500)), model(x, 500))
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 't' is 500 \(a int\) but the exported graph "
                                                        r"takes a tensor there"):
        by_tensor(x, 500)  # was aten::expand's "Expected a value of type 'Tensor'" from inside stage 0


class _Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, labels=None):  # a Hugging Face model's own loss
        h = self.b(torch.relu(self.a(x)))
        return {"loss": torch.nn.functional.mse_loss(h, labels) if labels is not None else h.sum() * 0, "h": h}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_none_where_the_plan_has_a_tensor_and_back_is_refused_naming_the_input(tracer):
    # None where compile had labels: AttributeError 'NoneType' object has no attribute 'size' from inside stage 1
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(_Optional(), 2, example_kwargs={"x": x, "labels": y}, chunks=2, devices=["cpu"] * 2,
                          tracer=tracer)
    with pytest.raises(fxpipe.PipelineInputError, match="input 'labels' is None, but the plan was built for a tensor "
                                                        "of 2 dimension"):
        pipe(x=x, labels=None)
    if tracer == "export":  # compiled with labels=None, a tensor later was ignored: another loss, silently
        pipe = fxpipe.compile(_Optional(), 2, example_kwargs={"x": x, "labels": None}, chunks=2,
                              devices=["cpu"] * 2, tracer=tracer)
        with pytest.raises(fxpipe.PipelineInputError, match="input 'labels' is a tensor of 2 dimension.*built for "
                                                            "None: the stages were traced without it"):
            pipe(x=x, labels=y)


@pytest.mark.parametrize("chunks", [1, 3])
def test_float64_model(chunks):
    model = TiedTransformer().double()
    pipe = assert_pipeline_equivalent(model, (torch.randint(0, 32, (6, 8)),), n_stages=3, chunks=chunks,
                                      devices=["cpu"] * 3)
    assert pipe(torch.randint(0, 32, (2, 8))).dtype == torch.float64


def test_bfloat16_model():
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    # one micro-batch runs the very same kernels as eager: bit for bit equal
    assert_pipeline_equivalent(MLP().to(torch.bfloat16), (x,), n_stages=3, chunks=1, rtol=0, atol=0,
                               devices=["cpu"] * 3)
    # several round each micro-batch's gradient to bfloat16 before summing: bfloat16's tolerance
    pipe = assert_pipeline_equivalent(MLP().to(torch.bfloat16), (x,), n_stages=3, chunks=3,
                                      devices=["cpu"] * 3)
    assert pipe(x).dtype == torch.bfloat16


# -- devices, sharing --------------------------------------------------------------------

@pytest.mark.parametrize("device, message", [
    ("gpu7", "not a device"),
    ("meta", "meta tensors hold no data"),
    ("mps", "that backend is not available"),
    ("xla:0", "that backend is not available"),
] + ([("cuda:7", "CUDA is not available")] if not torch.cuda.is_available() else
     [(f"cuda:{torch.cuda.device_count()}", "CUDA device\\(s\\) exist")]))
def test_devices_that_do_not_exist(device, message):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    model = MLP()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(2, 16),), devices=["cpu", device])
    _assert_unchanged(model, snap)


class FrozenShared(nn.Module):
    """A frozen projection used at the start and at the end of the model."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.body = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = self.frozen(x)
        for layer in self.body:
            h = torch.tanh(layer(h))
        return self.frozen(h)


@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu", "cpu:0", "cpu"]])
def test_frozen_parameter_shared_across_stages(devices):
    model = FrozenShared()
    pipe = assert_pipeline_equivalent(model, (torch.randn(6, 8),), n_stages=3, chunks=3,
                                      checkpoint="always", devices=devices)
    assert model.frozen.weight.grad is None and model.body[0].weight.grad is not None
    first = {id(p) for p in pipe.stages[0].parameters()}
    last = {id(p) for p in pipe.stages[-1].parameters()}
    assert id(model.frozen.weight) in first and id(model.frozen.weight) in last


class CalledTwice(nn.Module):
    """One block applied twice, far apart: its parameters serve the first and the last stage."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.middle = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = self.block(x)
        for layer in self.middle:
            h = torch.relu(layer(h))
        return self.block(h)


@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu", "cpu:0", "cpu:0"]])
def test_module_called_twice(devices):
    model = CalledTwice()
    pipe = assert_pipeline_equivalent(model, (torch.randn(6, 8),), n_stages=3, chunks=2, devices=devices)
    assert [n.target for n in pipe._gm.graph.nodes if n.op == "call_module"].count("block.0") == 2
    assert id(model.block[0].weight) in {id(p) for p in pipe.stages[-1].parameters()}


# -- run-time failures -----------------------------------------------------------------

class Gate(nn.Module):
    """Refuse large input at run time (data-dependent, so a leaf)."""

    def __init__(self, when="always"):
        super().__init__()
        self.when = when

    def forward(self, x):
        if self.when == "recompute" and not fxpipe.is_recomputing():
            return x
        if (x.abs() > 1000).any():
            raise ValueError("Gate got an input over 1000")
        return x


class Gated(nn.Module):
    def __init__(self, when="always"):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.gate = Gate(when)

    def forward(self, x):
        return self.c(self.gate(self.b(self.a(x))))


def test_forward_that_raises_names_stage_and_node():
    pipe = fxpipe.compile(Gated(), 3, example_inputs=(torch.randn(4, 4),), leaf_modules=[Gate],
                          split_points=["b", "c"], chunks=2, devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="Gate got an input over 1000") as info:
        pipe(torch.randn(4, 4) * 1e5)
    notes = "\n".join(info.value.__notes__)
    assert "fxpipe: raised in stage 1 (cpu), node 'gate' (call_module gate: Gate, module 'gate'), " \
           "in checkpointed forward" in notes
    with pytest.raises(RuntimeError) as info:  # a shape error from torch itself, in stage 0
        pipe(torch.randn(4, 5))
    assert "stage 0 (cpu), node 'a' (call_module a: Linear, module 'a'), in checkpointed forward" \
        in "\n".join(info.value.__notes__)


def test_zero_bubble_stages_name_the_node_too():
    pipe = fxpipe.compile(Gated(), 3, example_inputs=(torch.randn(4, 4),), leaf_modules=[Gate],
                          split_points=["b", "c"], chunks=2, devices=["cpu"] * 3, schedule="zb")
    with pytest.raises(RuntimeError) as info:  # in a linear that defers its weight gradient
        pipe.step(torch.randn(4, 5), target=torch.randn(4, 4), loss_fn=torch.nn.functional.mse_loss)
    assert "stage 0 (cpu), node 'a' (call_function linear" in "\n".join(info.value.__notes__)


def test_raise_in_recomputation_names_stage_node_and_pass():
    pipe = fxpipe.compile(Gated("recompute"), 3, example_inputs=(torch.randn(4, 4),),
                          leaf_modules=[Gate], split_points=["b", "c"], chunks=2,
                          checkpoint="always", devices=["cpu"] * 3)
    out = pipe(torch.randn(4, 4) * 1e5)
    with pytest.raises(ValueError, match="Gate got an input over 1000") as info:
        out.sum().backward()
    assert "stage 1 (cpu), node 'gate' (call_module gate: Gate, module 'gate'), in recomputation " \
           "in backward" in "\n".join(info.value.__notes__)


class _SizedPatches(nn.Module):
    """Assert the image size it was built for with an f-string, as timm's patch embedding does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 4, stride=4), nn.Linear(4, 2)

    def forward(self, x):
        torch._assert(x.shape[2] == 8, f"Input height ({x.shape[2]}) doesn't match model (8).")
        return self.b(self.a(x).mean((2, 3)))


def test_an_assertion_message_formatted_while_traced_is_explained():
    # "Input height (Proxy(getitem_2)) doesn't match model (32)." left the user to guess the value
    pipe = fxpipe.compile(_SizedPatches(), 2, example_inputs=(torch.randn(2, 3, 8, 8),), devices=["cpu"] * 2)
    with pytest.raises(AssertionError, match=r"Proxy\(") as info:
        pipe(torch.randn(2, 3, 12, 12))
    assert "formatted while the model was traced, so Proxy(...) stands for the value" in "\n".join(info.value.__notes__)


class CatAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.cat([self.a(x), y], 0)
        return self.b(h) + y.sum()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_an_op_raising_in_generated_code_names_its_call_function_node(schedule, capfd):
    # torch.fx drops the traceback of an op that raises right in a GraphModule's code (and
    # prints the code to stderr); the stage call keeps it, so the note names the node.
    pipe = fxpipe.compile(CatAdd(), 2, example_inputs=(torch.randn(4, 8), torch.randn(4, 8)),
                          split_points=["b"], devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(RuntimeError) as info:
        pipe.step(torch.randn(4, 8), torch.randn(4, 7), target=None, loss_fn=lambda out, _: out.sum())
    assert "fxpipe: raised in stage 0 (cpu), node 'cat' (call_function cat)" in "\n".join(info.value.__notes__)
    assert "<--- HERE" not in capfd.readouterr().err


_FAILS_ON = {"fx": fxpipe.PropagationError, "export": fxpipe.TraceError}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_example_inputs_as_a_list_says_to_pass_a_tuple(tracer):
    """A list is one input (a model may take a list); when the model then fails, say so first."""
    # under export the hint was missing: the refusal blamed a dependence on the batch size
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(_FAILS_ON[tracer], match="^example_inputs is a list, so the model got it as its one "
                                                "input; to give several inputs pass a tuple"):
        fxpipe.compile(model, 2, example_inputs=[torch.randn(4, 8)], devices=["cpu"] * 2, tracer=tracer)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_example_inputs_as_a_dict_says_to_pass_example_kwargs(tracer):
    # the hint was the generic one: "a branch was dropped, use tracer='export'"; then it wrote
    # two keys as {'x', 'm': ...}, and under export it was missing
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(_FAILS_ON[tracer], match=r"^example_inputs is a dict, so the model got it as its one "
                                                r"input; to give inputs by name pass "
                                                r"example_kwargs=\{'input': \.\.\., 'mask': \.\.\.\}"):
        fxpipe.compile(model, 2, example_inputs={"input": torch.randn(4, 8), "mask": torch.ones(4, 8)},
                       devices=["cpu"] * 2, tracer=tracer)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x) + y))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("container", [list, dict])
def test_several_inputs_given_as_a_list_or_a_dict_get_the_same_hint(tracer, container):
    # a model of two inputs given [x, y] or {"x": x, "y": y} was told only "missing a value for the model input 'y'"
    x = torch.randn(4, 8)
    given = [x, x] if container is list else {"x": x, "y": x}
    fix = "pass a tuple" if container is list else r"example_kwargs=\{'x': \.\.\., 'y': \.\.\.\}"
    with pytest.raises(TypeError, match=rf"^example_inputs is a {container.__name__}, so the model got it as its one "
                                        rf"input; .*{fix}.*\n.*'y'"):
        fxpipe.compile(_TwoInputs(), 2, example_inputs=given, devices=["cpu"] * 2, tracer=tracer)


def test_a_pipe_given_to_compile_and_a_loss_fn_that_is_no_function_are_refused_naming_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="fxpipe.compile got a Pipe, which is compiled already: compile the model"):
        fxpipe.compile(pipe, 2, example_inputs=(x,))
    with pytest.raises(TypeError, match=r"loss_fn must be a function \(output, target\) -> loss, got str.*for a "
                                        r"model that computes its own loss \(Hugging Face's labels=\) "
                                        r"loss_fn=lambda out, _: out.loss"):
        pipe.step(x, target=x, loss_fn="mse")
    with pytest.raises(TypeError, match=r"loss_fn= is the class MSELoss, not a loss: pass an instance, "
                                        r"loss_fn=MSELoss\(\)"):  # it failed in torch: "Boolean value of Tensor ..."
        pipe.step(x, target=x, loss_fn=nn.MSELoss)
    pipe.step(x, target=x, loss_fn=nn.MSELoss())


def test_a_step_without_target_or_loss_fn_names_what_each_takes():
    # Python's "missing 1 required keyword-only argument: 'target'" left a model computing its own loss guessing
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=r"pipe.step\(\) needs target=: the batch's target, or target=None for a model "
                                        r"that computes its own loss .*; across ranks only the loss's rank"):
        pipe.step(x, loss_fn=lambda out, _: out.sum())
    with pytest.raises(TypeError, match=r"pipe.step\(\) needs loss_fn=: a function \(output, target\) -> loss"):
        pipe.step(x, target=x)
    with pytest.raises(TypeError, match=r"pipe.step\(\) needs target=: .*; and loss_fn=: a function"):
        pipe.step(x)  # both named at once
    loss = pipe.step(x, target=None, loss_fn=lambda out, _: out.pow(2).mean())  # target=None, as the message says
    torch.testing.assert_close(loss, model(x).pow(2).mean())


def test_devices_with_the_distributed_runtime_are_refused_naming_the_fix():
    # they were ignored: cuda:0 and cuda:1 on a machine without GPUs ran on the CPU, silently
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"devices=\['cuda:0', 'cuda:1'\] places the stages of one process; with "
                                         r"runtime='distributed' each rank runs its stages on its own device.*leave "
                                         r"devices= out"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), runtime="distributed",
                       devices=["cuda:0", "cuda:1"])


def test_data_parallel_true_is_refused_naming_the_count_to_pass():
    # True read as a switch got "use an integer of at least 1", not what the count is
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"data_parallel=True; use an integer.*True is not a count.*data_parallel=2 "
                                         r"for 2 stages on 4 ranks"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), runtime="distributed", data_parallel=True)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_model_wrapped_for_data_parallel_is_refused_naming_model_module(tracer):
    # a DDP-wrapped model got a TraceError pointing into torch's DDP source, suggesting leaf_modules=
    model = nn.DataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    with pytest.raises(TypeError, match=r"wrapped in DataParallel.*model\.module.*data_parallel=N"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2, tracer=tracer)


class _Flagged(nn.Module):
    """A forward whose flag chooses its code path (a Hugging Face model's use_cache, return_dict)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_cache=False, return_dict=True):
        h = self.b(torch.relu(self.a(x)))
        h = (h, h.sum()) if use_cache else h
        return {"h": h} if return_dict else h


def test_a_flag_the_export_fixed_names_the_value_to_call_with_not_a_tensor():
    # the message advised torch.tensor(True) and tracer='fx', neither of which works for a flag
    model, x = _Flagged(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"use_cache": False, "return_dict": True},
                          chunks=2,
                          devices=["cpu"] * 2, tracer="export")
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 'use_cache' is True but torch.export fixed it to the "
                                                        r"example's False: a flag .* Call it with use_cache=False, "
                                                        r"since a key/value cache .* feed the whole sequence"):
        pipe(x, use_cache=True)
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 'return_dict' is False .* Call it with "
                                                        r"return_dict=True, or compile another pipe with "
                                                        r"example_kwargs=\{'return_dict': False\}"):
        pipe(x, use_cache=False, return_dict=False)


class _ImageList(nn.Module):
    """Take a list of images (a detection model's input) and stack them into the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, images):
        return self.head(self.conv(torch.stack(images)).mean((2, 3)))


class _Pair(nn.Module):
    """Take a tuple of two batched tensors and join them along the features."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, pair):
        return self.b(self.a(torch.cat(pair, dim=1)))


def test_a_list_of_images_stacked_into_the_batch_is_refused_naming_the_fix():
    # before: each image was split on its own dim 0, its channels, and the first call failed inside the conv
    images = [torch.rand(3, 8, 8) for _ in range(4)]
    with pytest.raises(ValueError, match=r"input 'images' is a list of 4 tensors of shape \(3, 8, 8\) that node "
                                         r"'stack' \(stack\) joins into the batch.*Pass the batch as one tensor"):
        fxpipe.compile(_ImageList(), 2, example_inputs=(images,), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.TraceError, match=r"^input\(s\) \['images'\] of _ImageList are lists of tensors, the "
                                                r"likely cause"):  # first: it led with a line that fixes nothing
        fxpipe.compile(_ImageList(), 2, example_inputs=(images,), chunks=2, devices=["cpu"] * 2, tracer="export")
    model = _ImageList()
    pipe = fxpipe.compile(model, 2, example_inputs=(images,), chunks=1, devices=["cpu"] * 2)
    assert torch.allclose(pipe(images), model(images))


def test_a_tuple_of_batched_tensors_joined_along_the_features_is_split_as_usual():
    pair = (torch.randn(4, 4), torch.randn(4, 4))
    model = _Pair()
    pipe = fxpipe.compile(model, 2, example_inputs=(pair,), chunks=2, devices=["cpu"] * 2)
    assert torch.allclose(pipe(pair), model(pair), atol=1e-6)


class _Views(nn.Module):
    """Encode two views of a batch at once (SimCLR): the views, batched already, joined on dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, views):
        first, second = self.enc(torch.cat(views)).chunk(2)
        return self.head(first * second)


class _Fused(nn.Module):
    """Fuse feature maps of one size, batched already, by a stack and a sum over the maps (BiFPN)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.conv, self.head = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, maps):
        return self.head(self.conv(torch.stack(maps, dim=self.dim).sum(self.dim)).mean((2, 3)))


class _Sequences(nn.Module):
    """Stack per-sample sequences into the batch and attend over each: the list is the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

    def forward(self, seqs):
        h = torch.stack(seqs)
        return self.head(self.attn(h, h, h)[0]).transpose(0, 1)


def test_lists_of_batched_tensors_concatenated_on_dim_0_or_stacked_on_another_are_split_as_usual():
    # the refusal of a list of images first refused these too, though splitting each tensor on dim 0 is right
    views = [torch.randn(8, 8), torch.randn(8, 8)]
    maps = [torch.randn(8, 4, 6, 6) for _ in range(3)]
    for model, value in ((_Views(), views), (_Fused(-1), maps)):
        pipe = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(value,), chunks=4, devices=["cpu"] * 2)
        assert torch.allclose(pipe(value), model(value), atol=1e-6), type(model).__name__


def test_a_list_stacked_on_dim_0_is_refused_even_where_its_split_runs():
    # per-sample sequences stacked into the batch: the split cut every sequence's tokens in half and ran, 0.96
    # off eager, silently (a check of whether the split runs let it through); maps stacked on dim 0 name dim=-1
    seqs = [torch.randn(6, 8) for _ in range(8)]
    with pytest.raises(ValueError, match=r"input 'seqs' is a list of 8 tensors of shape \(6, 8\) .* a sequence "
                                         r"along its tokens"):
        fxpipe.compile(_Sequences(), 2, example_inputs=(seqs,), chunks=2, devices=["cpu"] * 2)
    maps = [torch.randn(8, 4, 6, 6) for _ in range(3)]
    with pytest.raises(ValueError, match=r"stack them along another dim \(torch.stack\(maps, dim=-1\)\)"):
        fxpipe.compile(_Fused(0), 2, example_inputs=(maps,), chunks=2, devices=["cpu"] * 2)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_example_inputs_packed_in_one_tuple_too_many_get_a_note_naming_the_fix(tracer):
    # before: fx blamed a dropped branch, export the batch size; neither named the extra tuple
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(Exception) as info:
        fxpipe.compile(model, 2, example_inputs=((torch.randn(4, 8),),), devices=["cpu"] * 2, tracer=tracer)
    assert any("pass example_inputs=(x,), not ((x,),)" in note for note in getattr(info.value, "__notes__", []))


def test_a_local_pipe_left_at_its_default_under_torchrun_is_warned_of(monkeypatch):
    # before: each of the launched processes trained its own whole pipeline, silently
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(4, 4)
    with pytest.warns(UserWarning, match=r"but 2 processes were launched \(torchrun\).*runtime='distributed'"):
        fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said on purpose: no warning
        fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, example_inputs=(x,), devices=["cpu"] * 2,
                       runtime="local")


def test_none_inside_a_dict_input_is_named_by_its_key():
    # "input 'd' is a dict of 2 item(s), but the plan was built for a dict of 2 item(s)"
    class _Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, d):
            return self.b(torch.relu(self.a(d["x"]) + d["z"]))

    x = torch.randn(8, 8)
    pipe = fxpipe.compile(_Dict(), 2, example_inputs=({"x": x, "z": x},), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 'd\['z'\]' is None, but the plan was built for a "
                                                        "tensor of 2 dimension"):
        pipe({"x": x, "z": None})


class _Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x)


class _Fuse(nn.Module):
    """Concatenate a skip where it is a tensor: under fx a Proxy is not, so the concatenation is dropped."""

    def __init__(self):
        super().__init__()
        self.mix = _Mix()

    def forward(self, x, skip=None):
        if isinstance(skip, torch.Tensor):
            x = torch.cat([x, skip], 1)
        return self.mix(x)


class _FusedSkip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.fuse = nn.Linear(8, 8), _Fuse()

    def forward(self, x):
        h = self.a(x)
        return self.fuse(h, h)


def test_a_dropped_branch_names_the_modules_around_the_failing_node_as_leaves():
    # only the innermost module was named (leaf_modules=[_Mix]), which fails again: the check is in _Fuse, around it
    with pytest.raises(fxpipe.PropagationError, match=r"leaf_modules=\[_Mix\] \(or, where the check is in a module "
                                                      r"around it, \[_Fuse\]"):
        fxpipe.compile(_FusedSkip(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2)
    fxpipe.compile(_FusedSkip(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2, leaf_modules=[_Fuse])


class _Heads(nn.Module):
    """Split the channels into heads by the input's three dims (a model that cannot take a fourth)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, c = x.shape
        return self.b(torch.relu(self.a(x)).reshape(b, t, 2, c // 2).flatten(2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_input_of_another_ndim_failing_in_one_process_is_noted_against_the_example(schedule):
    # across ranks it is refused by name before the call; in one process torch's "mat1 and mat2 shapes cannot be
    # multiplied" came with the failing node alone, nothing naming the input the example had with one dim fewer
    model, x = _Heads(), torch.randn(4, 5, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(RuntimeError) as raised:
        pipe.step(x.unsqueeze(-1), target=x, loss_fn=F.mse_loss)
    assert "fxpipe: input 'x' has shape (4, 5, 8, 1), where the example it was traced with " \
           "had 3 dimension(s) (4, 5, 8): pass inputs of the example's kind, or compile with " \
           "example inputs of this kind" in raised.value.__notes__
    with pytest.raises(RuntimeError) as raised:
        pipe(x.unsqueeze(-1))
    assert any("input 'x' has shape (4, 5, 8, 1)" in n for n in raised.value.__notes__)
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(TypeError) as raised:  # a later call's own failure, outside the stages: no note of it
        pipe(x.unsqueeze(-1), bogus=1)
    assert not getattr(raised.value, "__notes__", None)


class _DictPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch):
        return self.b(torch.relu(self.a(batch["x"]) * batch["m"]))


def test_the_note_of_another_ndim_names_the_entry_of_a_container_input():
    model, x = _DictPair(), {"x": torch.randn(4, 8), "m": torch.rand(4, 1)}
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(RuntimeError) as raised:
        pipe({"x": x["x"], "m": torch.rand(4, 1, 3)})
    assert any(n.startswith("fxpipe: input 'batch['m']' has shape (4, 1, 3)") for n in raised.value.__notes__)


def test_a_float_input_of_another_dtype_across_ranks_names_a_cast_model():
    # across ranks the plan keeps its inputs' dtype: "cast the input" alone sent a user who had cast
    # the model (model.to(torch.bfloat16)) back to float32 inputs, which the bf16 weights refuse
    from fxpipe.passes.annotate import TensorSpec
    from fxpipe.runtime.validate import check_signature

    want = TensorSpec(shape=(4, 8), dtype=torch.float32, requires_grad=False)
    got = TensorSpec(shape=(4, 8), dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(fxpipe.PipelineInputError, match=r"dtype may not: cast the input.*a model cast after compile.*"
                                                        r"cast the model before fxpipe.compile"):
        check_signature(["x"], [got], [want])
    ids = TensorSpec(shape=(4, 8), dtype=torch.int32, requires_grad=False)
    with pytest.raises(fxpipe.PipelineInputError) as refused:
        check_signature(["x"], [ids], [TensorSpec(shape=(4, 8), dtype=torch.int64, requires_grad=False)])
    assert "model cast" not in str(refused.value)


class _MaskedWhenGiven(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = torch.relu(self.a(x))
        if mask is not None:
            h = h * mask
        return self.c(torch.relu(self.b(h)))


def test_a_none_input_traced_as_a_value_without_examples_is_named_with_its_fixes():
    # compiled without example inputs, pipe(x) raised "unsupported operand type(s) for *: 'Tensor' and 'NoneType'"
    # from inside stage 1, naming the node only
    model, x = _MaskedWhenGiven(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, chunks=2, devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(x, torch.ones(4, 8)), model(x, torch.ones(4, 8)))
    with pytest.raises(TypeError) as info:
        pipe(x)
    assert "fxpipe: if 'mask' was None in this call: torch.fx traced it as a value" in "\n".join(info.value.__notes__)
    assert "example inputs giving mask=None" in "\n".join(info.value.__notes__)
