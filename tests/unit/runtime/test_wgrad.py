"""Deferred weight gradients: B leaves the linears' weight gradients for W, which adds them."""

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.stage import wgrad


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.randn(5, 8))
        self.n = nn.LayerNorm(5)

    def forward(self, x):
        return self.n(F.linear(torch.tanh(self.a(x)), self.w))


def _autograd_grads(model, x):
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    return xr.grad, {k: p.grad for k, p in ref.named_parameters()}


def test_rewrite_calls_the_deferring_linear_for_modules_and_functions():
    gm = torch.fx.symbolic_trace(TwoLinears())
    deferred = wgrad.defer_weight_grads(gm)
    targets = [n.target for n in deferred.graph.nodes if n.op in ("call_function", "call_module")]
    assert targets.count(wgrad.linear) == 2 and "a" not in targets and F.linear not in targets
    x = torch.randn(3, 6)
    torch.testing.assert_close(deferred(x), gm(x))
    assert deferred.get_parameter("a.weight") is gm.get_parameter("a.weight")  # shared, not copied


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)])
def test_backward_defers_weight_grads_until_run(shape):
    model = TwoLinears()
    x = torch.randn(*shape)
    x_grad, grads = _autograd_grads(model, x)
    deferred = wgrad.defer_weight_grads(torch.fx.symbolic_trace(model))
    store: list = []
    xd = x.clone().requires_grad_()
    with wgrad.collecting(store):
        out = deferred(xd)
    out.pow(2).sum().backward()
    torch.testing.assert_close(xd.grad, x_grad)  # B: input gradients are complete
    assert model.a.weight.grad is None and model.a.bias.grad is None and model.w.grad is None
    assert model.n.weight.grad is not None  # other layers keep their gradients in B
    assert len(store) == 2
    wgrad.run(store)  # W
    assert store == []
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_a_second_micro_batch_accumulates_in_place():
    model = TwoLinears()
    x = torch.randn(4, 6)
    _, grads = _autograd_grads(model, x)
    deferred = wgrad.defer_weight_grads(torch.fx.symbolic_trace(model))
    for _ in range(2):
        store: list = []
        with wgrad.collecting(store):
            out = deferred(x)
        out.pow(2).sum().backward()
        before = model.a.weight.grad
        wgrad.run(store)
    assert model.a.weight.grad is before  # the GEMM added into the existing tensor
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * grads[name], msg=name)


def test_without_a_store_or_grad_it_is_plain_linear():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert wgrad.linear(x, lin.weight, lin.bias).grad_fn.name() == "AddmmBackward0"
    store: list = []
    with wgrad.collecting(store), torch.no_grad():
        assert wgrad.linear(x, lin.weight, lin.bias).grad_fn is None
    assert store == []


def test_a_weight_that_is_not_a_leaf_keeps_its_gradient_in_backward():
    lin = nn.Linear(3, 2)
    store: list = []
    with wgrad.collecting(store):
        out = wgrad.linear(torch.randn(4, 3), lin.weight * 2, lin.bias)
    out.sum().backward()
    assert store == [] and lin.weight.grad is not None and lin.bias.grad is not None


def test_a_weight_with_gradient_hooks_keeps_its_gradient_in_backward_where_the_hooks_run():
    lin, x, seen = nn.Linear(3, 2), torch.randn(4, 3, requires_grad=True), []
    eager = copy.deepcopy(lin)
    for m in (lin, eager):
        m.weight.register_hook(lambda g: g * 0.5)
    lin.bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    store: list = []
    with wgrad.collecting(store):
        out = wgrad.linear(x, lin.weight, lin.bias)
    out.sum().backward()
    F.linear(x, eager.weight, eager.bias).sum().backward()
    assert store == [] and len(seen) == 1
    assert torch.equal(lin.weight.grad, eager.weight.grad) and torch.equal(lin.bias.grad, eager.bias.grad)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_zero_bubble_runs_a_later_stage_s_parameter_hooks_as_eager_does(tracer):
    # before: the deferred W added their gradients directly: a scaling hook never ran (2x eager's), silently
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    eager = copy.deepcopy(model)
    for m in (model, eager):
        for p in m.parameters():
            p.register_hook(lambda g: g * 0.5)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", devices=["cpu"] * 2,
                          tracer=tracer)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    F.mse_loss(eager(x), y).backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, p.grad, msg=name)


def test_exported_stages_defer_too():
    import fxpipe

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    F.mse_loss(eager(x), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule="zb", tracer="export")
    runtime_graph = wgrad.defer_weight_grads(pipe.stages[0]).graph
    assert [n.target for n in runtime_graph.nodes].count(wgrad.linear) == 1  # aten.linear, rewritten
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_weight_shared_with_a_sparse_embedding_gets_both_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    tokens = torch.tensor([[1, 2, 3], [3, 4, 1]])
    ref = copy.deepcopy(emb)
    F.linear(ref(tokens), ref.weight).sum().backward()
    store: list = []
    with wgrad.collecting(store):
        out = wgrad.linear(emb(tokens), emb.weight)
    out.sum().backward()
    assert emb.weight.grad.is_sparse  # the embedding's part, from B
    wgrad.run(store)
    torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())


def _deferred_grads(fn, hooks=False, shape=(4, 6)):
    """Run ``fn(linear)`` with weight gradients deferred (under saved-tensor hooks if asked); return grads."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    lin = nn.Linear(6, 6)
    store: list = []
    saved = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else torch.enable_grad()
    with wgrad.collecting(store), saved:
        out = fn(lambda h: wgrad.linear(h, lin.weight, lin.bias), x)
    out.pow(2).sum().backward()
    wgrad.run(store)
    return [x.grad, lin.weight.grad, lin.bias.grad]


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)])
@pytest.mark.parametrize("write", ["relu_", "slice"])
def test_both_ways_of_deferring_equal_autograd_with_a_later_in_place_on_the_output(hooks, shape, write):
    # a 3-D input: F.linear's output is a view, and an in-place op on it rebased its history past the output hook,
    # which never fired: the weight's gradient stayed None (Wav2Vec2's h[~mask] = 0 under zb and zbv)
    def fn(linear, x):
        y = linear(x)
        if write == "relu_":
            y.relu_()  # in place on the output: the queued gradient is still the output's before it
        else:
            y[..., :2] = 0
        return linear(y * 2)

    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    lin = nn.Linear(6, 6)
    fn(lin, x).pow(2).sum().backward()
    for got, want in zip(_deferred_grads(fn, hooks, shape), [x.grad, lin.weight.grad, lin.bias.grad]):
        torch.testing.assert_close(got, want)


def test_a_plain_linear_queues_through_an_output_hook_and_hooks_see_its_input_saved():
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)
    packed = []
    with wgrad.collecting([]):
        plain = wgrad.linear(x, lin.weight, lin.bias)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            under_hooks = wgrad.linear(x, lin.weight, lin.bias)
    assert "_Linear" not in type(plain.grad_fn).__name__  # autograd's own node: no Python function per linear
    assert "_Linear" in type(under_hooks.grad_fn).__name__  # selective recomputation and offload must see x
    assert any(t is x or t.data_ptr() == x.data_ptr() for t in packed)


def test_an_input_modified_in_place_after_a_deferred_linear_is_refused_as_autograd_would():
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)
    store: list = []
    with wgrad.collecting(store):
        h = x * 1
        y = wgrad.linear(h, lin.weight, lin.bias)
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified in place after the linear ran"):
        y.sum().backward()


def test_a_deferred_linear_of_a_3d_input_without_grad_may_be_written_in_place():
    # Swinv2's position-bias MLP: a linear over a buffer, then ReLU(inplace=True); the output of
    # F.linear on a 3-D input is a view, which autograd refuses to write when made inside a Function
    lin, table = nn.Linear(2, 6), torch.randn(3, 3, 2)
    store = []
    with wgrad.collecting(store):
        y = wgrad.linear(table, lin.weight, lin.bias)
        y.relu_()
    y.sum().backward()
    wgrad.run(store)
    ref = nn.Linear(2, 6)
    ref.load_state_dict(lin.state_dict())
    F.relu(ref(table), inplace=True).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def _hook_case(schedule="zb"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 4))
    return model, torch.randn(8, 8), torch.randn(8, 4)


def test_a_hooked_linear_runs_its_hooks_under_zero_bubble():
    # zero bubble called the linear's function in the module's place: its hooks never ran (loss 1.131 for 1.151)
    model, x, y = _hook_case()
    calls = []
    model[2].register_forward_hook(lambda mod, inp, out: calls.append(1) or out * 0.5)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", devices=["cpu"] * 2)
    loss = pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    assert len(calls) >= 4  # once per micro-batch (and per recomputation)
    expected = torch.nn.functional.mse_loss(eager(x), y)
    expected.backward()
    assert abs(loss - expected) < 1e-6
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


@pytest.mark.parametrize("added", ["hook", "parametrization"])
def test_a_hook_or_parametrization_added_after_compile_on_a_deferred_linear_is_refused(added):
    model, x, y = _hook_case()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", devices=["cpu"] * 2)
    if added == "hook":
        model[2].register_forward_hook(lambda mod, inp, out: out * 0.5)
    else:
        torch.nn.utils.parametrizations.weight_norm(model[2])
    with pytest.raises(fxpipe.PipelineInputError, match=r"module '\d' \(stage \d\) got .* after the pipe was compiled.*"
                                                        r"Register hooks and parametrizations before fxpipe.compile"):
        pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)


class _InPlaceAfterLinear(nn.Module):
    """Residual blocks whose linear output (of a 3-D input) is written in place, as HF's masked encoders do."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            u = block(torch.tanh(x))
            u[:, :, :4] = 0
            x = x + F.relu(u, inplace=True)
        return self.head(x).mean(1)


@pytest.mark.parametrize("schedule, n_stages, per_rank", [("zb", 3, 1), ("zbv", 4, 2)])
def test_every_weight_of_a_stage_deferring_its_gradients_gets_one_after_an_in_place_write(schedule, n_stages, per_rank):
    torch.manual_seed(0)
    model = _InPlaceAfterLinear()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 5, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(model, n_stages, example_inputs=(x,), chunks=2, schedule=schedule, stages_per_rank=per_rank,
                          devices=["cpu"] * n_stages)
    pipe.step(x, target=y, loss_fn=F.cross_entropy)
    F.cross_entropy(eager(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name  # was None, silently: the optimizer never moved it
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_zero_bubble_runs_a_linear_whose_forward_was_replaced_on_the_instance():
    # W's own linear() took the Linear's place and skipped the instance's forward (loss 5.7%, gradients 73% off)
    import types

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model[2].forward = types.MethodType(lambda self, h: F.linear(h, self.weight, self.bias) * 2, model[2])
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule="zb", devices=["cpu"] * 2)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expect = sum(F.mse_loss(eager(xc), yc) / 2 for xc, yc in zip(x.chunk(2), y.chunk(2)))
    expect.backward()
    torch.testing.assert_close(loss, expect.detach())
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
