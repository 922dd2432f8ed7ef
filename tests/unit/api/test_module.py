"""The Pipe behaves like the model: names, state_dict, gradients in the model's Parameters, modes."""

import copy

import pytest
import torch
from models import CNN, TiedTransformer
from torch import nn

import fxpipe


def _pipe(model, n=3):
    return fxpipe.compile(model, n, example_inputs=(torch.randn(4, 3, 8, 8),), devices=["cpu"] * n, chunks=2)


def test_names_match_the_model():
    model = CNN()
    pipe = _pipe(model)
    assert list(pipe.state_dict().keys()) == list(model.state_dict().keys())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p is q for p, q in zip(pipe.parameters(), model.parameters()))


def test_tied_state_dict_keys():
    model = TiedTransformer()
    pipe = fxpipe.compile(model, 3, example_inputs=(torch.randint(0, 32, (2, 8)),), devices=["cpu"] * 3)
    assert list(pipe.state_dict().keys()) == list(model.state_dict().keys())


def test_load_state_dict_reaches_every_stage():
    model, other = CNN().eval(), CNN().eval()
    pipe = _pipe(model)
    x = torch.randn(4, 3, 8, 8)
    pipe.load_state_dict(other.state_dict())
    torch.testing.assert_close(pipe(x), other(x))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_a_state_dict_saved_from_a_wrapper_is_refused_naming_the_prefix(prefix):
    # torch's bare "Missing key(s) ... Unexpected key(s)" said nothing of DDP's or torch.compile's prefix
    model, other = CNN().eval(), CNN().eval()
    pipe = _pipe(model)
    wrapped = {prefix + k: v for k, v in other.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"keys start with '{prefix}'.*strip the prefix, "
                                           rf"\{{k.removeprefix\('{prefix}'\)"):
        pipe.load_state_dict(wrapped)
    pipe.load_state_dict({k.removeprefix(prefix): v for k, v in wrapped.items()})
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(pipe(x), other(x))


def test_gradients_land_in_model_parameters():
    model = CNN().eval()
    pipe = _pipe(model)
    pipe(torch.randn(4, 3, 8, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_train_and_eval_propagate():
    model = CNN()
    pipe = _pipe(model)
    pipe.eval()
    assert not model.training and not any(m.training for m in model.modules())
    assert not any(s.training for s in pipe.stages)
    pipe.train()
    assert model.training and all(s.training for s in pipe.stages)
    assert all(m.training for m in model.modules())


def test_compile_accepts_a_traced_graph_module():
    model = CNN().eval()
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    x = torch.randn(4, 3, 8, 8)
    expected = gm(x)
    pipe = fxpipe.compile(gm, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2)
    torch.testing.assert_close(pipe(x), expected)
    assert list(pipe.state_dict()) == list(gm.state_dict())


def test_compile_accepts_torch_export_module():
    model = CNN().eval()
    x = torch.randn(4, 3, 8, 8)
    # micro-batches change the batch size, so dim 0 must be exported as dynamic
    batch = torch.export.Dim("batch", min=1)
    gm = torch.export.export(copy.deepcopy(model), (x,), dynamic_shapes={"x": {0: batch}}).module()
    pipe = fxpipe.compile(gm, 3, example_inputs=(x,), devices=["cpu"] * 3, chunks=2)
    torch.testing.assert_close(pipe(x), model(x))
    out = pipe(x)
    out.sum().backward()
    assert all(p.grad is not None for p in gm.parameters())


def test_trace_returns_named_nodes_without_modifying_model():
    model = CNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fxpipe.trace(model)
    assert isinstance(gm, torch.fx.GraphModule)
    names = [n.name for n in gm.graph.nodes]
    assert names[0] == "x" and names[-1] == "output"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


class _Direct(nn.Module):
    """Reads a parameter and a buffer directly in forward (fx: get_attr), as a gain or a shift does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return self.b(self.a(x) * self.gain + self.shift)


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_load_state_dict_with_assign_reaches_every_stage(schedule):
    # assign=True replaced the model's tensors; the stages kept the old ones (zb: every linear's), silently
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = fxpipe.compile(_Direct(), 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule)
    new = _Direct()
    with torch.no_grad():
        new.gain.fill_(3.0), new.shift.fill_(1.0)
    pipe.load_state_dict(new.state_dict(), assign=True)
    with torch.no_grad():
        assert torch.allclose(pipe(x), new(x))
    loss = pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(new(x), y)
    expected.backward()
    assert abs(loss - expected) < 1e-6
    for name, p in pipe.named_parameters():
        assert p.grad is not None and torch.allclose(p.grad, new.get_parameter(name).grad, atol=1e-6), name


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_a_parameter_replaced_on_the_model_is_followed(schedule, tracer):
    # the model's own load_state_dict(assign=True), or a new Parameter set on it: the stages kept reading the
    # old tensors they fetch (a parameter used directly; under zb every linear's weight), and the old got the
    # gradient, silently; only pipe.load_state_dict pointed them at the new ones
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    model = _Direct()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule=schedule,
                          tracer=tracer)
    new = _Direct()
    with torch.no_grad():
        new.gain.fill_(3.0), new.shift.fill_(1.0)
    model.load_state_dict(new.state_dict(), assign=True)
    model.a.weight = nn.Parameter(new.a.weight.detach() * 2)
    new.a.weight = nn.Parameter(new.a.weight.detach() * 2)
    loss = pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(new(x), y)
    expected.backward()
    assert abs(loss - expected) < 1e-6
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.allclose(p.grad, new.get_parameter(name).grad, atol=1e-6), name


def test_a_cast_after_compile_reaches_every_stage_and_a_move_is_refused():
    # pipe.double() left a buffer read in forward at float32 in its stage; bfloat16 then failed in a stage
    torch.manual_seed(0)
    model, x = _Direct(), torch.randn(8, 4)
    eager = copy.deepcopy(model).to(torch.bfloat16)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    pipe.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(pipe(x.bfloat16()), eager(x.bfloat16()))
    with pytest.raises(TypeError, match=r"pipe.to\('meta'\) would move every stage onto one device.*pass devices="):
        pipe.to("meta")


def test_an_exported_pipe_refuses_a_cast_naming_the_fix():
    # the cast went through, then a bfloat16 input was refused and a float32 one failed inside a stage
    model, x = _Direct(), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, tracer="export")
    with pytest.raises(TypeError, match=r"exported pipe cannot be cast to torch.bfloat16.*before fxpipe.compile"):
        pipe.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"cannot be cast to torch.float64"):
        pipe.double()
    pipe.float()  # no dtype changes: a no-op, as before
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


class _ReadsMode(nn.Module):
    """Reads self.training in its own code (merged graph: the stage's flag) beside a batch norm module."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.bn(self.a(x)), 0.5, training=self.training)
        return self.b(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_model_eval_on_the_model_puts_the_whole_pipe_in_eval_mode(tracer):
    # the batch norm (shared) followed model.eval(), the dropout the graph reads did not: outputs random, 0.75 off
    torch.manual_seed(0)
    model, x = _ReadsMode().train(), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(pipe(x), model(x), atol=1e-6) and torch.equal(pipe(x), pipe(x))
    assert not pipe.training
    model.train()
    with torch.no_grad():
        assert not torch.equal(pipe(x), pipe(x))  # dropout on again


def test_a_pipe_is_copied_but_not_pickled():
    # torch.save(pipe) wrote a file torch.load could not read back (the tracer is not rebuildable)
    import io
    import pickle

    torch.manual_seed(0)
    model, x, y = _Direct(), torch.randn(8, 4), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule="zb")
    with pytest.raises(TypeError, match=r"a Pipe cannot be pickled .* fxpipe.save\(pipe, path\)"):
        torch.save(pipe, io.BytesIO())
    with pytest.raises(TypeError, match="a Pipe cannot be pickled"):
        pickle.dumps(pipe)
    twin = copy.deepcopy(pipe)
    twin.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    assert all(p.grad is None for p in pipe.parameters()) and all(p.grad is not None for p in twin.parameters())
    pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    for p, q in zip(pipe.parameters(), twin.parameters()):
        assert p is not q and torch.equal(p.grad, q.grad)
