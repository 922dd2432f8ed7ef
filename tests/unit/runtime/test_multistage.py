"""Several stages per rank: interleaved 1F1B and ZB-V, with skips between any stages."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import TiedTransformer, token_loss
from unet import UNet

import fxpipe
from fxpipe.runtime.schedules.actions import check, clocks, in_flight
from fxpipe.runtime.schedules.builtin import one_f_one_b
from fxpipe.runtime.schedules.multistage import interleaved, loop_placement, v_placement, zbv
from fxpipe.testing import max_relative_error

GRID = [(p, m) for p in (2, 3, 4) for m in range(1, 3 * p + 2)]  # fewer micro-batches than ranks too
UNET_SPLIT = ["down.1", "middle", "up.1"]  # skips from stage 0 to 3 and from stage 1 to 2


def test_placements():
    assert loop_placement(6, 3) == [0, 1, 2, 0, 1, 2]
    assert v_placement(6, 3) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(fxpipe.ScheduleError, match="two stages on each rank"):
        v_placement(6, 2)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", GRID)
def test_interleaved_runs_every_step_once_on_its_rank_and_finishes(p, m, v):
    actions = interleaved(p * v, m, p)
    check(actions, p * v, m)  # complete, and no rank waits for ever
    for r, row in enumerate(actions):
        assert {a.stage for a in row} == {s for s in range(p * v) if s % p == r}


@pytest.mark.parametrize("p,m", GRID)
def test_zbv_runs_every_step_once_within_1f1b_memory(p, m):
    actions = zbv(2 * p, m, p)
    check(actions, 2 * p, m)
    for r, row in enumerate(actions):
        assert {a.stage for a in row} == {r, 2 * p - 1 - r}
        # activations held until their W ran, in half-stage units, never above 1F1B's first rank
        # (a whole stage each, freed by its backward)
        held = peak = 0
        for a in row:
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert in_flight(row) <= peak <= 2 * in_flight(one_f_one_b(p, m)[0])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_smaller_stages_shorten_the_step(p):
    """With unit-time half-stage actions: ZB-V within p units of no bubble (6m), below 1F1B's 2 * 3(m + p - 1)."""
    m = 2 * p
    one_f_one_b_units = 2 * 3 * (m + p - 1)  # whole stages: F 2 units, B 4 (input and weight gradients)
    assert max(clocks(zbv(2 * p, m, p)).values()) + 1 <= 6 * m + p < one_f_one_b_units
    # interleaved (B one unit here): the bubble shrinks from (p - 1) to (p - 1) / v of a stage's steps
    assert max(clocks(interleaved(2 * p, m, p)).values()) + 1 < 2 * (max(clocks(one_f_one_b(p, m)).values()) + 1)


def _eager_step(model, x, target, loss_fn):
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    return expected, dict(eager.named_parameters())


def _unet():
    torch.manual_seed(0)
    return UNet(depth=2, base=4).eval(), torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16), F.mse_loss


def _tied():
    torch.manual_seed(0)

    return TiedTransformer(), torch.randint(0, 32, (7, 8)), torch.randint(0, 32, (7, 8)), token_loss


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("case", ["unet", "tied"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_one_process_equals_eager(schedule, case, checkpoint):
    model, x, target, loss_fn = _unet() if case == "unet" else _tied()
    expected, grads = _eager_step(model, x, target, loss_fn)
    kw = {"split_points": UNET_SPLIT} if case == "unet" else {}
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=4, schedule=schedule, stages_per_rank=2,
                          checkpoint=checkpoint, devices=["cpu", "cpu:0", "cpu:0", "cpu"], **kw)
    if case == "unet":
        assert {(r.src, r.dst) for r in pipe.plan.skips} == {(0, 3)}  # routed past stages 1 and 2
        assert len(pipe.plan.stages[2].inputs) == 2  # the main path and level 1's skip, from stage 1
    want = [0, 1, 0, 1] if schedule == "interleaved" else [0, 1, 1, 0]
    assert [s.on_rank for s in pipe.plan.stages] == want
    loss = pipe.step(x, target=target, loss_fn=loss_fn)
    assert max_relative_error(loss, expected) < 1e-5
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name


def test_default_devices_put_a_rank_s_stages_together():
    model, x, _, _ = _unet()
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=2, schedule="interleaved", stages_per_rank=2)
    assert len({str(d) for d in pipe.devices}) == 1 or pipe.devices[0] == pipe.devices[2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_stages=6, schedule="zbv", stages_per_rank=3, chunks=4), "use stages_per_rank=2, not 3"),
    (dict(n_stages=4, schedule="1f1b", stages_per_rank=2, chunks=4), "runs one stage per rank"),
    (dict(n_stages=5, schedule="interleaved", stages_per_rank=2, chunks=4), "n_stages=5 is not a multiple of "
                                                                           "stages_per_rank=2"),
    (dict(n_stages=4, schedule="interleaved", stages_per_rank=0, chunks=4), "stages_per_rank=0"),
])
def test_bad_layouts_are_refused(kwargs, message):
    model, x, _, _ = _unet()
    n = kwargs.pop("n_stages")
    with pytest.raises(ValueError, match=None) as info:
        fxpipe.compile(model, n, example_inputs=(x,), devices=["cpu"] * n, **kwargs)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.filterwarnings("ignore:a batch of 1 row")
def test_a_batch_smaller_than_the_ranks_runs_and_equals_eager(schedule, caplog):
    # a DataLoader's last batch of one row on two ranks was refused ("needs at least 2 micro-batches")
    model, x, target, loss_fn = _unet()
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=2, schedule=schedule, stages_per_rank=2,
                          devices=["cpu"] * 4, split_points=UNET_SPLIT)
    for rows in (1, 6, 1):
        expected, grads = _eager_step(model, x[:rows], target[:rows], loss_fn)
        pipe.zero_grad()
        loss = pipe.step(x[:rows], target=target[:rows], loss_fn=loss_fn)
        assert max_relative_error(loss, expected) < 1e-5
        for name, p in model.named_parameters():
            assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    with caplog.at_level("WARNING"):  # chunks below the ranks is allowed, and said to waste the pipeline
        fxpipe.compile(model, 4, example_inputs=(x,), chunks=1, schedule=schedule, stages_per_rank=2,
                       devices=["cpu"] * 4, split_points=UNET_SPLIT)
    assert "fewer micro-batches than ranks leaves every rank idle most of the step; chunks=2" in caplog.text


def test_interleaved_with_one_stage_per_rank_is_said_to_run_as_1f1b(caplog):
    # it ran as plain 1F1B with no word (zbv with stages_per_rank=1 is refused)
    model, x, _, _ = _unet()
    with caplog.at_level("WARNING"):
        pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=4, schedule="interleaved", devices=["cpu"] * 4)
    assert "stages_per_rank=1 puts one stage on each rank and runs as 1F1B: pass stages_per_rank=2" in caplog.text
    assert [s.on_rank for s in pipe.plan.stages] == [0, 1, 2, 3]
