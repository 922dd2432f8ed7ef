"""pipe.step: one training step with a loss per micro-batch equals eager's loss and gradients."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import TiedTransformer, token_loss
from torch import nn
from unet import UNet

import fxpipe
from fxpipe.testing import max_relative_error


def _compare(model, x, target, loss_fn, **kw):
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, example_inputs=(x,), **kw)
    loss = pipe.step(x, target=target, loss_fn=loss_fn)
    assert loss.requires_grad is False
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_step_cross_entropy_transformer(chunks, checkpoint, schedule):
    model = TiedTransformer()
    tokens = torch.randint(0, 32, (7, 8))
    target = torch.randint(0, 32, (7, 8))

    _compare(model, tokens, target, token_loss, n_stages=3, chunks=chunks, checkpoint=checkpoint,
             devices=["cpu"] * 3, schedule=schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_step_mse_unet_uneven_micro_batches(schedule):
    model = UNet(depth=2, base=4).eval()
    x, target = torch.randn(5, 3, 8, 8), torch.randn(5, 2, 8, 8)
    _compare(model, x, target, F.mse_loss, n_stages=4, chunks=4, devices=["cpu"] * 4, schedule=schedule)


def test_zero_bubble_step_runs_deferred_weight_gradients_in_w(monkeypatch):
    from fxpipe.runtime.stage import wgrad

    model = TiedTransformer()
    tokens = torch.randint(0, 32, (6, 8))
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=3, schedule="zb", devices=["cpu"] * 3)
    assert "0W2" in pipe.code.split()
    sizes = []
    run = wgrad.run
    monkeypatch.setattr(wgrad, "run", lambda store: (sizes.append(len(store)), run(store)))
    with fxpipe.timeline() as tl:
        pipe.step(tokens, target=tokens, loss_fn=lambda out, t: out.logsumexp(-1).mean())
    assert len(sizes) == 9 and sum(sizes) > 0  # a W per stage and micro-batch, some with linears
    weights = sorted((e["args"]["stage"], e["args"]["micro_batch"]) for e in tl.events if e["cat"] == "weight")
    assert weights == [(j, i) for j in range(3) for i in range(3)]


def test_step_rejects_a_target_of_another_batch_size():
    model = UNet(depth=2, base=4).eval()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 3, 8, 8),), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match="target has 3 rows on dim 0 but the inputs have 4"):
        pipe.step(torch.randn(4, 3, 8, 8), target=torch.randn(3, 2, 8, 8), loss_fn=F.mse_loss)


def test_step_refuses_a_target_given_as_a_list_of_per_row_numbers():
    # each micro-batch got the whole list: "Expected input batch_size (2) to match target batch_size (6)" from loss_fn
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(6, 8),), chunks=3, devices=["cpu"] * 2)
    loss_fn = lambda out, t: F.cross_entropy(out, torch.as_tensor(t))  # noqa: E731
    labels = [0, 1, 2, 0, 1, 2]
    for target, where in [(labels, r" \(a list\)"), (np.array(labels), r" \(a NumPy array\)"),
                          ({"labels": labels}, r"\['labels'\] \(a list\)"),
                          ([np.int64(v) for v in labels], r" \(a list\)")]:
        with pytest.raises(fxpipe.PipelineInputError, match=rf"target{where} holds 6 numbers, one per row of the "
                                                            r"batch, outside a tensor: .*torch.as_tensor"):
            pipe.step(torch.randn(6, 8), target=target, loss_fn=lambda out, t: F.cross_entropy(out, torch.as_tensor(
                t["labels"] if isinstance(t, dict) else np.asarray(t))))
    pipe.step(torch.randn(6, 8), target=torch.tensor(labels), loss_fn=loss_fn)
    one = fxpipe.compile(model, 2, example_inputs=(torch.randn(6, 8),), chunks=1, devices=["cpu"] * 2)
    one.step(torch.randn(6, 8), target=labels, loss_fn=loss_fn)  # one micro-batch: the list is its target, as eager


@pytest.mark.parametrize("classes", [8, 5])
def test_class_weights_in_the_target_are_named_with_the_way_to_give_them(classes):
    # weights as long as the batch were split with the rows (torch's "weight tensor should be defined for all 8
    # classes"); of another length, the refusal's fix named unbatched=, which the forward's inputs take, not a loss's
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))
    x, y, w = torch.randn(8, 8), torch.randint(0, classes, (8,)), torch.rand(classes)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    told = r"not per row \(class weights.*give it to loss_fn another way, not in target=: a closure"
    with pytest.raises((RuntimeError, fxpipe.PipelineInputError), match=told) as caught:
        pipe.step(x, target=(y, w), loss_fn=lambda out, t: F.cross_entropy(out, t[0], weight=t[1]))
    assert "unbatched=" not in str(caught.value) + "".join(getattr(caught.value, "__notes__", []))
    if classes == 8:  # per-row weights looked up by label (w[labels]): torch's IndexError names the micro-batch's rows
        with pytest.raises(IndexError, match=told):
            pipe.step(x, target=(torch.arange(8).roll(1), w), loss_fn=lambda out, t: (
                F.cross_entropy(out, t[0], reduction="none") * t[1][t[0]]).mean())
    pipe.step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out, t, weight=w))


def test_inputs_or_a_target_on_meta_are_refused_naming_example_inputs():
    # torch's "Cannot copy out of meta tensor; no data!" and "Tensor.item() cannot be called on meta tensors"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    told = "on the meta device .*example_inputs= at fxpipe.compile"
    with pytest.raises(fxpipe.PipelineInputError, match="input 0 is " + told):
        pipe.step(x.to("meta"), target=y, loss_fn=F.cross_entropy)
    with pytest.raises(fxpipe.PipelineInputError, match=r"target\[1\] is " + told):
        pipe.step(x, target=(y, y.to("meta")), loss_fn=lambda out, t: F.cross_entropy(out, t[0]))
    with pytest.raises(fxpipe.PipelineInputError, match="input 0 is " + told):
        pipe(x.to("meta"))
    pipe.step(x, target=y, loss_fn=F.cross_entropy)


_HEAD = nn.Linear(3, 3)  # a head loss_fn reads by its global name (a script's usual style)


def _headed_loss(out, t):
    return F.cross_entropy(_HEAD(out), t)


def _through_a_helper(out, t):
    return _headed_loss(out, t)  # the head two calls down


class _HeadedLoss(nn.Module):
    def forward(self, out, t):
        return F.cross_entropy(_HEAD(out), t)  # a loss module's forward reading the global head


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_step_with_nothing_to_train_is_refused_and_a_loss_s_own_parameter_trains(schedule):
    # a frozen model: torch's "element 0 of tensors does not require grad" under gpipe, and under 1f1b a loss
    # returned with no gradient anywhere, silently
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(fxpipe.PipelineInputError, match="its loss does not require grad: no parameter the model.s "
                                                        "output or loss_fn depends on.*requires_grad_\\(True\\)"):
        pipe.step(x, target=y, loss_fn=F.cross_entropy)
    temperature = nn.Parameter(torch.tensor(2.0))  # a frozen backbone under a learnt loss's own parameter
    pipe.step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out * temperature, t))
    assert temperature.grad is not None
    _HEAD.zero_grad()
    pipe.step(x, target=y, loss_fn=_headed_loss)  # was refused: the walk saw closures, not globals
    assert _HEAD.weight.grad is not None
    for loss_fn in (_through_a_helper, _HeadedLoss()):  # were refused: the walk read one level of globals
        _HEAD.zero_grad()
        pipe.step(x, target=y, loss_fn=loss_fn)
        assert _HEAD.weight.grad is not None
    probe = x.clone().requires_grad_()  # an input's gradient through the frozen model (adversarial examples)
    pipe = fxpipe.compile(model, 2, example_inputs=(probe,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    pipe.step(probe, target=y, loss_fn=F.cross_entropy)
    assert probe.grad is not None


def test_one_sample_without_its_batch_dim_is_refused_naming_unsqueeze():
    # x[0] of shape (16,): its 16 features were split as rows, and torch raised "mat1 and mat2 shapes cannot be
    # multiplied (1x4 and 16x8)" from inside a stage
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match=r"input 'input' has shape \(16,\), the example's \(8, 16\) "
                                                        r"without its first dim.*unsqueeze\(0\)"):
        pipe(x[0])
    with torch.no_grad():
        torch.testing.assert_close(pipe(x[0:1]), model(x[0:1]))


def test_step_with_an_unbatched_target_covers_every_micro_batch():
    model = UNet(depth=2, base=4).eval()
    x = torch.randn(6, 3, 8, 8)
    eager = copy.deepcopy(model)
    expected = eager(x).mean()
    expected.backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2)
    loss = pipe.step(x, target=None, loss_fn=lambda out, _: out.mean())
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


def test_zero_bubble_step_after_a_failed_one_adds_no_stale_weight_gradients():
    model = TiedTransformer()
    tokens = torch.randint(0, 32, (8, 8))
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=4, schedule="zb", checkpoint="never",
                          devices=["cpu"] * 2)
    calls = []

    def failing(out, t):
        calls.append(1)
        if len(calls) == 3:  # the last stage's third forward: micro-batch 1's W is still pending
            raise RuntimeError("loss failed")
        return out.logsumexp(-1).mean()

    with pytest.raises(RuntimeError, match="loss failed"):
        pipe.step(tokens, target=tokens, loss_fn=failing)
    pipe.zero_grad(set_to_none=True)
    loss_fn = lambda out, t: out.logsumexp(-1).mean()
    eager = copy.deepcopy(model)
    loss_fn(eager(tokens), tokens).backward()
    pipe.step(tokens, target=tokens, loss_fn=loss_fn)
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_step_refuses_a_per_sample_loss_naming_the_fix(schedule):
    model = UNet(depth=2, base=4).eval()
    x = torch.randn(4, 3, 8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    per_sample = lambda out, t: F.mse_loss(out, t, reduction="none")
    with pytest.raises(fxpipe.PipelineInputError, match=r"loss_fn returned a tensor of shape \(2, 2, 8, 8\);"
                                                        r".*reduction='mean'"):
        pipe.step(x, target=torch.randn(4, 2, 8, 8), loss_fn=per_sample)
    with pytest.raises(fxpipe.PipelineInputError, match="loss_fn returned a tuple; pipe.step needs the loss alone"):
        pipe.step(x, target=torch.randn(4, 2, 8, 8), loss_fn=lambda out, t: (F.mse_loss(out, t), {"mse": 0.0}))
    with pytest.raises(fxpipe.PipelineInputError, match=r"loss_fn returned a dict;.*several losses: return their "
                                                        r"\(weighted\) sum"):
        pipe.step(x, target=torch.randn(4, 2, 8, 8),
                  loss_fn=lambda out, t: {"mse": F.mse_loss(out, t), "l1": F.l1_loss(out, t)})


def test_a_loss_failing_without_a_target_is_noted_with_where_to_pass_it():
    # forgetting target= failed in the user's loss_fn naming nothing ('NoneType' has no attribute ...)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), chunks=2, devices=["cpu"] * 2,
                          schedule="1f1b")
    with pytest.raises(fxpipe.PipelineInputError, match=r"got target=None on the rank computing the loss .*"
                                                        r"loss_fn failed on it: AttributeError: 'NoneType'"):
        pipe.step(torch.randn(4, 4), target=None, loss_fn=lambda out, y: F.mse_loss(out, y.flatten()))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved"])
def test_step_refuses_a_detached_loss_rather_than_leave_every_gradient_none(schedule):
    # 1f1b/zb/interleaved returned the loss and left every gradient None; gpipe raised torch's bare error
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    extra = {"stages_per_rank": 2} if schedule == "interleaved" else {}
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=2, devices=["cpu"] * 4,
                          schedule=schedule, **extra)
    with pytest.raises(fxpipe.PipelineInputError, match="does not require grad although the model's output does"):
        pipe.step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out, t).detach())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(fxpipe.PipelineInputError, match=r"loss_fn returned a tensor of int64, which has no gradient"):
        pipe.step(x, target=y, loss_fn=lambda out, t: (out > t).sum())  # was told it was detached
    assert all(p.grad is None for p in model.parameters())
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)  # a failed step leaves the next one as it should be
    expected = F.mse_loss(copy.deepcopy(model)(x), y)
    torch.testing.assert_close(loss, expected.detach())


def _padded_tokens():
    """Return tokens and labels whose rows have 8, 6, 1, 3, ... tokens that count (the rest -100)."""
    torch.manual_seed(0)
    tokens, labels = torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8))
    for row, keep in enumerate([8, 6, 1, 3, 8, 2, 5]):
        labels[row, keep:] = -100
    return tokens, labels


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved"])
def test_a_loss_normalised_by_the_batch_s_token_count_equals_eager_with_loss_reduction_sum(schedule):
    # cross-entropy over the tokens that count: each micro-batch's mean, weighted by rows, is not the batch's mean
    model, (tokens, labels) = TiedTransformer(), _padded_tokens()
    eager = copy.deepcopy(model)
    expected = token_loss(eager(tokens), labels)  # ignore_index=-100: the mean over the 33 tokens that count
    expected.backward()
    n = (labels != -100).sum()

    def share(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum") / n

    ranks = 2 if schedule == "interleaved" else 4
    pipe = fxpipe.compile(model, 4, example_inputs=(tokens,), chunks=3, devices=["cpu"] * 4, schedule=schedule,
                          stages_per_rank=4 // ranks)
    loss = pipe.step(tokens, target=labels, loss_fn=share, loss_reduction="sum")
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    model.zero_grad()
    with pytest.warns(UserWarning, match=r"target marks entries -100 \(ignore_index\) in unequal shares of the "
                      r"micro-batches \(44% to 69% .*Pass loss_reduction='sum'"):
        mean = pipe.step(tokens, target=labels, loss_fn=token_loss)  # the default weighting: not eager's here
    assert max_relative_error(mean, expected) > 1e-2


def test_loss_reduction_sum_keeps_a_scaler_s_scaling_and_other_reductions_are_refused():
    model, (tokens, labels) = TiedTransformer(), _padded_tokens()
    eager = copy.deepcopy(model)
    n = (labels != -100).sum()

    def share(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum") / n

    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=3, devices=["cpu"] * 2, schedule="1f1b")
    scaler = fxpipe.grad_scaler(pipe, init_scale=64.0)
    loss = pipe.step(tokens, target=labels, loss_fn=share, loss_reduction="sum", scaler=scaler)
    expected = token_loss(eager(tokens), labels)
    (expected * 64.0).backward()
    assert max_relative_error(loss, expected) < 1e-5
    assert max_relative_error(model.embed.weight.grad, eager.embed.weight.grad) < 1e-5
    with pytest.raises(ValueError, match="loss_reduction='none' is not 'mean'"):
        pipe.step(tokens, target=labels, loss_fn=share, loss_reduction="none")


def test_ignored_entries_shared_equally_or_absent_are_not_warned_of(recwarn):
    model, (tokens, _) = TiedTransformer(), _padded_tokens()
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=3, devices=["cpu"] * 2, schedule="1f1b")
    pipe.step(tokens, target=torch.randint(0, 32, (7, 8)), loss_fn=token_loss)  # no -100: checked, silent
    even = torch.randint(0, 32, (7, 8))
    even[:, 6:] = -100  # every row counts 6 of 8: each micro-batch's mean weighs as its rows
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=3, devices=["cpu"] * 2, schedule="1f1b")
    pipe.step(tokens, target=even, loss_fn=token_loss)
    assert not [w for w in recwarn if "ignore_index" in str(w.message)]


class _DictOut(nn.Module):
    """Return a dict without a loss (a model given no labels)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.b(self.a(x))}


def test_a_loss_fn_reading_a_loss_the_model_does_not_compute_is_named_not_blamed_on_target():
    pipe = fxpipe.compile(_DictOut(), 2, example_inputs=(torch.randn(4, 4),), devices=["cpu"] * 2, chunks=2)
    with pytest.raises(KeyError) as info:
        pipe.step(torch.randn(4, 4), target=None, loss_fn=lambda out, _: out["loss"])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "the model's output has no 'loss' (it holds 'logits'), which loss_fn reads" in notes
    assert "pass labels= at compile" in notes and "target=None" not in notes


def test_a_none_in_the_model_s_output_is_not_blamed_on_the_target():
    # the target=None error named the target where loss_fn read a None field of the output (no labels= given)
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return {"logits": self.b(self.a(x)), "aux": None}

    pipe = fxpipe.compile(Partial(), 2, example_inputs=(torch.randn(4, 4),), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(AttributeError) as info:
        pipe.step(torch.randn(4, 4), target=None, loss_fn=lambda out, _: out["logits"].mean() + out["aux"].mean())
    assert any("the None is the model's own output's" in n for n in info.value.__notes__)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_loss_reading_meta_tensors_is_refused_naming_the_regularizer(schedule):
    # across ranks an L2 term over model.parameters() read the other ranks' stages on meta: backward raised torch's
    # "Cannot copy out of meta tensor; no data!" (a meta tensor stands in for them here)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    elsewhere = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(fxpipe.PipelineInputError, match="loss on meta.*weight_decay="):
        pipe.step(x, target=y, loss_fn=lambda out, t: F.mse_loss(out, t) + 0.01 * elsewhere.pow(2).sum())
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)  # the failed step leaves the next one as it should be
    torch.testing.assert_close(loss, F.mse_loss(copy.deepcopy(model)(x), y).detach())


def test_an_error_in_loss_fn_is_noted_with_the_micro_batch_and_what_it_got():
    # torch's "expected scalar type Long but found Float" came alone: nothing said it came from loss_fn, nor on what
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule="1f1b")
    with pytest.raises(RuntimeError) as raised:
        pipe.step(x, target=y.float(), loss_fn=F.cross_entropy)
    assert "fxpipe: raised in loss_fn on micro-batch 0 of 2 (2 rows), given the output tensor(2, 3) float32 and the " \
           "target tensor(2,) float32" in raised.value.__notes__


@pytest.mark.parametrize("name", ["chunks", "schedule", "checkpoint"])
def test_setting_a_compile_option_on_the_pipe_names_compile(name):
    # pipe.chunks = 4 was taken and ignored (the step still ran 2 micro-batches); pipe.schedule = "1f1b" raised
    # "property 'schedule' of 'Pipe' object has no setter"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=f"pipe.{name} cannot be set: {name}= is fixed by fxpipe.compile.*Compile "
                                        f"again with {name}="):
        setattr(pipe, name, 4)
    pipe.note = "run 3"  # another attribute is still taken
    assert pipe.note == "run 3"
    model.chunks = 1  # a model attribute of that name goes to the model, as before
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=2, devices=["cpu"] * 2)
    with pytest.warns(UserWarning):
        pipe.chunks = 3
        pipe(torch.randn(4, 8))
    assert model.chunks == 3


@pytest.mark.parametrize("name", ["schedule", "devices"])
def test_a_model_attribute_named_like_an_option_the_pipe_holds_is_refused_naming_the_model(name):
    # a diffusion model's noise `schedule`: "property 'schedule' of 'Pipe' object has no setter"; a model's `devices`
    # replaced the pipe's own list of stage devices, which pipe.to() then read ("the stages run on ['cuda:0']")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    setattr(model, name, ["cpu"])
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=f"The model's own attribute '{name}' is set on the model itself: "
                                        rf"model.{name} = \['cuda:0'\]"):
        setattr(pipe, name, ["cuda:0"])
    assert getattr(model, name) == ["cpu"] and pipe.devices == [torch.device("cpu")] * 2
    pipe.to("cpu")


def test_a_model_attribute_named_like_the_pipe_s_own_is_refused_and_pipe_training_follows_the_model():
    # pipe.plan = ... replaced the pipe's plan silently (fxpipe.simulate then refused the pipe); pipe.training = False
    # was undone at the next call, which took the model's flag
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model.plan = "cosine"
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=2, devices=["cpu"] * 2)
    plan = pipe.plan
    with pytest.raises(TypeError, match=r"pipe.plan is the pipe's own, .*set it on the model itself "
                                        r"\(model.plan = 'linear'\)"):
        pipe.plan = "linear"
    assert pipe.plan is plan and model.plan == "cosine"
    pipe.training = False
    assert model.training is False and pipe.training is False and not any(s.training for s in pipe.stages)
