"""fxpipe.compat.torchgpipe.balance: per-layer measurements cut by fxpipe's exact partitioner."""

import pytest
import torch
from torch import nn

from fxpipe.compat.torchgpipe.balance import (
    balance_by_size,
    balance_by_time,
    blockpartition,
)
from fxpipe.compat.torchgpipe.skip import pop, skippable, stash


class Expand(nn.Module):
    """Keep ``times`` new tensors alive for backward (memory grows with ``times``)."""

    def __init__(self, times, width=1):
        super().__init__()
        self.times = times
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        for _ in range(self.times):
            x = x + torch.rand_like(x, requires_grad=True)
        return x


def test_blockpartition_is_the_exact_cut():
    assert blockpartition.solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert blockpartition.solve([5, 1, 1, 1, 1, 5], partitions=3) == [[5], [1, 1, 1, 1], [5]]
    with pytest.raises(ValueError, match="shorter"):
        blockpartition.solve([1], partitions=2)


@pytest.mark.parametrize("times, balance", [([1, 2, 3, 4, 5, 6], [4, 2]), ([6, 5, 4, 3, 2, 1], [2, 4])])
def test_balance_by_size_runs_on_cpu(times, balance):
    model = nn.Sequential(*[Expand(t) for t in times])
    assert balance_by_size(2, model, torch.rand(10, 16, 16), param_scale=0, device="cpu") == balance


@pytest.mark.parametrize("param_scale, balance", [(0, [2, 4]), (100, [4, 2])])
def test_balance_by_size_weighs_parameters_by_param_scale(param_scale, balance):
    # latent memory falls along the layers while parameters grow: param_scale picks the winner
    model = nn.Sequential(*[Expand(7 - width, width) for width in range(1, 7)])
    sample = torch.rand(1, requires_grad=True)
    assert balance_by_size(2, model, sample, param_scale=param_scale, device="cpu") == balance


def test_balance_by_time_feeds_skips_to_the_layers_that_pop_them():
    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x

    @skippable(pop=["skip"])
    class Pop(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return x + skip

    class Slow(nn.Module):
        def __init__(self, steps):
            super().__init__()
            self.steps = steps

        def forward(self, x):
            for _ in range(self.steps):
                x = torch.tanh(x)
            return x

    model = nn.Sequential(Stash(), Slow(1000), Slow(1000), Slow(1000), Pop()).eval()
    # the median of the rounds in 0.3 s: one round alone moved the cut on a busy machine ([3, 1, 1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert balance_by_time(2, model, torch.randn(8, 4), timeout=0.3, device="cpu") in ([2, 3], [3, 2])
    # three helpers and the suite on 2 cores gave [3, 1, 1] at 0.3 s: the median of the rounds in 1 s
    assert balance_by_time(3, model, torch.randn(8, 4), timeout=1.0, device="cpu") == [2, 1, 2]
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_balance_by_size_profiles_a_batch_norm_in_training_mode():
    # it profiled one row, which a batch norm in training mode refuses ("Expected more than 1 value per channel")
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    balance = balance_by_size(2, model, torch.randn(16, 8), chunks=2, device="cpu")
    assert sum(balance) == 5 and len(balance) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is CUDA where there is one")
def test_the_default_device_is_the_cpu_on_a_machine_without_cuda():
    # torchgpipe's default (cuda) raised "Torch not compiled with CUDA enabled" for the snippet as written
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert sum(balance_by_time(2, model, torch.randn(8, 4), timeout=0.1)) == 3
    assert sum(balance_by_size(2, model, torch.randn(8, 4))) == 3
