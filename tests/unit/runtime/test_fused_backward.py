"""An I directly followed by its W runs as one backward; a W deferred past other actions waits."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.interpreter import fused_pairs
from fxpipe.runtime.schedules.actions import parse
from fxpipe.runtime.stage.worker import StageWorker
from fxpipe.testing import max_relative_error


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])


def _queued(monkeypatch):
    """Record, per (stage, micro-batch), how many weight gradients each W found queued."""
    found = {}
    weights = StageWorker.weights

    def recording(self, i):
        found[(self.index, i)] = len(self._weights.get(i, []))
        weights(self, i)
    monkeypatch.setattr(StageWorker, "weights", recording)
    return found


def _step_equals_eager(schedule):
    model = _model()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    F.mse_loss(eager(x), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule=schedule, devices=["cpu"] * 2)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5
    return pipe


def test_zero_bubble_fuses_the_first_stage_only(monkeypatch):
    found = _queued(monkeypatch)
    pipe = _step_equals_eager("zb")
    assert "0I0 0W0" in pipe.code  # the program is unchanged: the W still runs, finding nothing left
    assert all(found[(0, i)] == 0 for i in range(4))  # stage 0: I0 W0 ... nothing between, fused
    assert all(found[(1, i)] > 0 for i in range(4))  # stage 1 sends its input gradients before its W


def test_a_w_after_another_action_is_deferred(monkeypatch):
    found = _queued(monkeypatch)
    _step_equals_eager("0F0 0F1 0F2 0F3 0I0 0I1 0W0 0W1 0I2 0W2 0I3 0W3\n1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3")
    assert found[(0, 0)] > 0 and found[(0, 1)] > 0  # I0 I1 W0 W1: W0 waited past I1
    assert found[(0, 2)] == 0 and found[(0, 3)] == 0


def test_fused_pairs_reads_each_stage_s_own_order():
    clocked = [[list(row)] for row in parse("0I0 1F0 0W0 0I1 0SEND_B1 0W1 1I0 1W0 1W1")]
    assert fused_pairs(clocked) == {0: frozenset({0}), 1: frozenset({0})}
