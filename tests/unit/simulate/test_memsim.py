"""Memory accounting per schedule against small cases computed by hand (bytes in units)."""

import pytest

from fxpipe.options import checkpoint_stop
from fxpipe.runtime.schedules.builtin import PRODUCERS as SCHEDULES
from fxpipe.simulate import eventsim, memsim
from fxpipe.runtime.schedules.actions import Action
from fxpipe.simulate.eventsim import Span
from fxpipe.simulate.stagecost import StageCost


def _walk(schedule, n, m, cost=None, checkpoint="never", device_of=None, optimizer="none", clocked=False):
    cost = cost or StageCost(1.0, 2.0, 1.0, kept=1.0)
    costs = [cost] * n
    device_of = device_of or list(range(n))
    spans = eventsim.run(SCHEDULES[schedule](n, m), lambda a: {"F": 1, "B": 2, "I": 1, "W": 1}[a.kind],
                         clocked=clocked, device_of=device_of)
    return memsim.walk(spans, costs, checkpoint_stop(checkpoint, m), device_of, optimizer)


def test_gpipe_holds_every_micro_batch():
    stages, _ = _walk("gpipe", 2, 4)
    assert [s.activations for s in stages] == [4, 4]


def test_1f1b_holds_n_minus_stage_micro_batches():
    stages, _ = _walk("1f1b", 4, 8)
    assert [s.activations for s in stages] == [4, 3, 2, 1]


def test_zero_bubble_holds_weight_stores_until_w():
    # stage 0: F0 F1 . I0 W0 F2 I1 W1 F3 I2 W2 I3 W3 -> live 1 2 | 1.5 1 2 1.5 1 2 1.5 1 .5 0
    # stage 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3   -> live 1 .5 1.5 1 .5 1.5 1 .5 1.5 1 .5 0
    stages, _ = _walk("zb", 2, 4, StageCost(1.0, 2.0, 1.0, kept=1.0, wstore=0.5))
    assert [s.activations for s in stages] == [2.0, 1.5]


@pytest.mark.parametrize("mode, peak", [("never", 4.0), ("except_last", 3 * 0.5 + 1 + 1), ("always", 4 * 0.5 + 1)])
def test_checkpointed_micro_batches_hold_inputs_and_recompute_in_backward(mode, peak):
    # except_last: after the forwards 3 inputs + 1 kept, then B0 recomputes 1 kept on top;
    # always: 4 inputs, then B0 recomputes 1 kept
    stages, _ = _walk("gpipe", 1, 4, StageCost(1.0, 2.0, 1.0, kept=1.0, inputs=0.5), checkpoint=mode)
    assert stages[0].activations == peak


def test_transient_workspace_counts_during_backward():
    stages, _ = _walk("gpipe", 1, 2, StageCost(1.0, 2.0, 1.0, kept=1.0, transient=0.25))
    assert stages[0].activations == 2.25


def test_stages_on_one_device_add_up_in_the_order_they_run():
    # GPipe: every forward of both stages before any backward: 2 x 1 + 2 x 2 on the device
    cost0, cost1 = StageCost(1.0, 2.0, 1.0, kept=1.0), StageCost(1.0, 2.0, 1.0, kept=2.0)
    spans = eventsim.run(SCHEDULES["gpipe"](2, 2), lambda a: 1.0, clocked=True, device_of=[0, 0])
    _, devices = memsim.walk(spans, [cost0, cost1], 0, [0, 0])
    assert devices[0].activations == 6
    # 1F1B by clocks: 0F0 | 0F1 1F0 | 1B0 | 0B0 1F1 | 1B1 | 0B1 -> live 1, 2, 4, 2, 1, 3, 1, 0
    spans = eventsim.run(SCHEDULES["1f1b"](2, 2), lambda a: 1.0, clocked=True, device_of=[0, 0])
    _, devices = memsim.walk(spans, [cost0, cost1], 0, [0, 0])
    assert devices[0].activations == 4


def test_growth_adds_gradients_from_the_first_backward_and_optimizer_state_counts():
    cost = StageCost(1.0, 2.0, 1.0, kept=1.0, params=10.0, grads=8.0)
    stages, devices = _walk("gpipe", 1, 2, cost, optimizer="adam")
    s = stages[0]
    assert (s.params, s.grads, s.optimizer, s.activations) == (10, 8, 16, 2)
    assert s.peak == 36 and s.growth == 2 + 8
    assert devices[0].peak == 36


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        _walk("gpipe", 1, 1, optimizer="lamb")


def test_messages_are_held_until_the_peer_has_them_not_to_the_end_of_the_step():
    # 1F1B on 2 ranks, 8 micro-batches: stage 0's sent outputs (part of what it keeps) go at
    # its backward, when their gradients are back; stage 1's sent gradients go once stage 0
    # has sent an input after starting that backward. Held to the step's end, stage 1 would
    # pile up 8 of them.
    costs = [StageCost(1.0, 2.0, 1.0, kept=1.0, pinned_f=0.5), StageCost(1.0, 2.0, 1.0, kept=1.0, pinned_b=1.0)]
    spans = eventsim.run(SCHEDULES["1f1b"](2, 8), lambda a: {"F": 1, "B": 2}[a.kind], device_of=[0, 1])
    stages, _ = memsim.walk(spans, costs, 0, [0, 1])
    assert stages[0].activations == 2.0  # two micro-batches in flight, their sent outputs among them
    assert stages[1].activations == 2.0  # one micro-batch kept, one gradient not yet known to have arrived


def _spans(*kinds):
    """Return one stage's spans running ``kinds`` ("F0", "I0", "W0", ...) one after another."""
    return [Span(Action(0, k[0], int(k[1:])), 0, t, t + 1.0) for t, k in enumerate(kinds)]


def test_a_later_backward_adds_a_fresh_weight_gradient_before_accumulating_it():
    # F0 B0 F1 B1: B0's weight gradient becomes .grad; B1's is made apart, then added into it
    cost = StageCost(1.0, 2.0, 1.0, kept=1.0, accumulate=0.5)
    stages, _ = memsim.walk(_spans("F0", "B0", "F1", "B1"), [cost], 0, [0])
    assert stages[0].activations == 1.5


def test_zero_bubble_makes_the_deferred_linears_gradients_at_the_first_w():
    # I makes the gradients of what it does not defer (1 of 4), the first W the deferred linears' (3),
    # adding into them in place: W1 makes no fresh gradient
    cost = StageCost(1.0, 2.0, 1.0, kept=1.0, wstore=0.5, grads=4.0, grads_w=3.0, accumulate=3.0, accumulate_i=0.25)
    stages, _ = memsim.walk(_spans("F0", "F1", "I0", "I1", "W0", "W1"), [cost], 0, [0])
    # after I1: 2 stores (1.0) + 1 of gradients, I1 with 1 kept and a fresh 0.25; then W0: 1.0 + 4
    assert stages[0].growth == 5.0
    stages, _ = memsim.walk(_spans("F0", "F1", "I0", "I1"), [cost], 0, [0])
    assert stages[0].growth == 2.0 + 1.0  # F0 F1, then I0 with its kept: no deferred gradient yet


def test_pooled_receive_buffers_are_there_before_the_step_and_at_its_peak():
    # stage 1 keeps 1 per micro-batch, 0.25 of it the input it received (a pooled buffer on CPU)
    costs = [StageCost(1.0, 2.0, 1.0, kept=1.0), StageCost(1.0, 2.0, 1.0, kept=1.0, ahead_f=0.25)]
    spans = eventsim.run(SCHEDULES["gpipe"](2, 2), lambda a: 1.0, device_of=[0, 1])
    plain, _ = memsim.walk(spans, costs, 0, [0, 1])
    pooled, _ = memsim.walk(spans, costs, 0, [0, 1], pooled=True)
    assert plain[1].growth == 2.0  # two micro-batches kept
    assert pooled[1].growth == 1.5  # less their two inputs, in buffers there before the step
    assert pooled[1].activations == 1.5 + 0.5  # the pool's buffers count at the peak
