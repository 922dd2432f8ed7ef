"""Selective recomputation, a policy per stage, and checkpoint="auto" across 2 gloo ranks."""

import pytest
from checks import assert_equal_to_eager

from fxpipe.options import POLICIES


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_selective_equal_to_eager(schedule, tmp_path, launch):
    results = launch("memory_cases:selective", 2, schedule, tmp_path)
    assert_equal_to_eager(results)
    assert set(results[0]["policies"]) == {"selective"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_a_policy_per_stage_equal_to_eager(schedule, tmp_path, launch):
    results = launch("memory_cases:per_stage", 2, schedule, tmp_path)
    assert_equal_to_eager(results)
    assert results[0]["policies"][:2] == ["selective", "always"]


def test_recomputation_replays_dropout_on_every_rank(tmp_path, launch):
    # the same seed per rank, with and without selective recomputation: the same loss and gradients
    results = launch("memory_cases:replay", 2, "1f1b", tmp_path)
    assert_equal_to_eager(results)


def test_auto_fits_the_budget_and_recomputes_more_on_the_first_rank(tmp_path, launch):
    results = launch("memory_cases:auto", 2, "1f1b", tmp_path)
    assert_equal_to_eager(results)
    res = results[0]
    assert res["policies"] == results[1]["policies"]  # every rank chose alike
    assert all(peak <= res["budget"] for peak in res["peaks"])
    first, last = (POLICIES.index(p) for p in res["policies"])
    assert first >= last and first > 0  # 1F1B's first rank holds two micro-batches, the last one
    assert max(res["never"]) > res["budget"]  # without recomputation it would not fit
