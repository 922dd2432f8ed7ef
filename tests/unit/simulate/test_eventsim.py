"""The simulator reproduces the schedules' analytic step times with unit costs."""

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.runtime.schedules.actions import Action, parse
from fxpipe.runtime.schedules.builtin import MULTI_PRODUCERS as MULTI
from fxpipe.runtime.schedules.builtin import PRODUCERS as SCHEDULES
from fxpipe.simulate.eventsim import run


def _step(actions, costs, **kw):
    return max(s.end for s in run(actions, lambda a: costs[a.kind], **kw))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("f, b", [(1, 1), (1, 2), (2, 3)])
def test_gpipe_and_1f1b_take_m_plus_n_minus_1_times_f_plus_b(schedule, n, m, f, b):
    assert _step(SCHEDULES[schedule](n, m), {"F": f, "B": b}) == (m + n - 1) * (f + b)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_zero_bubble_takes_3m_plus_n_minus_1_units(n, m):
    if m < n:
        pytest.skip("ZB-H1's 3m + n - 1 holds for m >= n")
    assert _step(SCHEDULES["zb"](n, m), {"F": 1, "I": 1, "W": 1}) == 3 * m + n - 1


def test_zero_bubble_beats_1f1b_by_the_weight_steps_it_moves_into_the_bubble():
    n, m = 4, 8
    one_f_one_b = _step(SCHEDULES["1f1b"](n, m), {"F": 1, "B": 2})
    zb = _step(SCHEDULES["zb"](n, m), {"F": 1, "I": 1, "W": 1})
    assert one_f_one_b - zb == 2 * (n - 1)  # 3(m + n - 1) - (3m + n - 1)


@pytest.mark.parametrize("n, v, m", [(2, 2, 4), (4, 2, 8)])
def test_interleaved_1f1b_bubble_shrinks_by_the_stages_per_rank(n, v, m):
    # Interleaved 1F1B (Narayanan et al., 2021): n ranks, v stages per rank ("loop" placement),
    # each stage 1/v of a rank's work: (m + (n - 1) / v) (F + B) with F, B a whole rank's times.
    actions = MULTI["interleaved"](n * v, m, n)
    rank_of = [s % n for s in range(n * v)]
    step = _step(actions, {"F": 1 / v, "B": 2 / v}, rank_of=rank_of, n_stages=n * v)
    assert step == pytest.approx((m + (n - 1) / v) * 3)


def test_message_delay_counts_only_between_ranks():
    actions = SCHEDULES["gpipe"](2, 1)  # F0 on 0, F0 on 1, B0 on 1, B0 on 0
    far = _step(actions, {"F": 1, "B": 1}, delay=lambda src, dst, kind, mb: 0.5)
    assert far == 4 + 2 * 0.5  # one send of values, one of gradients
    near = _step(actions, {"F": 1, "B": 1}, delay=lambda src, dst, kind, mb: 0.5, rank_of=[0, 0])
    assert near == 4


def test_one_device_runs_the_clock_s_actions_in_turn():
    actions = SCHEDULES["1f1b"](4, 8)
    costs = {"F": 1, "B": 2}
    assert _step(actions, costs, clocked=True, device_of=[0, 0, 0, 0]) == 4 * 8 * 3
    assert _step(actions, costs, clocked=True, device_of=[0, 1, 2, 3]) >= (8 + 4 - 1) * 3


def test_several_stages_per_rank_run_in_the_rank_s_order():
    # 2 ranks, 4 stages, "loop": stage s on rank s % 2; rank 0 runs stages 0 and 2
    rows = parse("0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0")
    spans = run(rows, lambda a: 1.0, n_stages=4, rank_of=[0, 1, 0, 1])
    at = {str(s.action): (s.start, s.rank) for s in spans}
    assert at["2F0"] == (2.0, 0) and at["3F0"] == (3.0, 1) and at["1B0"] == (6.0, 1)
    assert max(s.end for s in spans) == 8.0


def test_a_schedule_that_cannot_finish_is_refused():
    with pytest.raises(ScheduleError, match="can never finish"):
        run([[Action(0, "B", 0), Action(0, "F", 0)]], lambda a: 1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_ranks_with_a_processor_each_run_as_if_unshared(schedule):
    costs = {"F": 1, "B": 2, "I": 1, "W": 1}
    alone = run(SCHEDULES[schedule](4, 8), lambda a: costs[a.kind])
    shared = run(SCHEDULES[schedule](4, 8), lambda a: costs[a.kind], slots=4)
    assert [(s.action, s.start, s.end) for s in shared] == [(s.action, s.start, s.end) for s in alone]


def test_two_ranks_busy_on_one_processor_each_take_twice_as_long():
    rows = [[Action(0, "F", 0)], [Action(1, "F", 0)]]
    spans = run(rows, lambda a: 1.0, feeds=[[], []], reads=[[], []], slots=1)
    assert [(s.start, s.end) for s in spans] == [(0.0, 2.0), (0.0, 2.0)]


def test_a_rank_alone_gets_its_processor_back_when_the_other_finishes():
    rows = [[Action(0, "F", 0)], [Action(1, "F", 0)]]
    spans = run(rows, lambda a: float(a.stage + 1), feeds=[[], []], reads=[[], []], slots=1)
    assert sorted((s.action.stage, s.end) for s in spans) == [(0, 2.0), (1, 3.0)]  # 1 s shared, then alone


def test_processes_per_rank_count_against_the_processors():
    rows = [[Action(0, "F", 0)], [Action(1, "F", 0)]]
    spans = run(rows, lambda a: 1.0, feeds=[[], []], reads=[[], []], slots=2, weight=2)  # 4 processes, 2 cores
    assert [s.end for s in spans] == [2.0, 2.0]


def test_a_held_rank_takes_no_processor_and_its_next_action_waits():
    rows = [[Action(0, "F", 0), Action(0, "F", 1)], [Action(1, "F", 0)]]
    hold = lambda a, seconds: 2.0 if a == Action(0, "F", 0) else 0.0  # noqa: E731 - waits 2 s on a collective
    spans = run(rows, lambda a: float(1 + 2 * a.stage), feeds=[[], []], reads=[[], []], slots=1, hold=hold)
    at = {(s.action.stage, s.action.mb): (s.start, s.end) for s in spans}
    assert at[(0, 0)] == (0.0, 4.0)  # 1 s of work shared (2 s), then held 2 s
    assert at[(1, 0)] == (0.0, 4.0)  # 1 s shared, then its other 2 s alone while rank 0 is held
    assert at[(0, 1)] == (4.0, 5.0)  # after the hold, alone
    plain = run(rows, lambda a: 1.0, feeds=[[], []], reads=[[], []], hold=hold)  # each rank its own processor
    assert [(s.start, s.end) for s in plain if s.action.stage == 0] == [(0.0, 3.0), (3.0, 4.0)]


def test_a_chain_that_never_overlaps_loses_nothing_to_sharing():
    assert _step(SCHEDULES["gpipe"](4, 1), {"F": 1, "B": 2}, slots=1) == 4 * 3


def test_one_processor_runs_the_whole_work_back_to_back():
    assert _step(SCHEDULES["1f1b"](4, 8), {"F": 1, "B": 2}, slots=1) == pytest.approx(4 * 8 * 3)
    assert _step(SCHEDULES["1f1b"](4, 8), {"F": 1, "B": 2}, slots=2) < 4 * 8 * 3


@pytest.mark.parametrize("slots", [0.0, 4.0, 1.0])
def test_a_rank_that_waited_for_a_message_resumes_after_waking(slots):
    # GPipe over 2 ranks, 1 micro-batch: F0 -> F1 -> B1 -> B0; rank 1 waits for F0 and rank 0 for B1
    rows = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    spans = {(s.action.stage, s.action.kind): s for s in run(rows, lambda a: 1.0, slots=slots, wake=0.25)}
    assert spans[1, "F"].start == 1.25  # waited for stage 0's output
    assert spans[1, "B"].start == 2.25  # its own F ended: nothing to wait for, no waking
    assert spans[0, "B"].start == 3.5
    assert run(rows, lambda a: 1.0, slots=slots)[-1].end == 4.0  # no waking: back to back
