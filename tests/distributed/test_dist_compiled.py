"""Compiled stages (torch_compile=) across gloo ranks: every schedule, and under data parallel, equal eager."""

import pytest
from checks import assert_equal_to_eager


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
def test_compiled_stages_on_two_ranks_equal_eager(schedule, tmp_path, launch):
    results = launch("compiled_cases:schedule", 2, schedule, tmp_path, limit=180)
    assert_equal_to_eager(results)
    for rank, res in enumerate(results):
        per_rank = 2 if schedule in ("interleaved", "zbv") else 1
        assert len(res["compiled"]) == per_rank, (rank, res["compiled"])  # this rank's stages, each compiled
        assert all(res["split"].values()) == (schedule in ("zb", "zbv")), (rank, res["split"])
        assert res["keys"] == []


@pytest.mark.parametrize("schedule", ["zb", "zb:shard"])
def test_compiled_stages_under_data_parallel_equal_eager(schedule, tmp_path, launch):
    results = launch("compiled_cases:data_parallel", 4, schedule, tmp_path, limit=240)
    assert_equal_to_eager(results)
    for res in results:
        assert len(res["compiled"]) == 1 and res["keys"] == []
