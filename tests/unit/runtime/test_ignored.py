import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.runtime.ignored import warn_uneven_ignored


def _labels(counted: list[int], length: int = 1000) -> torch.Tensor:
    """Give one row per count, each with that many entries that count and the rest -100."""
    rows = torch.full((len(counted), length), -100)
    for row, n in zip(rows, counted):
        row[:n] = 1
    return rows


def test_close_shares_are_told_apart_with_decimals():
    labels = _labels([341, 344])  # 34.1% and 34.4%: whole percents would read "34% to 34%"
    with pytest.warns(UserWarning, match=r"\(34\.1% to 34\.4% of each micro-batch's entries count\)"):
        assert warn_uneven_ignored({"labels": labels}, 2, 2, F.cross_entropy)


def test_distant_shares_keep_whole_percents():
    with pytest.warns(UserWarning, match=r"\(20% to 70% of each"):
        warn_uneven_ignored({"labels": _labels([200, 700])}, 2, 2, F.cross_entropy)


PAD = 2


class _Trainer:
    """Hold the padding label and compute the loss in a method (ignore_index=self.pad)."""

    def __init__(self):
        self.pad = 2

    def loss(self, out, t):
        return F.cross_entropy(out, t, ignore_index=self.pad)


class _LossModule(nn.Module):
    """A custom loss holding torch's as a submodule."""

    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=2)

    def forward(self, out, t):
        return self.ce(out, t)


class _PadLoss(nn.Module):
    """A custom loss passing its own field in forward."""

    def __init__(self):
        super().__init__()
        self.pad = 2

    def forward(self, out, t):
        return F.cross_entropy(out, t, ignore_index=self.pad)


class _PadCall:
    """A callable object passing its own field in __call__."""

    pad = 2

    def __call__(self, out, t):
        return F.cross_entropy(out, t, ignore_index=self.pad)

    def as_lambda(self):
        return lambda out, t: F.cross_entropy(out, t, ignore_index=self.pad)


def _closed_over(pad):
    return lambda out, t: F.cross_entropy(out, t, ignore_index=pad)


_LOSSES = {"plain": lambda out, t: F.cross_entropy(out, t), "pad": lambda out, t: F.cross_entropy(out, t, ignore_index=2)}


def _commented(out, t):
    return F.cross_entropy(out, t)  # ignore_index=2 is not used here


@pytest.mark.parametrize("loss_fn", [
    nn.CrossEntropyLoss(ignore_index=2),
    __import__("functools").partial(F.cross_entropy, ignore_index=2),
    lambda out, t: F.cross_entropy(out, t, ignore_index=2),
    lambda out, t: F.cross_entropy(out, t, ignore_index=PAD),
    _Trainer().loss,
    __import__("functools").partial(_Trainer().loss),
    _LossModule(),
    _LOSSES["pad"],
    _PadLoss(),
    _PadCall(),
    _closed_over(2),
    _PadCall().as_lambda(),
], ids=["module", "partial", "lambda", "global", "method", "partial-method", "submodule", "dict-lambda", "forward",
        "call", "closure", "closure-self"])
def test_a_loss_fn_s_own_ignore_index_is_looked_for(loss_fn):
    # ignore_index=2 in loss_fn: no warning, and the step's loss was NaN (a micro-batch of nothing counted)
    labels = torch.tensor([2, 2, 2, 2, 0, 1, 3, 4])
    with pytest.warns(UserWarning, match=r"marks entries 2 \(ignore_index\).*\(0% to 100%.*the step's loss is NaN"):
        assert warn_uneven_ignored({"target": labels}, 8, 4, loss_fn)


class _Routed(nn.Module):
    """Return a token loss summed over a count given whole, plus a load-balancing term when ``aux``."""

    def __init__(self, aux: bool):
        super().__init__()
        self.body, self.router, self.aux = nn.Linear(8, 8), nn.Linear(8, 4), aux

    def forward(self, x, labels, n):
        h = self.body(x)
        probs = self.router(h).softmax(-1)
        loss = F.cross_entropy(h.reshape(-1, 8), labels.reshape(-1), reduction="sum") / n
        if self.aux:  # each expert's share of the rows times its mean probability: a product of two means
            loss = loss + 4 * (probs.mean((0, 1)) * (probs > 0.25).float().mean((0, 1))).sum()
        return {"loss": loss}


@pytest.mark.parametrize("aux", [True, False])
def test_a_coupled_term_added_per_micro_batch_under_sum_is_warned_of(aux):
    # a mixture of experts' aux loss in out.loss under the docs' -100 recipe counted chunks times, warned of vaguely
    import warnings

    import fxpipe

    torch.manual_seed(0)
    x, labels = torch.randn(8, 3, 8), torch.randint(0, 8, (8, 3))
    n = torch.tensor(24.0)
    pipe = fxpipe.compile(_Routed(aux), 2, example_inputs=(x, labels, n), unbatched=["n"], chunks=4,
                          devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x, labels, n, target=None, loss_fn=lambda out, _: out["loss"], loss_reduction="sum")
    told = [str(w.message) for w in caught if "counts once per micro-batch, 4x its scale in eager" in str(w.message)]
    assert bool(told) == aux, [str(w.message)[:100] for w in caught]


class _WithAux(nn.Module):
    """Return logits and a load-balancing term (a product of two means over the rows)."""

    def __init__(self):
        super().__init__()
        self.body, self.router = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        probs = self.router(h).softmax(-1)
        return h, 4 * (probs.mean(0) * (probs > 0.25).float().mean(0)).sum()


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("coefficient, batch", [(1.0, 8), (0.01, 8), (0.02, 7)])
def test_a_coupled_term_scaled_by_the_rows_share_as_the_warning_says_is_not_warned_of(scaled, checkpoint,
                                                                                      coefficient, batch):
    # the warning fired on its own recipe (aux * rows / batch), saying the term counted 4x; and on it
    # with a coefficient (0.01 * aux * rows / batch, a router's aux loss weight)
    import warnings

    import fxpipe

    torch.manual_seed(0)
    x, labels = torch.randn(batch, 8), torch.randint(0, 8, (batch,))

    def loss_fn(out, y):
        logits, aux = out
        share = y.shape[0] / batch if scaled else 1
        return F.cross_entropy(logits, y, reduction="sum") / batch + coefficient * aux * share

    pipe = fxpipe.compile(_WithAux(), 2, example_inputs=(x,), chunks=4, checkpoint=checkpoint, devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x, target=labels, loss_fn=loss_fn, loss_reduction="sum")
    told = [str(w.message) for w in caught if "counts once per micro-batch" in str(w.message)]
    assert bool(told) != scaled, [str(w.message)[:100] for w in caught]


class _MeanLoss(nn.Module):
    """Return the mean cross-entropy over the rows (a model computing its own loss)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


@pytest.mark.parametrize("scale, told", [("share", False), ("half share", False), ("constant", True)])
def test_a_mean_output_scaled_by_the_rows_share_under_sum_is_not_warned_of(scale, told):
    # a mean loss_fn scales by its micro-batch's share (mean * rows / batch) was warned of as counting 4x
    import warnings

    import fxpipe

    torch.manual_seed(0)
    x, labels = torch.randn(8, 8), torch.randint(0, 8, (8,))
    factor = {"share": lambda y: y.shape[0] / 8, "half share": lambda y: 0.5 * y.shape[0] / 8,
              "constant": lambda y: 0.3}[scale]
    pipe = fxpipe.compile(_MeanLoss(), 2, example_inputs=(x, labels), chunks=4, devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x, labels, target=labels, loss_fn=lambda out, y: out * factor(y), loss_reduction="sum")
    warned = [str(w.message) for w in caught if "a mean over the rows, which loss_fn returns" in str(w.message)]
    assert bool(warned) == told, [str(w.message)[:100] for w in caught]


@pytest.mark.parametrize("loss_fn", [_commented, _LOSSES["plain"]], ids=["comment", "dict-lambda-beside"])
def test_an_ignore_index_in_a_comment_or_a_neighbour_s_code_is_not_read(loss_fn, recwarn):
    # "target marks entries 2 (ignore_index) in unequal shares" for a loss that ignores nothing, read off a
    # comment, or off another lambda on the same line
    assert warn_uneven_ignored({"target": torch.tensor([2, 2, 2, 2, 0, 1, 3, 4])}, 8, 4, loss_fn)
    assert not [w for w in recwarn if "unequal shares" in str(w.message)]


def test_a_step_given_no_targets_leaves_the_look_to_the_next():
    # a step refused for labels on the wrong rank used up the "said once" look, and no later step warned
    assert not warn_uneven_ignored({"target": None, "labels": None}, 2, 2, F.cross_entropy)
    with pytest.warns(UserWarning, match="unequal shares"):
        assert warn_uneven_ignored({"target": None, "labels": _labels([200, 700])}, 2, 2, F.cross_entropy)


class _WithAuxHead(_WithAux):
    """Return a head's logits (which no later layer saves) and the load-balancing term."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h, aux = super().forward(x)
        return self.head(h), aux


def test_the_look_at_a_coupled_terms_scale_leaves_the_outputs_and_the_random_state_alone():
    # loss_fn ran once more on views of the live outputs: an in-place temperature (logits.div_) broke backward
    # inside torch; and its random draws moved the global random state
    import copy
    import warnings

    import fxpipe

    torch.manual_seed(0)
    model, x = _WithAuxHead(), torch.randn(8, 8)
    eager = copy.deepcopy(model)
    draws = []

    def loss_fn(out, y):
        logits, aux = out
        logits.div_(2.0)
        draws.append(torch.rand(()))
        return (logits ** 2).sum() / 8 + aux * logits.shape[0] / 8

    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = pipe.step(x, target=None, loss_fn=loss_fn, loss_reduction="sum")
    after = torch.rand(())
    torch.manual_seed(1)
    expected = [torch.rand(()) for _ in range(4)]
    assert torch.equal(torch.rand(()), after)  # the look drew nothing the user's loop sees
    assert sorted({float(d) for d in draws}) == sorted(float(d) for d in expected)
    expect = sum(loss_fn(eager(x[i:i + 2]), None) for i in range(0, 8, 2))
    expect.backward()
    torch.testing.assert_close(loss, expect.detach())
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class _Critic(nn.Module):
    """A critic loss_fn calls: batch norm, spectral norm and a generator of its own."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.l = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.g = torch.Generator().manual_seed(7)

    def forward(self, h):
        return self.l(self.bn(h) + 0.1 * torch.randn(h.shape, generator=self.g))


def test_the_look_at_a_coupled_terms_scale_leaves_the_modules_loss_fn_calls_alone():
    # the look ran loss_fn once more: batch norm counted 5 batches for 4, spectral norm iterated once more
    # (gradients 0.7% off) and the critic's own generator moved on, silently
    import copy
    import warnings

    import fxpipe

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, critic, x = _WithAuxHead(), _Critic(), torch.randn(8, 8)
        eager, eager_critic = copy.deepcopy(model), copy.deepcopy(critic)

        def loss_of(c):
            def loss_fn(out, y):
                logits, aux = out
                return c(logits).pow(2).sum() / 8 + aux * logits.shape[0] / 8
            return loss_fn

        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = pipe.step(x, target=None, loss_fn=loss_of(critic), loss_reduction="sum")
        expect = sum(loss_of(eager_critic)(eager(x[i:i + 2]), None) for i in range(0, 8, 2))
        expect.backward()
        torch.testing.assert_close(loss, expect.detach())
        for a, b in zip([*model.parameters(), *critic.parameters()], [*eager.parameters(), *eager_critic.parameters()]):
            torch.testing.assert_close(a.grad, b.grad)
        for a, b in zip(critic.buffers(), eager_critic.buffers()):
            torch.testing.assert_close(a, b)
        assert torch.equal(critic.g.get_state(), eager_critic.g.get_state())
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("wrap", [lambda t: {"labels": t, "value": torch.zeros(2)}, lambda t: (t,)])
def test_labels_inside_a_target_dict_or_tuple_are_looked_at_too(wrap):
    # only a target that is itself a tensor was looked at: a multi-task dict's -100 labels went unwarned
    # (gradients 67% off eager, silently)
    with pytest.warns(UserWarning, match=r"target\['labels'\]|target\[0\]"):
        assert warn_uneven_ignored({"target": wrap(_labels([200, 700]))}, 2, 2, F.cross_entropy)
