"""The cluster search: what it tries, what it rejects and why, and that pruning keeps the fastest."""

import pytest
import torch
from torch import nn

from fxpipe.simulate.cluster import cluster_search
from fxpipe.simulate.layouts import shapes


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)])


def test_layouts_split_every_gpu_and_keep_tp_inside_a_node():
    found = list(shapes(64, 8, 512, 100))
    assert all(s.dp * s.pp * s.tp == 64 and s.tp <= 8 for s in found)
    assert {s.v for s in found} == {1, 2, 4} and {"interleaved", "zbv", "zb"} <= {s.schedule for s in found}
    assert all(s.chunks >= s.pp for s in found)  # fewer micro-batches than ranks leave ranks idle
    assert any(s.shard for s in found) and any(not s.shard and s.dp > 1 for s in found)


def test_an_over_budget_layout_is_rejected_naming_what_overflows():
    x = torch.randn(32, 64)
    params = sum(p.numel() * 4 for p in _mlp().parameters())
    found = cluster_search(_mlp(), (x,), gpus=4, gpus_per_node=4, device="h100", memory=params * 3,
                           optimizer="adam")
    state_only = [c for c in found.rejected if c.sim is None]
    assert state_only and all("parameters, gradients and optimizer state alone" in c.overflow for c in state_only)
    assert any(c.shape.dp == 4 and not c.shape.shard for c in state_only)  # 4 bytes x 4 (adam) per parameter
    assert found.ranked and all(c.peak <= params * 3 for c in found.ranked)
    simulated = [c for c in found.rejected if c.sim is not None]
    assert all(c.overflow.startswith("rank ") and "activations" in c.overflow for c in simulated)


def test_pruning_keeps_the_fastest_layout():
    x = torch.randn(32, 64)
    pruned = cluster_search(_mlp(), (x,), gpus=8, gpus_per_node=4, device="h100", batch=64, keep=3)
    full = cluster_search(_mlp(), (x,), gpus=8, gpus_per_node=4, device="h100", batch=64, keep=10_000)
    assert pruned.simulated < full.simulated and pruned.bounded > 0
    assert pruned.best.sim.step_time == pytest.approx(full.best.sim.step_time)
    assert [c.shape for c in pruned.ranked[:3]] == [c.shape for c in full.ranked[:3]]


def test_a_tie_on_one_rank_under_data_parallel_is_rejected_as_compile_would():
    # ZB-V puts the first and the last stage on rank 0: the embedding and its tied head
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 16))
    model[-1].weight = model[0].weight
    found = cluster_search(model, (torch.randint(0, 16, (16, 3)),), gpus=4, gpus_per_node=4, device="h100",
                           schedules=["zbv"], checkpoints=["never"])
    assert not [c for c in found.ranked if c.shape.dp > 1 and c.shape.v > 1]
    assert not [c for c in found.rejected if c.shape.dp > 1 and c.shape.v > 1]  # not over the memory budget
    reasons = [c.overflow for c in found.refused if c.shape.dp > 1 and c.shape.v > 1]
    assert reasons and all("a tensor shared by stages 0 and 3, both on rank 0, under data parallel" in r
                           for r in reasons)
    assert [c for c in found.ranked if c.shape.dp == 1 and c.shape.v > 1]  # without replicas it is fine
    assert {c.shape.schedule for c in found.ranked + found.rejected} == {"zbv"}  # pp1 (1F1B) was listed too


def test_a_tensor_parallel_size_the_model_cannot_take_is_refused_naming_the_sizes_that_fit():
    # a size the automatic TP plan does not split over was a KeyError from the search
    with pytest.raises(ValueError, match=r"tensor_parallel=3: the automatic TP plan cannot split this model over 3 "
                                         r"ranks .* sizes that fit: \[1, 2, 4\]"):
        cluster_search(_mlp(), (torch.randn(32, 64),), gpus=4, gpus_per_node=4, device="h100", tensor_parallel=[3])


def test_the_stages_and_chunks_asked_for_bound_the_search():
    # fxpipe plan --gpus ignored --stages and --chunks
    x = torch.randn(32, 64)
    found = cluster_search(_mlp(), (x,), gpus=4, gpus_per_node=4, device="h100", batch=32, stages=[4], chunks=[8])
    assert found.ranked and all(c.shape.n_stages == 4 and c.shape.chunks == 8 for c in found.ranked + found.rejected)
    with pytest.raises(ValueError, match=r"no layout of 4 GPUs with stages in \[3\] takes a global batch of 32 rows"):
        cluster_search(_mlp(), (x,), gpus=4, gpus_per_node=4, device="h100", batch=32, stages=[3])
    with pytest.raises(ValueError, match=r"no layout of 1 GPUs with schedules in \['zbv'\] .* a single stage runs "
                                         r"only 1f1b"):  # one GPU's one stage was listed under --schedules zbv
        cluster_search(_mlp(), (x,), gpus=1, gpus_per_node=1, device="h100", batch=32, schedules=["zbv"])


def test_a_global_batch_no_layout_can_split_is_refused_as_such_not_as_memory():
    # 4 GPUs and 6 rows: the CLI said "no layout fits in 85.9GB per device" with an empty list of the closest
    from fxpipe import SearchSpaceError

    # then it said "stages in any and chunks in any" and no batch that would do
    with pytest.raises(SearchSpaceError, match="takes a global batch of 6 rows.*chunks divide each replica's rows "
                                               "and are at least pp, and a single stage runs only 1f1b \\(gradient "
                                               "accumulation\\); a global batch of 8 rows has layouts"):
        cluster_search(nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(6)]),  # no TP plan
                       (torch.randn(8, 4, 8, 8),), gpus=4, gpus_per_node=4, device="h100", batch=6)
