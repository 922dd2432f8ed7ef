"""A ``loss_fn`` summing over the rows under the mean weighting is warned of on the first step."""

import copy
import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.microbatch import loss_again
from fxpipe.runtime.summedloss import sums_rows


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 8), torch.randint(0, 4, (8,))


def _summed(out, y):
    return F.cross_entropy(out, y, reduction="sum")


_CRITERION = nn.CrossEntropyLoss(reduction="sum")  # made at module level, read by the loss_fn's code


def _by_criterion(out, y):
    return _CRITERION(out, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("loss_fn", [_summed, nn.CrossEntropyLoss(reduction="sum"),
                                     lambda out, y: F.cross_entropy(out, y, reduction="sum") / 8, _by_criterion],
                         ids=["function", "module", "over-a-constant", "global-criterion"])
@pytest.mark.parametrize("rows", [8, 4], ids=["two-rows-each", "one-row-each"])
def test_a_summed_loss_fn_is_warned_of_naming_loss_reduction_sum(schedule, loss_fn, rows):
    # the step's loss came out 1/4 of eager's at chunks=4, silently
    model, x, y = _mlp()
    x, y = x[:rows], y[:rows]
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2, schedule=schedule)
    with pytest.warns(UserWarning, match=r"loss_fn sums over the rows .* about 1/4 of eager's.*"
                                         r"loss_reduction='sum'"):
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
    with torch.no_grad():
        expected = float(loss_fn(eager(x), y))
    assert abs(float(loss) * 4 - expected) < 1e-4 * abs(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per pipe
        pipe.step(x, target=y, loss_fn=loss_fn)


@pytest.mark.parametrize("loss_fn, kw", [(F.cross_entropy, {}), (_summed, {"loss_reduction": "sum"}),
                                         (lambda out, y: F.mse_loss(out, F.one_hot(y, 4).float()), {})],
                         ids=["mean", "sum-with-loss_reduction", "mse"])
def test_a_mean_or_a_sum_under_loss_reduction_sum_is_not_warned_of(loss_fn, kw):
    model, x, y = _mlp()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, devices=["cpu"] * 2, schedule="1f1b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, target=y, loss_fn=loss_fn, **kw)


def test_the_look_tells_a_sum_from_a_mean_and_a_loss_coupling_the_rows():
    out, y = torch.randn(6, 4), torch.randint(0, 4, (6,))

    def contrastive(o, _):
        return F.cross_entropy(o @ o.T, torch.arange(len(o)))

    assert sums_rows(out, partial(loss_again, _summed, y, rows=6))
    assert not sums_rows(out, partial(loss_again, F.cross_entropy, y, rows=6))
    assert not sums_rows(out, partial(loss_again, contrastive, y, rows=6))
    assert sums_rows(out[:1], partial(loss_again, _summed, y[:1], rows=1))  # one row, taken twice: a sum doubles
    assert not sums_rows(out[:1], partial(loss_again, F.cross_entropy, y[:1], rows=1))
    assert not sums_rows({"loss": torch.tensor(1.0)}, partial(loss_again, lambda o, _: o["loss"], None, rows=6))
