"""Where a plan runs: the launched world is checked before the schedule's needs."""

import pytest
import torch

import fxpipe


def test_a_wrong_process_count_is_named_before_the_schedule_s_needs(monkeypatch):
    """3 processes for 4 stages, 2 per rank: the world is the cause, not chunks=1 (fewer than 2 ranks need)."""
    from torch import nn


    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it; refused before any process group starts
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with pytest.raises(ValueError, match="n_stages=4 but 3 ranks are running; 2 stages run per rank, so launch "
                                         "with --nproc-per-node 2 \\(or compile with n_stages=6\\)"):
        fxpipe.compile(model, 4, example_inputs=(torch.randn(2, 4),), runtime="distributed", schedule="interleaved",
                       stages_per_rank=2)
