"""Forward signatures (``*args``, ``**kwargs``, tensor defaults, fixed inputs) and tracer options at the front end."""

import copy

import pytest
import torch
from torch import nn

import fxpipe


class Variadic(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, *args, **kwargs):
        h = self.b(self.a(x)) + args[0] * kwargs["w"]
        return h * 2 if self.training else h


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_star_args_and_star_star_kwargs_bind_and_train_like_eager(tracer):
    # fx's Interpreter gave the '**kwargs' placeholder a list of the inputs left: compile failed with
    # "'list' object has no attribute 'get'", and a call with a keyword was refused as unexpected
    # although the model's inputs were listed as ['x', '**kwargs']
    torch.manual_seed(0)
    x, z, w = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    model = Variadic()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, z), example_kwargs={"w": w}, chunks=3, tracer=tracer)
    loss = pipe.step(x, z, w=w, target=None, loss_fn=lambda out, _: out.pow(2).mean())
    expected = eager(x, z, w=w).pow(2).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(pipe.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    pipe.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, z, w=w), eager(x, z, w=w))


def test_an_unused_star_star_kwargs_takes_no_keywords():
    class Ignoring(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, **kwargs):
            return self.b(self.a(x))

    model = Ignoring()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2)
    torch.testing.assert_close(pipe(x), model(x))


class _TensorDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, w=torch.tensor(2.0)):
        return self.b(self.a(x)) * w


def test_a_tensor_default_is_refused_under_fx_naming_it_and_traced_by_export():
    # fx failed with a bare "NameError: name '_tensor_constant0' is not defined"
    x = torch.randn(6, 4)
    with pytest.raises(fxpipe.TraceError, match=r"argument 'w' has a tensor default.*tracer='export'"):
        fxpipe.compile(_TensorDefault(), 2, example_inputs=(x,), chunks=2)
    model = _TensorDefault()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, tracer="export")
    torch.testing.assert_close(pipe(x), model(x))


class _Flags(nn.Module):
    """Branch on a flag and on an input left at its None default, as Hugging Face and diffusers models do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.labels_head = None

    def forward(self, x, labels=None, return_dict=True):
        h = self.b(torch.relu(self.a(x)))
        if labels is not None and self.labels_head is None:
            raise ValueError("labels_head needs to be set to use labels")
        return {"y": h} if return_dict else (h,)


def test_an_input_fixed_by_concrete_args_is_named_when_given_another_value():
    # it was refused as an unexpected keyword, the inputs listed as ['x', 'mask', 'return_dict_1']
    x = torch.randn(4, 4)
    model = _Flags()
    pipe = fxpipe.compile(fxpipe.trace(model, concrete_args={"labels": None, "return_dict": True}), 2,
                          example_inputs=(x,), chunks=2)
    torch.testing.assert_close(pipe(x, return_dict=True)["y"], model(x)["y"])
    with pytest.raises(TypeError, match=r"return_dict= was fixed to True when the model was traced"):
        pipe(x, return_dict=False)


def test_a_flag_and_a_none_default_are_fixed_where_fx_cannot_trace_them_as_inputs():
    # fx traced both as tensors: "symbolically traced variables cannot be used as inputs to control flow", and the
    # model's own raise for labels (a Proxy is not None)
    x = torch.randn(4, 4)
    model = _Flags()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"return_dict": False}, chunks=2)
    torch.testing.assert_close(pipe(x, return_dict=False)[0], model(x, return_dict=False)[0])
    with pytest.raises(TypeError, match=r"return_dict= was fixed to False when the model was traced.*tracer='fx'"):
        pipe(x, return_dict=True)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2)
    torch.testing.assert_close(pipe(x)["y"], model(x)["y"])


class _Mode(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, mode="sum"):
        h = self.a(x)
        return h.sum(-1) if mode == "sum" else h.mean(-1)


def test_an_input_fixed_to_its_example_s_value_is_refused_left_out_or_given_another_by_position():
    # left out, the pipe ran the example's "mean" where eager runs the default "sum" (0.92 apart), silently; "sum"
    # by position raised torch.fx's bare "mode has been specialized to have value mean"
    x = torch.randn(4, 4)
    model = _Mode()
    pipe = fxpipe.compile(model, 2, example_inputs=(x, "mean"), chunks=2)
    torch.testing.assert_close(pipe(x, "mean"), model(x, "mean"))
    with pytest.raises(TypeError, match=r"mode= was fixed to 'mean' .*leaves it at forward's default 'sum'"):
        pipe(x)
    with pytest.raises(TypeError, match=r"mode= was fixed to 'mean' .*takes no other mode=: pass 'mean', compile"):
        pipe(x, "sum")  # not "or leave it out", which is refused above


def test_fixed_inputs_leave_no_guard_for_the_balancer_to_place():
    # the guards (eq, _assert) of return_dict_1 were read by nothing and ended in the last stage across ranks, where
    # the balancer cut before them: every layer on rank 0
    gm = fxpipe.trace(_Flags(), concrete_args={"labels": None, "return_dict": False})
    assert [n.op for n in gm.graph.nodes if n.op == "call_function" and "assert" in str(n.target)] == []
    fixed = {n.target: n.meta.get("fxpipe.fixed") for n in gm.graph.nodes if n.op == "placeholder"}
    assert fixed == {"x": None, "labels_1": None, "return_dict_1": False}


def test_concrete_args_other_than_the_default_bind_the_value_fixed():
    # the placeholder's default (True) was bound, and the graph's guard failed: "return_dict has been specialized to
    # have value False but got another value"; given False, the refusal said it was fixed to True
    x = torch.randn(4, 4)
    model = _Flags()
    gm = fxpipe.trace(model, concrete_args={"labels": None, "return_dict": False})
    pipe = fxpipe.compile(gm, 2, example_inputs=(x,), chunks=2)
    torch.testing.assert_close(pipe(x)[0], model(x, return_dict=False)[0])
    torch.testing.assert_close(pipe(x, return_dict=False)[0], model(x, return_dict=False)[0])
    with pytest.raises(TypeError, match=r"return_dict= was fixed to False"):
        pipe(x, return_dict=True)


class _Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, *rest):
        h = self.a(x)
        for r in rest:
            h = h + r
        return self.b(h)


def test_a_loop_over_star_args_under_fx_names_export():
    # the refusal said to move "the data-dependent part" into a leaf or to fix an input with concrete_args=
    x = torch.randn(4, 4)
    with pytest.raises(fxpipe.TraceError, match=r"forward takes \*args or \*\*kwargs.*a loop over them.*"
                                                r"tracer='export'"):
        fxpipe.compile(_Looped(), 2, example_inputs=(x, x, x), chunks=2)
    model = _Looped()
    pipe = fxpipe.compile(model, 2, example_inputs=(x, x, x), chunks=2, tracer="export")
    torch.testing.assert_close(pipe(x, x, x), model(x, x, x))


def test_leaf_modules_under_export_are_said_to_be_ignored():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"leaf_modules=\['0'\] is ignored under tracer='export'"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), tracer="export", leaf_modules=["0"])


class _KeywordOnly(nn.Module):
    """Take a scale by keyword only."""

    def __init__(self):
        super().__init__()
        self.a, self.o = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, *, scale):
        return self.o(torch.tanh(self.a(x) * scale))


def test_a_keyword_only_input_is_bound_by_keyword_only_as_eager_binds_it():
    # pipe(x, scale) ran, where eager raises "takes 2 positional arguments but 3 were given"
    model = _KeywordOnly()
    x, scale = torch.randn(6, 8), torch.rand(6, 1)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"scale": scale}, chunks=3, devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, scale=scale), model(x, scale=scale))
        with pytest.raises(TypeError, match=r"keyword-only input 'scale': pass it as the keyword scale=\.\.\."):
            pipe(x, scale)


class _KeywordFlag(nn.Module):
    """Take a keyword-only flag that fx fixes (the plain trace fails on it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, *, return_dict=True):
        h = self.b(torch.relu(self.a(x)))
        return {"y": h} if return_dict else (h,)


def test_a_keyword_only_flag_fx_fixed_is_still_keyword_only():
    # torch.fx names the fixed placeholder return_dict_1, which was not marked keyword-only: pipe(x, False) ran where
    # eager raises "takes 2 positional arguments but 3 were given", and pipe(x, True) was refused as fixed
    model, x = _KeywordFlag(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), example_kwargs={"return_dict": False}, chunks=2)
    torch.testing.assert_close(pipe(x, return_dict=False)[0], model(x, return_dict=False)[0])
    for flag in (False, True):
        with pytest.raises(TypeError, match=r"1 input\(s\) positionally but 2 were given; \['return_dict'\] is "
                                            r"keyword-only: pass return_dict=\.\.\."):
            pipe(x, flag)
