"""Schedules as action lists: GPipe, 1F1B and zero bubble (ZB-H1)."""

import pytest

from fxpipe.runtime.schedules.actions import Action, clocks, in_flight
from fxpipe.runtime.schedules.builtin import one_f_one_b, zero_bubble

SIZES = [(1, 1), (1, 4), (2, 1), (2, 8), (3, 2), (3, 8), (4, 8), (4, 16), (8, 8), (8, 32)]


@pytest.mark.parametrize("n,m", SIZES)
def test_zero_bubble_runs_every_step_once_with_w_after_i(n, m):
    for j, actions in enumerate(zero_bubble(n, m)):
        assert sorted(map(str, actions)) == sorted(f"{j}{k}{i}" for k in "FIW" for i in range(m))
        assert all(a.stage == j for a in actions)
        at = {str(a): k for k, a in enumerate(actions)}
        assert all(at[f"{j}I{i}"] < at[f"{j}W{i}"] for i in range(m))


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("n,m", SIZES)
def test_zero_bubble_keeps_1f1b_order_with_extra_warm_up_forwards(n, m, extra):
    zb, base = zero_bubble(n, m, extra_warmup=extra), one_f_one_b(n, m)
    if extra == 0:  # the paper's ZB-H1: 1F1B's order, its backwards as input-gradient steps
        assert [[a for a in row if a.kind != "W"] for row in zb] == \
            [[Action(a.stage, "I" if a.kind == "B" else a.kind, a.mb) for a in row] for row in base]
    for j in range(n):
        fb = [f"{a.kind}{a.mb}" for a in zb[j] if a.kind != "W"]
        w = min(n - j - 1 + extra if j < n - 1 else 0, m)  # 1F1B's warm-up is n - j - 1
        pairs = [name for k in range(m - w) for name in (f"F{w + k}", f"I{k}")]
        assert fb == [f"F{i}" for i in range(w)] + pairs + [f"I{i}" for i in range(m - w, m)]
        assert in_flight(zb[j]) <= in_flight(base[j]) + extra
        held = peak = 0  # micro-batches whose W has not run
        for a in zb[j]:
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= n + extra


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("n,m", SIZES)
def test_zero_bubble_fills_the_bubble(n, m, extra):
    """With unit F, B and W and m >= n, ZB-H1 takes 3m + n - 1 units; 1F1B (B+W as one) 3(m + n - 1)."""
    at = clocks(zero_bubble(n, m, extra_warmup=extra))
    one_f_one_b_units = 3 * (m + n - 1)
    if m >= n:
        assert max(at.values()) + 1 == 3 * m + n - 1
    else:  # too few W to fill the warm-down
        assert max(at.values()) + 1 <= one_f_one_b_units


def test_clocks_places_w_after_its_stage_s_i():
    at = clocks(zero_bubble(2, 2))
    assert at[Action(1, "W", 0)] > at[Action(1, "I", 0)]
    assert at[Action(0, "I", 0)] > at[Action(1, "I", 0)]
