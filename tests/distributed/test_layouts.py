"""fxpipe.simulate(pipe, measured=True) on every rank of every layout of 4 gloo ranks: it answers, the same on
every rank, and follows the layout (replicas, FSDP2 shards, several stages per rank, tensor parallelism)."""

import os

import pytest

pytestmark = pytest.mark.distributed

LAYOUTS = ["pp4@1f1b", "pp2xdp2@1f1b", "pp2xdp2:shard@1f1b", "pp2xdp2:v2@interleaved", "pp2:v2xdp2@zbv",
           "pp1xdp4@gpipe", "pp2:tp2@1f1b"]


def _ok(results):
    for r in results:
        assert r["ok"], r.get("traceback", r)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulate_measured_on_every_rank(layout, tmp_path, launch):
    results = launch("plan_cases:simulate_layout", 4, layout, tmp_path)
    _ok(results)
    first = results[0]
    assert all(r["step"] == first["step"] > 0 for r in results)  # rank 0 measured, every rank predicts alike
    assert all(r["links"] == first["links"] for r in results)  # the links measured, rank 0's fit everywhere
    assert all(0 < v < float("inf") for v in first["links"]) and first["links"][2] > 0  # tp_latency: measured
    assert 0.5 <= first["links"][4] <= min(4, len(os.sched_getaffinity(0)))  # slots: measured, at most the cores
    assert all(r["wake"] == first["wake"] for r in results) and 0 <= first["wake"] < 0.1  # a waiting rank's resumption
    assert all(r["scale"] == first["scale"] for r in results)  # reduce-scatter and all-gather against the ring
    assert set(first["scale"]) == {"reduce_scatter", "all_gather"} and all(v > 0 for v in first["scale"].values())
    dp = 4 if "dp4" in layout else 2 if "dp2" in layout else 1
    assert first["dp"] == dp and first["layout"]["data_parallel"] == dp
    assert first["shard"] == (":shard" in layout)
    assert first["tp"] == (2 if "tp2" in layout else 1)
    assert first["stages"] == (4 if "pp4" in layout or "v2" in layout else 2 if "pp2" in layout else 1)
    if ":shard" in layout:  # the gathered parameters plus the 1/dp shard: 1.5x the replicated ones
        again = next(r for r in results if r["ok"])
        assert again["params"][0] > 0


def test_sharing_is_measured_alike_on_every_rank_on_the_model_or_a_gemm_loop(launch, tmp_path):
    results = launch("plan_cases:sharing_both_ways", 4, "", tmp_path)
    _ok(results)
    cores = min(4, len(os.sched_getaffinity(0)))
    for key in ("model", "gemm"):  # the model's own passes; a GEMM loop for a model over the limit
        assert all(r[key] == results[0][key] for r in results)  # rank 0's, on every rank
        assert 0.5 <= results[0][key] <= cores


@pytest.mark.parametrize("wanted", ["dp2xpp2", "pp2xtp2", "pp2:v2xdp2"])
def test_the_written_plan_compiles_to_the_chosen_layout(wanted, tmp_path, launch):
    results = launch("plan_cases:written_plan", 4, wanted, tmp_path)
    _ok(results)
    for r in results:
        assert r["layout"] == r["chosen"]
        assert r["schedule"] == r["chosen_schedule"] and r["chunks"] == r["chosen_chunks"]
        assert r["same_split"] and r["ranks"] == r["chosen_ranks"] and r["policies"] == r["chosen_policies"]
