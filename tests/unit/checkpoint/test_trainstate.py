"""The training state a checkpoint keeps by FQN: optimizer, random generators, batch norm in flight."""

import torch
from torch import nn

from fxpipe.checkpoint.trainstate import (
    batch_norm_state,
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_batch_norm_state,
    set_rng_state,
)
from fxpipe.runtime.stage.batchnorm import commit_batch_norm, defer_batch_norm, pipe_running


def test_optimizer_state_goes_by_fqn_into_another_grouping():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    flat = optimizer_state(opt, model)
    assert set(flat) >= {"state.0.weight.exp_avg", "state.1.bias.step", "param_groups.1.weight"}
    assert dict(flat["param_groups.0.bias"])["lr"] == 0.01
    other = torch.optim.Adam([{"params": [model[1].bias, model[1].weight]},
                              {"params": [model[0].weight, model[0].bias]}], lr=0.5)
    load_optimizer_state(other, model, flat)
    assert other.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(other.state[p][key], opt.state[p][key])


def test_random_generators_come_back():
    torch.manual_seed(3)
    saved = rng_state(0)
    expected = torch.rand(4)
    torch.rand(100)
    set_rng_state(0, saved)
    assert torch.equal(torch.rand(4), expected)


def test_batch_norm_sums_in_flight_come_back():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    deferred = defer_batch_norm(model.modules())
    with pipe_running(deferred):  # as a pipe's step runs it
        model(torch.randn(6, 3))  # accumulated, not committed: a step cut short
    flat = batch_norm_state(1, deferred, model)
    assert sorted(flat) == ["1.bn.1.count", "1.bn.1.sum", "1.bn.1.sum_squares"]
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh_deferred = defer_batch_norm(fresh.modules())
    set_batch_norm_state(1, fresh_deferred, fresh, flat)
    commit_batch_norm(deferred)
    commit_batch_norm(fresh_deferred)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    assert batch_norm_state(1, fresh_deferred, fresh) == {}
