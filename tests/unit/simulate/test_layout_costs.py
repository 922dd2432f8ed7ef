"""What replicas, FSDP2 and a two-level network add to a simulated step (fxpipe.simulate.network, dpcost)."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.simulate.devices import NOMINAL, DeviceModel
from fxpipe.simulate.network import Layout, ring_seconds

UNIT = DeviceModel("unit", {"float32": 1e9}, memory_bandwidth=8e9, memory=1e12, link_bandwidth=1e9,
                   link_latency=0.0, efficiency={"gemm": 1.0, "conv": 1.0}, d_half={}, element_seconds=1e-9,
                   kernel_overhead=0.0, backward_overhead=0.0, action_overhead=0.0, nominal=False,
                   gpus_per_node=2, inter_bandwidth=1e8, inter_latency=0.0, tp_bandwidth=1e9)


def _pipe(n=2):
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)])
    return fxpipe.compile(model, n, example_inputs=(torch.randn(32, 64),), devices=["cpu"] * n, chunks=4,
                          checkpoint="never")


def test_ring_costs():
    assert ring_seconds("all_reduce", 8e9, 4, 1e9, 0.0) == pytest.approx(12.0)  # 2 (g - 1) / g x bytes / bw
    assert ring_seconds("reduce_scatter", 8e9, 4, 1e9, 1e-3) == pytest.approx(6.0 + 3e-3)
    assert ring_seconds("all_gather", 8e9, 1, 1e9, 1.0) == 0.0


def test_replicas_cross_nodes_on_the_slower_link():
    grid = Layout(dp=2, pp=2)  # 4 ranks, 2 per node: the replicas of pipeline rank 0 are ranks 0 and 2
    assert grid.rank(1, 0) == 2
    assert grid.dp_seconds("all_reduce", 1e8, UNIT) == pytest.approx(1.0)  # 2 x 1/2 x 1e8 / 1e8 (between nodes)
    assert grid.hop_seconds(0, 1, 1e9, UNIT) == pytest.approx(1.0)  # ranks 0 and 1 share a node
    assert Layout(dp=2, pp=1).dp_seconds("all_reduce", 1e8, UNIT) == pytest.approx(0.1)  # inside a node
    assert Layout(pp=1, tp=4).tp_link(UNIT).tp_bandwidth == UNIT.inter_bandwidth  # a tp group wider than a node


def test_a_measured_collective_scale_multiplies_its_kind_only():
    slow = UNIT.replace(collective_scale={"reduce_scatter": 2.5})
    grid = Layout(dp=2, pp=1)
    assert grid.dp_seconds("reduce_scatter", 1e8, slow) == pytest.approx(2.5 * grid.dp_seconds("reduce_scatter", 1e8, UNIT))
    assert grid.dp_seconds("all_reduce", 1e8, slow) == pytest.approx(grid.dp_seconds("all_reduce", 1e8, UNIT))


def _last_backwards(sim):
    return {j: max((s for s in sim.spans if s.action.stage == j and s.action.is_backward), key=lambda s: s.end)
            for j in range(len(sim.costs))}


def test_replicas_hold_each_last_backward_until_reduced_and_count_every_row():
    from fxpipe.simulate.dpcost import step_collectives

    pipe = _pipe()
    alone = fxpipe.simulate(pipe, device=UNIT, runtime="distributed")
    two = fxpipe.simulate(pipe, device=UNIT, runtime="distributed", data_parallel=2)
    grads = 2 * 64 * 64 * 4  # a stage's gradients, bytes: one DDP bucket, reduced after the backward
    ring = 2 * 0.5 * grads / UNIT.inter_bandwidth  # replicas on other nodes (2 GPUs per node, pp=2)
    held, plain = _last_backwards(two), _last_backwards(alone)
    assert "distributed, 2 replicas (DDP)," in str(two) and "replicas" not in str(alone)  # the printed layout
    for j in (0, 1):  # DDP's backward returns once its buckets are reduced
        assert held[j].end - held[j].start == pytest.approx(plain[j].end - plain[j].start + ring)
    assert held[0].start >= held[1].end  # the gradients stage 0 needs leave after stage 1's reduction
    agree, average = step_collectives(Layout(dp=2, pp=2), UNIT, 0, 1)
    assert agree > 0 and average > 0  # the replicas' batch-size check and loss average
    told = max(s.end for s in two.spans if s.rank == 1) + average + UNIT.link_latency + 16 / UNIT.link_bandwidth
    assert two.step_time == pytest.approx(max(told, max(s.end for s in two.spans)))  # the loss averaged, then sent
    assert two.throughput == pytest.approx(2 * 32 / two.step_time)
    assert two.gpus == 4


def test_ranks_sharing_cores_reduce_after_the_last_backward():
    import dataclasses

    from fxpipe.simulate.dpcost import reduction_hold

    pipe = _pipe()
    sim = fxpipe.simulate(pipe, device=UNIT, runtime="distributed", data_parallel=2)
    rows = [[s.action for s in sim.spans if s.rank == r] for r in (0, 1)]
    costs = [dataclasses.replace(c, grads=100 * 2**20) for c in sim.costs]  # four DDP buckets
    grid = Layout(dp=2, pp=2)
    ring = grid.dp_seconds("all_reduce", 100 * 2**20, UNIT, 1)
    bucket = grid.dp_seconds("all_reduce", 25 * 2**20, UNIT, 1)
    last, earlier = rows[1][-1], next(a for a in rows[1] if a.is_backward)
    shared = reduction_hold(rows, costs, [0, 1], grid, UNIT.replace(slots=2.0))
    own = reduction_hold(rows, costs, [0, 1], grid, UNIT)
    assert shared(last, 1e3) == pytest.approx(ring)  # gloo's sums on the cores the backward needs: after it
    assert own(last, 0.0) == pytest.approx(ring)  # an accelerator's ride beside the backward ...
    assert own(last, 1e3) == pytest.approx(bucket)  # ... all but the last bucket
    assert own(earlier, 0.0) == 0.0  # only a stage's last backward reduces
    assert reduction_hold(rows, costs, [0, 1], Layout(dp=2, pp=2, tp=2), UNIT) is None  # tp: after the step
    assert reduction_hold(rows, costs, [0, 1], Layout(dp=2, pp=2, shard=True), UNIT) is None  # FSDP2: beside


def test_fsdp_reduce_scatters_after_each_last_backward_one_after_another():
    from fxpipe.simulate.dpcost import reduction_end

    pipe = _pipe()
    sim = fxpipe.simulate(pipe, device=UNIT, runtime="distributed", data_parallel=2, shard=True)
    grid = Layout(dp=2, pp=2, shard=True)
    last = _last_backwards(sim)
    ends = [last[j].end + grid.dp_seconds("reduce_scatter", sim.costs[j].grads, UNIT, j) for j in (0, 1)]
    assert reduction_end(sim.spans, sim.costs, [0, 1], grid, UNIT) == pytest.approx(max(ends))
    assert sim.step_time >= max(ends)


def test_fsdp_gathers_before_the_first_forward_and_shards_the_optimizer():
    pipe = _pipe()
    ddp = fxpipe.simulate(pipe, device=NOMINAL["h100"], runtime="distributed", data_parallel=4, optimizer="adam")
    fsdp = fxpipe.simulate(pipe, device=NOMINAL["h100"], runtime="distributed", data_parallel=4, shard=True,
                           optimizer="adam")
    for a, b in zip(ddp.stages, fsdp.stages):
        assert b.memory.params == pytest.approx(a.memory.params * 1.25)  # gathered, plus the 1/4 shard
        assert b.memory.optimizer == pytest.approx(a.memory.optimizer / 4)
    first = next(s for s in fsdp.spans if s.action.kind == "F" and s.action.stage == 0)
    plain = next(s for s in ddp.spans if s.action.kind == "F" and s.action.stage == 0)
    assert first.end - first.start > plain.end - plain.start  # the all-gather rides on the first forward
    assert fsdp.shard and not ddp.shard


def test_a_plan_records_its_layout():
    pipe = _pipe()
    assert pipe.plan.layout == {"runtime": "local", "data_parallel": 1, "data_parallel_shard": False,
                                "tensor_parallel": 1, "stages_per_rank": 1, "tracer": "fx"}
