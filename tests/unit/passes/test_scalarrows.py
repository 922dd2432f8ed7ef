"""0-dim outputs that are not a mean over the rows (a load-balancing loss) are warned of at compile."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Routed(nn.Module):
    """A router and its load-balancing loss, as a mixture of experts computes it (Switch, Mixtral, Qwen-MoE)."""

    def __init__(self, aux=True, coupled=True):
        super().__init__()
        self.router, self.head = nn.Linear(8, 4), nn.Linear(8, 2)
        self.aux, self.coupled = aux, coupled

    def forward(self, x, y):
        probs = F.softmax(self.router(x), dim=-1)
        share = F.one_hot(probs.argmax(-1), 4).float().mean(0)  # each expert's share of the batch's rows
        if self.coupled:
            balance = 4 * (share * probs.mean(0)).sum()  # a product of two batch means: not a mean over rows
        else:
            balance = 4 * (probs * probs).sum(-1).mean()  # a mean over rows of per-row terms
        loss = F.cross_entropy(self.head(x), y)
        if self.aux:
            loss = loss + 0.1 * balance
        return {"loss": loss, "balance": balance}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_load_balancing_loss_is_warned_of_at_compile(tracer):
    # the micro-batches' mean of a product of batch means is another number: the loss and the router's
    # gradients differed from eager's, and nothing said so
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    with pytest.warns(UserWarning, match=r"\['loss'\] .*a 0-dim output that is not a mean over the rows .*"
                                         r"\['balance'\] .*differ from eager's on the whole batch"):
        pipe = fxpipe.compile(Routed(), 2, example_inputs=(x, y), chunks=2, tracer=tracer)
    eager = Routed()
    eager.load_state_dict(pipe.state_dict())
    # what the warning says: the step's loss is the micro-batches' mean, not the whole batch's
    loss = pipe.step(x, y, target=None, loss_fn=lambda out, _: out["loss"])
    assert abs(loss - eager(x, y)["loss"]) > 1e-6


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_mean_over_rows_is_not_warned_of(tracer):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    model = Routed(coupled=False)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxpipe.compile(model, 2, example_inputs=(x, y), chunks=2, tracer=tracer)
    loss = pipe.step(x, y, target=None, loss_fn=lambda out, _: out["loss"])
    assert abs(loss - eager(x, y)["loss"]) < 1e-6


class _TwoTower(nn.Module):
    """Queries against every document of the batch, and the in-batch-negatives loss over them, returned 0-dim."""

    def __init__(self, pairwise=True):
        super().__init__()
        self.q, self.d = nn.Linear(8, 16), nn.Linear(8, 16)
        self.pairwise = pairwise

    def forward(self, a, b):
        q, d = F.normalize(self.q(a), dim=-1), F.normalize(self.d(b), dim=-1)
        if not self.pairwise:  # each query against its own document: a mean over rows
            return (q * d).sum(-1).neg().mean()
        return F.cross_entropy(q @ d.t() * 10, torch.arange(q.shape[0]))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_in_batch_negatives_loss_returned_by_the_model_is_warned_of(tracer):
    # before: classed a mean over rows (the (B, B) scores follow the batch), unwarned; loss 3.49 against 5.28
    a, b = torch.randn(12, 8), torch.randn(12, 8)
    with pytest.warns(UserWarning, match=r"node 'cross_entropy\w*'\): a 0-dim output .*in-batch-negatives"):
        fxpipe.compile(_TwoTower(), 2, example_inputs=(a, b), chunks=3, tracer=tracer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxpipe.compile(_TwoTower(pairwise=False), 2, example_inputs=(a, b), chunks=3, tracer=tracer)


class _TrainingOnlyPenalty(nn.Module):
    """A 0-dim penalty in training mode only: a mean over rows inside a mode guard (passes/modes.When)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return (h, h.pow(2).mean()) if self.training else (h, None)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_mean_inside_a_mode_guard_is_not_warned_of(tracer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxpipe.compile(_TrainingOnlyPenalty().train(), 2, example_inputs=(torch.randn(6, 8),), chunks=2,
                       devices=["cpu"] * 2, tracer=tracer)


class _SelfLoss(nn.Module):
    """A model computing its own loss, reduced over the rows as ``how`` says."""

    def __init__(self, how):
        super().__init__()
        self.a, self.how = nn.Linear(8, 3), how
        self.crit = nn.CrossEntropyLoss(reduction="sum")

    def forward(self, x, y):
        out = self.a(x)
        if self.how == "sum":
            return (out - 1).pow(2).sum()
        if self.how == "loss_sum":
            return F.cross_entropy(out, y, reduction="sum") * 0.5
        if self.how == "module_sum":
            return self.crit(out, y)
        if self.how == "rows_mean":
            return out.pow(2).sum(-1).mean()  # a sum over features, then a mean over rows
        if self.how == "by_size":
            return out.pow(2).sum() / x.shape[0]  # a mean, written as a sum over a size
        return F.cross_entropy(out, y)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("how", ["sum", "loss_sum", "module_sum"])
def test_a_loss_summed_over_rows_is_warned_of_and_sums_with_loss_reduction_sum(tracer, how):
    # the micro-batches' sums were averaged by rows: 1/chunks of eager's loss and gradients, silently
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    model = _SelfLoss(how)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, y), chunks=3, tracer=tracer)
    with pytest.warns(UserWarning, match=r"the model returns the output: a sum over the rows, which loss_fn's loss is or adds\..*1/3 of .*"
                                         r"loss_reduction='sum'"):
        pipe.step(x, y, target=None, loss_fn=lambda out, _: out)
    pipe.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.step(x, y, target=None, loss_fn=lambda out, _: out, loss_reduction="sum")
    expected = eager(x, y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(pipe.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


class _SharedLoss(nn.Module):
    """A model dividing its summed loss by a count of the whole batch, given as an input (num_items_in_batch=)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, x, y, n):
        return F.cross_entropy(self.a(x), y, reduction="sum") / n


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_mean_loss_added_under_loss_reduction_sum_is_warned_of(tracer):
    # the recipe for a model's own loss (loss_reduction='sum') on a model whose loss is a mean per call
    # (T5 ignores num_items_in_batch=): chunks x eager's loss, silently
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    pipe = fxpipe.compile(_SelfLoss("mean"), 2, example_inputs=(x, y), chunks=3, tracer=tracer)
    with pytest.warns(UserWarning, match=r"a mean over the rows, which loss_fn returns\. With loss_reduction='sum' .* gives 3x eager's"):
        pipe.step(x, y, target=None, loss_fn=lambda out, _: out, loss_reduction="sum")
    n = torch.tensor(6.0)
    model = _SharedLoss()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, y, n), chunks=3, tracer=tracer, unbatched=["n"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.step(x, y, n, target=None, loss_fn=lambda out, _: out, loss_reduction="sum")
    torch.testing.assert_close(loss, eager(x, y, n).detach())


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_sum_divided_by_a_count_given_whole_is_warned_of_under_the_mean(tracer):
    # HF's loss with num_items_in_batch= under the default loss_reduction: 1/chunks of eager's, silently (a sum
    # scaled by an input was classed "linear otherwise" and not told)
    torch.manual_seed(0)
    x, y, n = torch.randn(6, 8), torch.randint(0, 3, (6,)), torch.tensor(6.0)
    pipe = fxpipe.compile(_SharedLoss(), 2, example_inputs=(x, y, n), chunks=3, tracer=tracer)
    with pytest.warns(UserWarning, match=r"a sum over the rows, which loss_fn's loss is or adds\..*1/3 of"):
        pipe.step(x, y, n, target=None, loss_fn=lambda out, _: out)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("how", ["mean", "rows_mean", "by_size"])
def test_a_loss_averaged_over_rows_is_not_warned_of(tracer, how):
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxpipe.compile(_SelfLoss(how), 2, example_inputs=(x, y), chunks=3, tracer=tracer)
        pipe.step(x, y, target=None, loss_fn=lambda out, _: out)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("shape", [(), (1,), (3,)])
def test_an_output_no_row_changes_is_taken_from_the_first_micro_batch(tracer, shape):
    # pipe(x) refused a learned temperature: a 0-dim one as "computed over its own rows", a (1,) or (3,)
    # one as coupling the rows of the batch, though no row changes it
    from record_cases import Tempered

    torch.manual_seed(0)
    model, x = Tempered(shape), torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, tracer=tracer)
    with torch.no_grad():
        out, want = pipe(x), model(x)
    torch.testing.assert_close(out["logits"], want["logits"])
    torch.testing.assert_close(out["scale"], want["scale"])


def test_an_unbatched_input_returned_whole_comes_back_once():
    class Echo(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, table):
            return self.a(x) + table.sum(), table

    x, table = torch.randn(6, 4), torch.randn(5, 2)
    model = Echo()
    pipe = fxpipe.compile(model, 1, example_inputs=(x, table), chunks=3, unbatched=["table"])
    out = pipe(x, table)
    torch.testing.assert_close(out[0], model(x, table)[0])
    assert out[1].shape == (5, 2) and torch.equal(out[1], table)


def test_outputs_made_of_sizes_but_shaped_by_the_batch_come_back_with_every_row():
    # position ids expanded to the batch and a mask of ones were taken as independent of the batch
    # (made of sizes alone), so pipe(x) returned the first micro-batch's 2 rows of 6, silently
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
            return self.b(self.a(x)), pos, x.new_ones(x.shape[0], x.shape[1]), self.b.weight.sum()

    x, model = torch.randn(6, 4, 8), Positions()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2, split_points=["b"])
    with torch.no_grad():
        got, expected = pipe(x), model(x)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_a_coupled_output_is_still_refused_beside_an_independent_one():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.t = nn.Linear(4, 4), nn.Parameter(torch.ones(()))

        def forward(self, x):
            h = self.a(x)
            return h @ h.T, self.t * 2  # a batch x batch similarity couples the rows

    x = torch.randn(6, 4)
    with pytest.warns(UserWarning, match="couples the rows"):
        pipe = fxpipe.compile(Mixed(), 2, example_inputs=(x,), chunks=3)
    with pytest.raises(fxpipe.PipelineInputError, match=r"\[0\] \(node"):
        pipe(x)


class _LogitsAndLoss(nn.Module):
    """Return the logits and the model's own mean loss, as a Hugging Face model given labels does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        logits = self.b(torch.relu(self.a(x)))
        return {"logits": logits, "loss": F.cross_entropy(logits, y)}


def test_a_summed_loss_from_the_logits_beside_the_model_s_mean_loss_is_not_warned_of():
    # the docs' recipe (T5 given labels, a loss from the logits over the batch's count, loss_reduction='sum')
    # was warned of as a mean added up, though loss_fn never read the model's loss
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    model = _LogitsAndLoss()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, y), chunks=3)
    n = y.numel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = pipe.step(x, y, target=y, loss_reduction="sum",
                         loss_fn=lambda out, t: F.cross_entropy(out["logits"], t, reduction="sum") / n)
    torch.testing.assert_close(loss, eager(x, y)["loss"].detach())
    with pytest.warns(UserWarning, match=r"a mean over the rows, which loss_fn returns"):
        fxpipe.compile(copy.deepcopy(eager), 2, example_inputs=(x, y), chunks=3).step(
            x, y, target=y, loss_reduction="sum", loss_fn=lambda out, _: out["loss"])


class _AuxSum(nn.Module):
    """Logits and an auxiliary penalty summed over the rows (an activation regulariser)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), h.pow(2).sum() * 1e-3


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_summed_auxiliary_output_added_to_a_mean_loss_is_warned_of(checkpoint, schedule):
    # loss_fn = task mean + the model's sum: the sum counted 1/chunks of eager's (36% off a gradient), silently,
    # since the warning looked only for a loss_fn returning that output as it is; the sum is made on stage 0 and
    # returned by stage 1 as it came (a leaf there), and a checkpointed forward keeps no graph to look into
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    pipe = fxpipe.compile(_AuxSum(), 2, example_inputs=(x,), chunks=3, checkpoint=checkpoint, schedule=schedule,
                          split_points=["b"])
    with pytest.warns(UserWarning, match=r"a sum over the rows, which loss_fn's loss is or adds\..*1/3 of"):
        pipe.step(x, target=y, loss_fn=lambda out, t: F.cross_entropy(out[0], t) + out[1])
    with warnings.catch_warnings():  # the logits alone: nothing of the sum reaches the loss
        warnings.simplefilter("error")
        fxpipe.compile(_AuxSum(), 2, example_inputs=(x,), chunks=3, checkpoint=checkpoint, schedule=schedule).step(
            x, target=y, loss_fn=lambda out, t: F.cross_entropy(out[0], t))


class FixedRows(nn.Module):
    """A 0-dim output made of a reshape fixed to the example's rows: no micro-batch's propagation can run it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return h, h.reshape(8, 4).pow(2).mean(0).sum()


def test_a_0_dim_output_that_cannot_be_checked_is_warned_of_as_unchecked():
    # before: nothing said when the micro-batch's propagation failed, so a balance loss went unwarned
    with pytest.warns(UserWarning, match=r"0-dim output\(s\) \['\[1\]'\], which fxpipe could not check"):
        fxpipe.compile(FixedRows(), 2, example_inputs=(torch.randn(8, 4),), chunks=4, devices=["cpu"] * 2)
