"""A forward reading self.training: both modes' graphs merged into one that follows pipe.train()/pipe.eval()."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.modes import merge_modes


class DropPath(nn.Module):
    """Stochastic depth written as Python on self.training, as timm's and torchvision's are."""

    def forward(self, x):
        if not self.training:
            return x
        keep = (torch.rand_like(x[:, :1]) > 0.5).to(x.dtype)
        return x * keep * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b, self.c = nn.Linear(8, 8), DropPath(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = self.b(h + self.drop(h))
        h = F.dropout(h, 0.3, training=self.training)  # the mode as an argument
        return self.c(h.relu() if self.training else h.tanh())  # a method of each mode


class Aux(nn.Module):
    """An auxiliary head (two modules) called only in training, as Inception's is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.aux = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + self.aux(h) if self.training else self.b(h)


class _DropBase(nn.Module):
    def forward(self, x):
        return x * 2.0 if self.training else x


class _Inherited(_DropBase):
    """Reads the mode in the forward it inherits: its own source does not mention it."""


class _MyDropout(nn.Dropout):
    """A user's subclass of torch's dropout: fx traces through it (its module is not torch.nn)."""


class _MyBatchNorm(nn.BatchNorm1d):
    """A user's subclass of torch's batch norm."""


def _modes(pipe, eager, x, modes):
    """Run pipe and eager through ``modes`` with equal random numbers; assert equal outputs."""
    for mode in modes:
        pipe.train(mode)
        eager.train(mode)
        torch.manual_seed(mode)
        got = pipe(x)
        torch.manual_seed(mode)
        torch.testing.assert_close(got, eager(x))


def _own_tracer(model):
    """A user's tracer (as timm's and Hugging Face's are): plain torch.fx."""
    return torch.fx.GraphModule(model, torch.fx.Tracer().trace(model))


@pytest.mark.parametrize("tracer", ["fx", "export", "callable"])
@pytest.mark.parametrize("start", [True, False], ids=["compiled-training", "compiled-eval"])
def test_a_pipe_follows_train_and_eval_as_eager_does(tracer, start):
    torch.manual_seed(0)
    model, x = Net().train(start), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), devices=["cpu"] * 3,
                          tracer=_own_tracer if tracer == "callable" else tracer)
    assert "fxpipe.training" not in pipe._gm.meta
    _modes(pipe, eager, x, [start, not start, start])


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_training_steps_after_an_evaluation_equal_eager(schedule, checkpoint):
    torch.manual_seed(0)
    model, x, target = Net().eval(), torch.randn(8, 8), torch.randn(8, 8)
    eager = copy.deepcopy(model).train()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=1, devices=["cpu"] * 2, schedule=schedule,
                          checkpoint=checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), copy.deepcopy(eager).eval()(x))
    pipe.train()
    torch.manual_seed(3)
    loss = pipe.step(x, target=target, loss_fn=F.mse_loss)
    torch.manual_seed(3)
    expected = F.mse_loss(eager(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_an_exported_batch_norm_follows_the_mode_and_counts_only_training_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 8)).eval()
    eager, x = copy.deepcopy(model), torch.randn(6, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, tracer="export")
    _modes(pipe, eager, x, [False, True, False, True])
    assert model[1].num_batches_tracked.item() == eager[1].num_batches_tracked.item() == 2
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean)


def test_the_merged_graph_keeps_the_node_names_and_reads_the_stage_mode():
    gm = fxpipe.trace(Net().train())
    code = gm.code
    assert "training = self.training" in code and "training_only_mul" in code and "eval_only_tanh" in code
    assert {"a", "b", "c", "add", "dropout"} <= {n.name for n in gm.graph.nodes}


@pytest.mark.parametrize("start", [True, False], ids=["compiled-training", "compiled-eval"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_module_called_in_one_mode_only_runs_only_in_that_mode(schedule, start):
    torch.manual_seed(0)
    model, x = Aux().train(start), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, devices=["cpu"] * 3, schedule=schedule)
    _modes(pipe, eager, x, [not start, start])
    pipe.train()
    eager.train()
    loss = pipe.step(x, target=x, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), x)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert {k for s in pipe.stages for k in s.state_dict()} >= {"aux.0.weight", "aux.2.bias"}


class _AuxNorm(nn.Module):
    """An auxiliary head holding a batch norm, as GoogLeNet's does."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.aux = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4, momentum=momentum))

    def forward(self, x):
        h = self.a(x).relu()
        return self.b(h) + self.aux(h).mean(1, keepdim=True) if self.training else self.b(h)


@pytest.mark.parametrize("checkpoint", ["except_last", "selective"])
@pytest.mark.parametrize("tracer, momentum", [("fx", None), ("export", 0.1)])  # export cannot trace None's .item()
def test_compiling_leaves_the_buffers_of_a_head_of_one_mode_as_they_were(tracer, momentum, checkpoint):
    torch.manual_seed(0)
    model, x = _AuxNorm(momentum).train(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule="1f1b",
                          tracer=tracer, checkpoint=checkpoint)
    assert int(model.aux[1].num_batches_tracked) == 0  # measuring the graph ran no real batch norm
    pipe.step(x, target=x, loss_fn=F.mse_loss)
    for xi in x.chunk(2):
        (F.mse_loss(eager(xi), xi) / 2).backward()
    for name, buf in eager.aux[1].named_buffers():
        torch.testing.assert_close(getattr(model.aux[1], name), buf, msg=name)


def test_the_head_of_one_mode_is_guarded_keeping_its_node_names():
    gm = fxpipe.trace(Aux().eval())
    assert "training_only_aux_0(training, aux_0_module" in gm.code
    assert {"aux_0", "aux_1", "aux_2", "b"} <= {n.name for n in gm.graph.nodes}
    assert merge_modes(fxpipe.trace(Aux().train()), fxpipe.trace(Aux().eval()), True) is None


def test_a_leaf_module_follows_the_mode_and_models_without_branches_trace_once():
    x = torch.randn(6, 8)
    trained = Net().train()
    reference = copy.deepcopy(trained).eval()
    leafy = fxpipe.compile(trained, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, leaf_modules=[DropPath])
    leafy.eval()
    torch.testing.assert_close(leafy(x), reference(x))
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 8))
    gm = fxpipe.trace(model)
    assert "training = self.training" not in gm.code  # torch.nn's modules read the mode themselves


def test_deferred_batch_norm_of_a_pipe_exported_in_eval_mode_defers_in_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).eval()
    eager, x = copy.deepcopy(model).train(), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, tracer="export",
                          deferred_batch_norm=True)
    pipe.train()
    pipe.step(x, target=None, loss_fn=lambda out, _: out.pow(2).mean())
    eager(x)  # deferred: the whole batch's statistics, counted once
    assert model[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model[1].running_var, eager[1].running_var)
    pipe.eval()
    torch.testing.assert_close(pipe(x), eager.eval()(x))


def test_compiled_stages_follow_the_mode():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, torch_compile={"backend": "aot_eager"})
    _modes(pipe, eager, x, [True, False, True])


class AuxOutput(nn.Module):
    """Return an auxiliary output in training only, as Inception-v3 and GoogLeNet do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return (self.b(h), h.mean(-1)) if self.training else self.b(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_outputs_of_another_structure_in_the_other_mode_are_refused_naming_both(tracer):
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(AuxOutput().train(), 2, example_inputs=(x,), devices=["cpu"] * 2, tracer=tracer)
    pipe.eval()
    with pytest.raises(fxpipe.PipelineInputError, match=r"the model's outputs tuple\(\*, \*\) in training mode where "
                                                        r"the other mode returns (\*|tuple\(\*\))\)"):
        pipe(x)


class UntracedEval(nn.Module):
    """Branch on a value in eval mode only: torch.fx cannot trace that mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if not self.training and h.sum() > 0:
            h = -h
        return self.b(h)


def test_a_mode_that_cannot_be_traced_is_refused_rather_than_run_in_the_other_s_graph():
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(UntracedEval().train(), 2, example_inputs=(x,), devices=["cpu"] * 2)
    pipe(x)
    pipe.eval()
    with pytest.raises(fxpipe.PipelineInputError, match=r"no graph: tracing it in the other mode failed \(TraceError\)"):
        pipe(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("kind", [_Inherited, lambda: _MyDropout(0.5), lambda: _MyBatchNorm(8)],
                         ids=["inherited-forward", "dropout-subclass", "batch-norm-subclass"])
def test_a_mode_read_in_an_inherited_forward_is_followed(tracer, kind):
    # the class's own source was read, not its bases': after pipe.eval() the training graph ran (0.7 off)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), kind(), nn.Linear(8, 8)).train()
    eager, x = copy.deepcopy(model), torch.randn(6, 8)
    try:
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, tracer=tracer)  # batch norm: 1 chunk
    except fxpipe.TraceError:  # fx refuses to trace through a batch norm subclass, naming the fix
        assert tracer == "fx" and isinstance(model[1], _MyBatchNorm)
        return
    _modes(pipe, eager, x, [False, True, False])


class _AuxLoss(nn.Module):
    """Returns an auxiliary loss (0-dim) in training mode and None in eval mode, as MONAI's SegResNetVAE does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h.relu())
        return (y, h.pow(2).mean()) if self.training else (y, None)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_output_0_dim_in_one_mode_only_is_refused_in_that_mode_only(tracer):
    # the check read the compile mode's outputs: the eval forward was refused for the training loss
    torch.manual_seed(0)
    model, x = _AuxLoss().train(), torch.randn(6, 8)
    eager = copy.deepcopy(model).eval()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    pipe.step(x, target=x, loss_fn=lambda out, t: F.mse_loss(out[0], t) + out[1])
    pipe.eval()
    with torch.no_grad():
        got, none = pipe(x)
    assert none is None
    torch.testing.assert_close(got, eager(x)[0])
    pipe.train()
    with pytest.raises(fxpipe.PipelineInputError, match=r"returns a 0-dim tensor \(\[1\]\)"):
        pipe(x)


def _shuffle(x):
    b, c, h, w = x.size()
    return torch.transpose(x.view(b, 2, c // 2, h, w), 1, 2).contiguous().view(b, -1, h, w)


class _ShuffleUnit(nn.Module):
    """A ShuffleNet v2 unit: two branches that downsample, or half the channels through one branch."""

    def __init__(self, c, stride):
        super().__init__()
        self.stride, half = stride, c // 2

        def depthwise(n):
            return [nn.Conv2d(n, n, 3, stride, 1, groups=n, bias=False), nn.BatchNorm2d(n)]

        self.branch1 = nn.Sequential(*depthwise(c), nn.Conv2d(c, half, 1, bias=False), nn.BatchNorm2d(half),
                                     nn.ReLU()) if stride > 1 else nn.Sequential()
        inner = c if stride > 1 else half
        self.branch2 = nn.Sequential(nn.Conv2d(inner, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(),
                                     *depthwise(half), nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half),
                                     nn.ReLU())

    def forward(self, x):
        if self.stride == 1:
            a, b = x.chunk(2, dim=1)
            return _shuffle(torch.cat((a, self.branch2(b)), dim=1))
        return _shuffle(torch.cat((self.branch1(x), self.branch2(x)), dim=1))


def test_the_modes_pair_each_batch_norm_with_its_own_in_the_other_mode():
    # exported, a ShuffleNet's training graph (more nodes: the counters' add_) was paired with its eval graph one
    # unit off: 71 merged nodes read one unit's weights in training and the next's in eval, so a stage held the
    # weights and statistics of another stage's units too (across ranks a second copy, never updated)
    torch.manual_seed(0)
    units = [_ShuffleUnit(16, 2 if i % 4 == 0 else 1) for i in range(8)]
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), *units, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 4)).train()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=2, devices=["cpu"] * 2,
                          tracer="export")
    picked = [[a.target for a in n.args[1:] if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
              for n in pipe._gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "pick"]
    assert not [p for p in picked if len(p) == 2 and p[0] != p[1]], picked[:3]
    read = [{n.target for n in stage.graph.nodes if n.op == "get_attr" and n.target != "training"}
            for stage in pipe.stages]
    assert not read[0] & read[1], sorted(read[0] & read[1])[:4]
