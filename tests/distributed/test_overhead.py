"""The runtime's per-step costs across ranks: receive buffers reused, small values in one message."""

import pytest


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_receive_buffers_are_reused_from_step_to_step(tmp_path, launch, schedule):
    results = launch("overhead_cases:reused_buffers", 2, schedule, tmp_path)
    for r, res in enumerate(results):
        assert max(res["errors"]) < 1e-5, (r, res["errors"])
        first, *later = res["allocated"]
        assert first > 0 and later == [first, first], (r, res["allocated"])  # none allocated after step 1


def test_small_values_of_any_length_cross_ranks(tmp_path, launch):
    results = launch("overhead_cases:small_values", 2, "1f1b", tmp_path)
    assert all(all(res["equal"]) for res in results), results
