"""Training numerics around pipe.step: autocast on every stage, loss scaling, clipping, accumulation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import TiedTransformer

import fxpipe
from fxpipe.testing import max_relative_error


def _loss(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


def _data():
    torch.manual_seed(0)
    return TiedTransformer(), torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))


def _grad_error(model, eager):
    grads = dict(eager.named_parameters())
    return max(max_relative_error(p.grad, grads[n].grad) for n, p in model.named_parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_autocast_around_step_reaches_every_stage_and_recomputation(schedule):
    model, tokens, target = _data()
    eager, float32 = copy.deepcopy(model), copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=1, schedule=schedule, checkpoint="always",
                          devices=["cpu"] * 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(tokens, target=target, loss_fn=_loss)
        expected = _loss(eager(tokens), target)
    expected.backward()
    _loss(float32(tokens), target).backward()
    assert max_relative_error(loss, expected) < 1e-6 and _grad_error(model, eager) < 1e-6
    assert _grad_error(model, float32) > 1e-3  # bfloat16 really ran


def test_recomputation_outside_autocast_replays_the_forward_s_autocast():
    model, tokens, target = _data()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=1, checkpoint="always", devices=["cpu"] * 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pipe(tokens), eager(tokens)
    _loss(out, target).backward()  # recomputes outside the autocast block
    _loss(expected, target).backward()
    assert _grad_error(model, eager) < 1e-6


def test_worker_threads_carry_autocast(monkeypatch):
    from fxpipe.runtime.local import LocalRuntime

    init = LocalRuntime.__init__
    monkeypatch.setattr(LocalRuntime, "__init__", lambda self, *a, **k: (init(self, *a, **k), self.use_threads(True))[0])
    model, tokens, target = _data()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=1, schedule="1f1b", devices=["cpu", "cpu:0"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(tokens, target=target, loss_fn=_loss)
        expected = _loss(eager(tokens), target)
    expected.backward()
    assert pipe._runtime.threads is not None and _grad_error(model, eager) < 1e-6


def test_bfloat16_parameters():
    model, tokens, target = _data()
    model = model.to(torch.bfloat16)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=1, schedule="zb", devices=["cpu"] * 3)
    loss = pipe.step(tokens, target=target, loss_fn=_loss)
    expected = _loss(eager(tokens), target)
    expected.backward()
    assert model.embed.weight.grad.dtype == torch.bfloat16
    assert max_relative_error(loss, expected) < 1e-6 and _grad_error(model, eager) < 1e-6


def test_a_scaler_scales_the_loss_once():
    model, tokens, target = _data()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens,), chunks=2, schedule="1f1b", devices=["cpu"] * 3)
    scaler = fxpipe.grad_scaler(pipe, init_scale=256.0)
    assert isinstance(scaler, torch.amp.GradScaler)
    loss = pipe.step(tokens, target=target, loss_fn=_loss, scaler=scaler)
    expected = _loss(eager(tokens), target)
    (expected * 256.0).backward()  # every stage's gradients scaled once
    assert max_relative_error(loss, expected) < 1e-6 and _grad_error(model, eager) < 1e-5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.step(opt)  # unscales, finds no inf, steps
    scaler.update()
    assert scaler.get_scale() == 256.0


def test_clipping_and_accumulation_in_one_process():
    model, tokens, target = _data()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(tokens[:4],), chunks=2, schedule="zb", devices=["cpu"] * 3)
    with pipe.no_sync():  # nothing to reduce in one process: gradients just accumulate
        pipe.step(tokens[:4], target=target[:4], loss_fn=_loss)
    pipe.step(tokens[4:], target=target[4:], loss_fn=_loss)
    _loss(eager(tokens[:4]), target[:4]).backward()
    _loss(eager(tokens[4:]), target[4:]).backward()
    assert _grad_error(model, eager) < 1e-5
    norm = fxpipe.clip_grad_norm_(pipe, 0.1, foreach=False)  # torch's keyword, as a ported call passes it
    assert max_relative_error(norm, torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)) < 1e-5
    assert _grad_error(model, eager) < 1e-5


def test_clipping_and_scaling_refuse_a_model_that_is_not_a_pipe():
    model = TiedTransformer()
    with pytest.raises(TypeError, match="fxpipe.clip_grad_norm_ takes the Pipe that fxpipe.compile returned, got "
                                        "GPT; .* use torch.nn.utils.clip_grad_norm_"):
        fxpipe.clip_grad_norm_(model, 1.0)
    with pytest.raises(TypeError, match="fxpipe.grad_scaler takes the Pipe .* use torch.amp.GradScaler"):
        fxpipe.grad_scaler(model)
