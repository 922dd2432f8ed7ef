"""The cut solver is exact: it matches brute force over every contiguous cut, memory cap included."""

import itertools

import pytest
from fxpipe.passes.cut import NoFeasibleCut, group_costs, least_memory, min_bottleneck_cut
from hypothesis import given, settings
from hypothesis import strategies as st


def _brute(c, w, k, beta, m=None, phi=0.0, cap=None, rho=0.0):
    """Return the least largest group cost over all cuts within the cap (None if none fits)."""
    n, best = len(c), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        if cap is not None and any(sum(m[bounds[j]:bounds[j + 1]]) + phi * w[bounds[j]] > cap
                                   for j in range(k)):
            continue
        worst = 0.0
        for j in range(k):
            a, b = bounds[j], bounds[j + 1]
            cost = sum(c[a:b]) + (beta[j - 1] * w[a] if j > 0 else 0) + (beta[j] * w[b] if j < k - 1 else 0)
            cost += rho * w[a]
            worst = max(worst, cost)
        best = worst if best is None else min(best, worst)
    return best


@st.composite
def problems(draw, with_cap=False):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, n))
    c = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    w = draw(st.lists(st.integers(0, 60), min_size=n + 1, max_size=n + 1))
    beta = draw(st.lists(st.sampled_from([0, 0.5, 1, 2, 5]), min_size=k - 1, max_size=k - 1))
    if not with_cap:
        return c, w, k, beta, draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
    m = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    phi = draw(st.sampled_from([0.0, 0.5, 1.0]))
    cap = draw(st.integers(0, 80))
    return c, w, k, beta, m, phi, cap


@settings(max_examples=300, deadline=None)
@given(problems())
def test_matches_brute_force(problem):
    c, w, k, beta, rho = problem
    starts = min_bottleneck_cut(c, w, k, beta=beta, rho=rho)
    assert len(starts) == k and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
    assert max(group_costs(c, w, starts, beta, rho)) == pytest.approx(_brute(c, w, k, beta, rho=rho), rel=1e-9)


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
@settings(max_examples=300, deadline=None)
@given(problems(with_cap=True))
def test_memory_cap_respected_or_refused(problem):
    c, w, k, beta, m, phi, cap = problem
    best = _brute(c, w, k, beta, m, phi, cap)
    if best is None:
        with pytest.raises(NoFeasibleCut, match="no cut into") as info:
            min_bottleneck_cut(c, w, k, beta=beta, m=m, phi=phi, cap=cap)
        assert info.value.least > cap
        assert info.value.least == pytest.approx(least_memory(m, w, k, phi), rel=1e-9)
        return
    starts = min_bottleneck_cut(c, w, k, beta=beta, m=m, phi=phi, cap=cap)
    bounds = starts + [len(c)]
    for j in range(k):
        assert sum(m[bounds[j]:bounds[j + 1]]) + phi * w[bounds[j]] <= cap + 1e-9
    assert max(group_costs(c, w, starts, beta)) == pytest.approx(best, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(problems(with_cap=True))
def test_least_memory_is_the_smallest_cap_that_fits(problem):
    _, w, k, _, m, phi, _ = problem
    least = least_memory(m, w, k, phi)
    zero = [0] * len(m)
    assert _brute(zero, w, k, [0] * (k - 1), m, phi, least + 1e-9) is not None
    assert _brute(zero, w, k, [0] * (k - 1), m, phi, least - 1e-6) is None


def test_communication_moves_the_cut_to_a_narrow_place():
    # equal compute; the cut before item 2 carries 100 bytes, before item 3 only 1
    c, w = [10, 10, 10, 10], [0, 50, 100, 1, 0]
    assert min_bottleneck_cut(c, w, 2) == [0, 2]
    assert min_bottleneck_cut(c, w, 2, beta=1.0) == [0, 3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="cannot cut 2 items into 3 non-empty groups"):
        min_bottleneck_cut([1, 2], [0, 0, 0], 3)
    with pytest.raises(ValueError, match="give n \\+ 1 of them"):
        min_bottleneck_cut([1, 2], [0, 0], 2)
    with pytest.raises(ValueError, match="give k - 1 of them"):
        min_bottleneck_cut([1, 2, 3], [0, 0, 0, 0], 2, beta=[1, 2])


def test_joined_positions_start_no_group():
    c = [1.0] * 8
    w = [0.0] * 9
    assert min_bottleneck_cut(c, w, 4) == [0, 2, 4, 6]
    starts = min_bottleneck_cut(c, w, 4, joined={2, 3, 6})  # items 1-3 and 5-6 stay together
    assert not set(starts) & {2, 3, 6} and len(starts) == 4 and starts[0] == 0
    with pytest.raises(ValueError, match="only 3 places to start a group, for 4 groups"):
        min_bottleneck_cut(c, w, 4, joined={1, 2, 3, 5, 6})
