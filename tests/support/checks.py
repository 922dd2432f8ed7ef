"""Checks the tests share."""

import torch


def assert_equal_to_eager(results):
    """Assert every rank's loss and held gradients equal eager's (relative 1e-5)."""
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5, (r, res["loss_error"])
        assert res["grad_errors"], f"rank {r} holds no parameters"
        worst = max(res["grad_errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (r, worst)


def assert_state_equal(model, opt, params, optim):
    """The model's parameters and the optimizer's state equal the saved ones, bitwise."""
    names = {id(p): n for n, p in model.named_parameters()}
    for name, value in params.items():
        assert torch.equal(model.state_dict()[name], value), name
    state = {names[id(p)]: s for p, s in opt.state.items()}
    for name, saved in optim.items():
        for key, value in saved.items():
            assert torch.equal(state[name][key], value), (name, key)


def assert_step_equals_eager(pipe, model, eager, inputs, target, loss_fn):
    """Assert one ``pipe.step`` on ``inputs`` gives eager's loss and every parameter's gradient (``eager`` a copy)."""
    loss = pipe.step(inputs, target=target, loss_fn=loss_fn)
    ref = loss_fn(eager(inputs), target)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
