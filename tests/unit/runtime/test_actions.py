"""Schedules as data: typed actions, their text, the checks, and users' own schedules run as given."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import TiedTransformer, token_loss
from schedules import CUSTOM
from unet import UNet

import fxpipe
from fxpipe.runtime.schedules.actions import Action, check, clocks, format_schedule, load_schedule, lower, parse
from fxpipe.runtime.schedules.builtin import PRODUCERS as SCHEDULES
from fxpipe.testing import max_relative_error

# 1F1B for 2 stages and 3 micro-batches, stage 0 splitting its backward into I and W


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (3, 8), (4, 4)])
def test_text_round_trip_of_every_schedule(name, n, m):
    actions = SCHEDULES[name](n, m)
    text = format_schedule(actions)
    assert parse(text) == actions
    assert text.splitlines()[0].split()[0] == "0F0"
    check(actions, n, m)


def test_tokens_name_stage_kind_and_micro_batch():
    assert str(Action(0, "F", 3)) == "0F3" and str(Action(2, "SEND_B", 1)) == "2SEND_B1"
    assert parse("2RECV_F11 2I11 2W11") == [[Action(2, "RECV_F", 11), Action(2, "I", 11), Action(2, "W", 11)]]
    assert load_schedule([["0F0", Action(0, "B", 0)]]) == [[Action(0, "F", 0), Action(0, "B", 0)]]


def test_lowering_adds_messages_around_compute():
    row = [Action(1, "F", 0), Action(1, "B", 0)]
    got = lower(row, {1: True}, {1: True}, {1: True}, {1: False})
    assert list(map(str, got)) == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_B0", "1B0"]


@pytest.mark.parametrize("text,message", [
    ("0F0 0B0\n1B0 1F0", "the schedule can never finish: 1B0 (action 0 of rank 1) waits for 1F0, "
                         "which comes after it on rank 1; put 1F0 first"),
    ("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1", "0B0 (action 1 of rank 0) waits for 1B0 or 1I0, and the waits "
                                          "go round in a circle (0B0 -> 1F1 -> 0B0)"),
    ("0W0 0F0 0I0\n1F0 1B0", "0W0 (action 0 of rank 0) waits for 0B0 or 0I0, which comes after it"),
    ("0F0 0B0\n1F0", "stage 1 never runs the backward of micro-batch 0: add 1B0 (or 1I0 and 1W0)"),
    ("0F0 0B0 0F0\n1F0 1B0", "0F0 appears twice"),
    ("0F0 0B0 0W0\n1F0 1B0", "has both 0B0 (the full backward) and 0I0/0W0"),
    ("0F0 0I0\n1F0 1B0", "0I0 needs its other half 0W0"),
    ("0F0 0B0\n1F0 1B0\n2F0 2B0", "names stage 2, but the pipeline has 2 stages"),
    ("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1", "runs 2 micro-batches (0..1) but a step has 1: compile with chunks=2"),
    ("0F0 0W0\n1F0 1B0", "0W0 needs its other half 0I0 (the input gradient, before it), or give the whole backward as 0B0"),
    ("0F0 0SEND_F0 0B0\n1F0 1B0", "the runtime adds the sends and receives"),
])
def test_bad_schedules_are_refused_naming_the_action(text, message):
    m = 1 if "a step has 1" in message else 1 + max(a.mb for row in parse(text) for a in row)
    with pytest.raises(fxpipe.ScheduleError) as info:
        check(parse(text), 2, m)
    assert message in str(info.value), str(info.value)


def test_text_that_is_not_an_action_is_refused_naming_the_token():
    # the kinds listed were F, B, I, W and the sends and receives, which check() then refused
    with pytest.raises(fxpipe.ScheduleError, match=r"line 2: '0X0' is not an action; write <stage><kind><micro-batch> "
                                                   r"with kind one of F, B, I, W, e.g. '0F3' \(the runtime adds"):
        parse("0F0\n0X0")


@pytest.mark.parametrize("text, m, first", [
    ("0F0 0F1 0F5 0B0 0B1 0B5\n1F0 1B0 1F1 1B1 1F5 1B5", 3, "0F5"),  # 5 for 2 on both stages
    ("0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1B0 1F1 1B1 1F3 1B3", 3, "1F3"),  # 3 for 2 on one stage
    ("0F0 0F1 0F2 0F5 0B0 0B1 0B2 0B5\n1F0 1B0 1F1 1B1 1F2 1B2 1F5 1B5", 3, "0F5"),  # one too many, with a gap
])
def test_a_micro_batch_number_mistyped_is_named_not_chunks(text, m, first):
    # 0F5 for 0F2 at chunks=3 said "compile with chunks=6", which then refused the missing micro-batches 2..4
    with pytest.raises(fxpipe.ScheduleError, match=rf"^{first} names micro-batch \d, but a step has {m} \(0..{m - 1}\) "
                                                   rf"and the stages do not all run micro-batches 0..\d: number them "
                                                   rf"0..{m - 1}, or drop the actions of micro-batches past "
                                                   rf"{m - 1}$"):
        check(parse(text), 2, m)


def test_a_stage_the_pipeline_lacks_is_named_before_the_micro_batches():
    # a row for stage 2 of 2 was first told "compile with chunks=2", then that stage 2 does not exist
    with pytest.raises(fxpipe.ScheduleError, match=r"^2F0 names stage 2, but the pipeline has 2 stages"):
        check(parse("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n2F0 2B0 2F1 2B1"), 2, 1)


def test_at_one_micro_batch_a_mistyped_number_is_told_to_drop_it_only():
    # "number them 0..0" of two forwards would only repeat them
    with pytest.raises(fxpipe.ScheduleError, match=r"stages do not all run micro-batches 0..1: drop the actions of "
                                                   r"micro-batches past 0$"):
        check(parse("0F0 0F1 0B0 0B1"), 2, 1)


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_schedule_text_is_refused_as_empty(text):
    # "schedule='' is neither a known schedule nor a readable file of actions (No such file or directory)"
    with pytest.raises(fxpipe.ScheduleError, match="the schedule is empty; give one line of actions per rank"):
        load_schedule(text)


def test_a_schedule_leaving_a_stage_out_is_not_told_a_chunks():
    # a stage without actions counted as running every micro-batch: "compile with chunks=2", then "add 1F0"
    with pytest.raises(fxpipe.ScheduleError, match=r"^stage \d never runs the forward of micro-batch \d: add") as info:
        check(parse("0F0 0F1 0B0 0B1"), 2, 3)
    assert "chunks=" not in str(info.value)


def test_clocks_of_a_deadlock_free_custom_schedule():
    at = clocks(parse(CUSTOM))
    assert at[Action(1, "F", 0)] == 1 and at[Action(1, "B", 0)] == 2 and at[Action(0, "I", 0)] == 3


def _step_equals_eager(schedule, chunks=3, **kw):
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens, target = torch.randint(0, 32, (6, 8)), torch.randint(0, 32, (6, 8))

    eager = copy.deepcopy(model)
    expected = token_loss(eager(tokens), target)
    expected.backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=chunks, schedule=schedule,
                          devices=["cpu"] * 2, **kw)
    loss = pipe.step(tokens, target=target, loss_fn=token_loss)
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    return pipe


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_a_custom_schedule_from_text_runs_as_given_and_equals_eager(checkpoint):
    pipe = _step_equals_eager(CUSTOM, checkpoint=checkpoint)
    assert pipe.plan.schedule == "custom"
    lines = pipe.code.splitlines()  # what step runs: per clock, each stage's actions with its messages
    assert "0F1 0SEND_F1 | 1RECV_F0 1F0    # clock 1" in lines
    assert "0RECV_B0 0I0 | 1RECV_F1 1F1    # clock 3" in lines and "0W2    # clock 10" in lines


def test_a_custom_schedule_from_a_file_and_from_lists(tmp_path):
    path = tmp_path / "sched.txt"
    path.write_text(CUSTOM)
    _step_equals_eager(str(path))
    _step_equals_eager(path)  # a path object too
    _step_equals_eager([row.split() for row in format_schedule(parse(CUSTOM)).splitlines()])
    with pytest.raises(fxpipe.ScheduleError, match="is not a readable file of actions"):
        load_schedule(tmp_path / "missing.txt")


def test_a_custom_schedule_must_cover_chunks():
    # a schedule for 3 micro-batches at chunks=4 was told to add 0F3, and at chunks=2 to use chunks=3 "or more"
    with pytest.raises(fxpipe.ScheduleError, match=r"runs 3 micro-batches \(0..2\) but a step has 4: compile with "
                                                   r"chunks=3"):
        _step_equals_eager(CUSTOM, chunks=4)
    with pytest.raises(fxpipe.ScheduleError, match="use one of 'gpipe', '1f1b', 'zb', 'interleaved', 'zbv', or your own"):
        _step_equals_eager("looped-bfs")


def test_a_custom_schedule_refuses_a_smaller_batch():
    pipe = fxpipe.compile(UNet(depth=2, base=4).eval(), 2, example_inputs=(torch.randn(6, 3, 8, 8),),
                          chunks=3, schedule=CUSTOM, devices=["cpu"] * 2)
    import warnings

    with pytest.raises(fxpipe.ScheduleError, match="has 3 micro-batches but this step has 2"), \
            warnings.catch_warnings():
        warnings.simplefilter("error")  # it warned first that the batch runs as 2 micro-batches, which it did not
        pipe.step(torch.randn(2, 3, 8, 8), target=torch.randn(2, 2, 8, 8), loss_fn=F.mse_loss)


def test_one_line_of_actions_with_a_bad_token_names_the_token():
    with pytest.raises(fxpipe.ScheduleError, match="line 1: '0X0' is not an action"):
        load_schedule("0X0 0F1 0B0 0B1")  # one line: text, not the path of a file


def test_an_unknown_schedule_name_lists_the_names_in_compile_and_simulate():
    model = UNet(depth=2, base=4).eval()
    with pytest.raises(fxpipe.ScheduleError, match="schedule='pipedream'; use one of 'gpipe', '1f1b'"):
        fxpipe.compile(model, 2, devices=["cpu"] * 2, schedule="pipedream")
    with pytest.raises(fxpipe.ScheduleError, match="schedule=None; use one of 'gpipe', '1f1b'"):
        fxpipe.compile(model, 2, devices=["cpu"] * 2, schedule=None)  # was: 'NoneType' object is not iterable
    pipe = fxpipe.compile(model, 2, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.ScheduleError, match="schedule='pipedream'; use one of 'gpipe', '1f1b'"):
        fxpipe.simulate(pipe.plan, schedule="pipedream", device="h100")
