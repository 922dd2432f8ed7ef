"""fxpipe.compat.torchgpipe: torchgpipe's GPipe and skip API, compiled by fxpipe.

torchgpipe's own test suite runs against it with benchmarks/torchgpipe_tests.py; these tests
check what that suite does not: equality with eager and with torchgpipe itself, and that
skips between partitions become fxpipe skip routes.
"""

import copy

import pytest
import torch
from torch import nn

from fxpipe import SkipRoute
from fxpipe.compat.torchgpipe import GPipe, is_recomputing
from fxpipe.compat.torchgpipe.batchnorm import DeferredBatchNorm
from fxpipe.compat.torchgpipe.gpipe import BalanceError
from fxpipe.compat.torchgpipe.skip import Namespace, pop, skippable, stash
from fxpipe.testing import max_relative_error


def skip_model(skip=None, dropout=0.0):
    """A 1-to-3 skip over four layers (torchgpipe's README example), in ``skip``'s API."""
    skip = skip or __import__("fxpipe.compat.torchgpipe.skip", fromlist=["skip"])

    @skip.skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            yield skip.stash("1to3", x)
            return torch.tanh(self.fc(x))

    @skip.skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            skip_1to3 = yield skip.pop("1to3")
            return self.fc(x) + skip_1to3

    torch.manual_seed(0)
    return nn.Sequential(Layer1(), nn.Dropout(dropout), nn.Linear(8, 8), Layer3())


@pytest.mark.parametrize("balance, checkpoint", [([1, 1, 2], "except_last"), ([2, 2], "always"),
                                                 ([4], "never")])
def test_equals_eager_with_skips(balance, checkpoint):
    model = skip_model()
    eager = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 8, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out, expected = gpipe(x), eager(x_eager)
    assert max_relative_error(out, expected) < 1e-5
    out.square().sum().backward()
    expected.square().sum().backward()
    assert max_relative_error(x.grad, x_eager.grad) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("balance, routes, receivers", [
    ([1, 1, 2], [SkipRoute("skip_1to3", 0, 2, 0)], [2]),  # stage 0 -> stage 2, not through 1
    ([2, 2], [], [1]),                                     # the next stage: a boundary value
    ([1, 3], [], [1]),
    ([4], [], []),                                         # inside one partition: no edge
])
def test_skips_between_partitions_become_routes(balance, routes, receivers):
    plan = GPipe(skip_model(), balance, devices=["cpu"] * len(balance)).pipe.plan
    assert plan.skips == routes
    assert [s.index for s in plan.stages if "skip_1to3" in s.inputs] == receivers


def test_isolated_skips_of_one_name_are_two_routes():
    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x * 2

    @skippable(pop=["skip"])
    class Pop(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return x + skip

    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), nn.Identity(),
                          Pop().isolate(ns2), Pop().isolate(ns1))
    gpipe = GPipe(model, [1, 1, 1, 1, 1], devices=["cpu"] * 5, chunks=2)
    assert sorted((r.src, r.dst) for r in gpipe.pipe.plan.skips) == [(0, 4), (1, 3)]
    x = torch.randn(4, 3)
    assert torch.allclose(gpipe(x), model(x))  # eagerly: the thread's default skip tracker


def test_outputs_equal_torchgpipe():
    torchgpipe = pytest.importorskip("torchgpipe")
    theirs_skip = pytest.importorskip("torchgpipe.skip")

    for balance, checkpoint in [([1, 1, 2], "always"), ([2, 2], "except_last")]:
        theirs = skip_model(theirs_skip, dropout=0.3)
        ours = skip_model(dropout=0.3)
        ours.load_state_dict(theirs.state_dict())  # the same keys: layers hold the class as .module
        kw = {"devices": ["cpu"] * len(balance), "chunks": 3, "checkpoint": checkpoint}
        a, b = torchgpipe.GPipe(theirs, balance, **kw), GPipe(ours, balance, **kw)
        x = torch.randn(7, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)
        ya = a(xa)
        ya.square().sum().backward()
        torch.manual_seed(1)
        yb = b(xb)
        yb.square().sum().backward()
        # dropout included: the same masks, from the same micro-batches in the same order
        assert max_relative_error(yb, ya) < 1e-6
        assert max_relative_error(xb.grad, xa.grad) < 1e-5
        theirs_grads = dict(a.named_parameters())
        for name, p in b.named_parameters():
            assert max_relative_error(p.grad, theirs_grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("batch, rows", [(6, [2, 2, 2]), (9, [3, 3, 3]), (10, [3, 3, 3, 1]), (3, [1, 1, 1]),
                                         (8, [2, 2, 2, 2])])
def test_micro_batches_are_torchgpipe_s_chunks(batch, rows):
    # batch norm in training sees each micro-batch: split unlike torchgpipe, batch 6 at chunks=4 made micro-batches
    # of [2, 2, 1, 1], and a one-row batch norm raised; batch 9 gave other outputs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(len(args[0])))
    eager = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=4, checkpoint="never")
    gpipe.train(min(rows) > 1)  # a one-row batch norm fails in training, in torchgpipe too
    eager.train(min(rows) > 1)
    x = torch.randn(batch, 4)
    out = gpipe(x)
    assert seen == rows
    expected = torch.cat([eager(part) for part in x.chunk(4)])
    assert max_relative_error(out, expected) < 1e-6


def test_partitions_are_called_as_modules():
    calls = []
    gpipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2, chunks=2)
    gpipe.partitions[1].register_forward_hook(lambda m, i, o: calls.append(is_recomputing()))
    gpipe(torch.randn(4, 2)).sum().backward()
    assert calls == [False, False, True]  # two micro-batches; the first recomputed in backward
    assert list(gpipe.state_dict()) == ["partitions.0.0.weight", "partitions.0.0.bias",
                                        "partitions.1.1.weight", "partitions.1.1.bias"]


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((nn.Linear(1, 1), [1]), {}, TypeError, "nn.Sequential"),
    ((nn.Sequential(nn.Linear(1, 1)),), {}, ValueError, "balance is required"),
    ((nn.Sequential(nn.Linear(1, 1)), [2]), {}, BalanceError, "sum of balance"),
    ((nn.Sequential(nn.Linear(1, 1)), [1]), {"devices": ["cpu"], "checkpoint": "sometimes"}, ValueError,
     "checkpoint is not one of 'always', 'except_last', or 'never'"),
    ((nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1]), {"devices": ["cpu"]}, IndexError,
     "too few devices"),
])
def test_bad_arguments_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        GPipe(*args, **kwargs)


def test_non_tensor_between_partitions_is_refused():
    class Words(nn.Module):
        def forward(self, x):
            return (x, "hello")

    gpipe = GPipe(nn.Sequential(Words(), nn.Identity()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="output of partition 0"):
        gpipe(torch.randn(2, 2))


def test_input_tensors_of_other_batch_sizes_are_refused_naming_gpipe_s_fix():
    # the refusal named fxpipe.compile(unbatched=), which GPipe does not take
    gpipe = GPipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"the input's tensors have \[4, 3\] rows on dim 0.*same batch size") as got:
        gpipe((torch.randn(4, 4), torch.randn(3, 4)))
    assert "unbatched" not in str(got.value)


def test_deferred_batch_norm_commits_once_per_chunks_calls():
    bn = nn.BatchNorm1d(3)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(copy.deepcopy(bn)), chunks=4)[0]
    x = torch.randn(16, 3) * torch.tensor([1.0, 10.0, 100.0])
    bn(x)
    for chunk in x.chunk(4):
        deferred(chunk)
    assert torch.allclose(deferred.running_mean, bn.running_mean, rtol=1e-5)
    assert torch.allclose(deferred.running_var, bn.running_var, rtol=1e-5)
    assert int(deferred.num_batches_tracked) == 1


def test_deferred_batch_norm_has_torchgpipe_s_state_dict_keys():
    # torchgpipe's class keeps its accumulation in persistent buffers: a state dict of one loads into the other
    from fxpipe.compat.torchgpipe.batchnorm import DeferredBatchNorm

    keys = set(DeferredBatchNorm(4, chunks=2).state_dict())
    assert keys == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked", "sum", "sum_squares"}


def test_gpipe_with_deferred_batch_norm_has_torchgpipe_s_state_dict_keys():
    # torchgpipe swaps each batch norm for its DeferredBatchNorm (sum, sum_squares); fxpipe defers the model's own
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))

    gpipe = GPipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    gpipe(torch.randn(8, 4))
    state = gpipe.state_dict()
    assert {"partitions.0.1.sum", "partitions.0.1.sum_squares"} <= set(state)
    assert not state["partitions.0.1.sum"].any()
    assert "sum" not in gpipe.partitions[0][1].state_dict()  # the batch norm itself is not changed
    fresh = GPipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.partitions[0][1].running_mean, gpipe.partitions[0][1].running_mean)
    plain = GPipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2)
    assert not any(k.endswith("sum") for k in plain.state_dict())
    torchgpipe = pytest.importorskip("torchgpipe")
    theirs = torchgpipe.GPipe(model(), [2, 2], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    assert set(theirs.state_dict()) == set(state)
    theirs.load_state_dict(state)
    fresh.load_state_dict(theirs.state_dict())


def test_changing_chunks_after_building_is_refused():
    # g.chunks = 4 was taken and ignored: the forward still ran 2 micro-batches
    g = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match=r"GPipe.chunks is fixed when the GPipe is built .*chunks=2.*chunks=4"):
        g.chunks = 4
    assert g.chunks == 2
