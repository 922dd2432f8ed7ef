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


def test_a_schedule_of_two_stages_per_line_on_fewer_ranks_names_stages_per_rank(monkeypatch):
    # 4 stages on 2 lines, stages_per_rank left at 1: the refusal named --nproc-per-node 4 or n_stages=2, neither of
    # which runs that schedule; then "n_stages=2, stages_per_rank=2", which is one rank's layout
    from torch import nn

    from fxpipe.runtime.schedules.builtin import resolve

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with pytest.raises(ValueError, match=r"or compile with n_stages=2, or keep n_stages=4 with stages_per_rank=2 "
                                         r"\(2 stages on each rank"):
        fxpipe.compile(model, 4, example_inputs=(torch.randn(2, 4),), runtime="distributed", schedule="1f1b")
    text = "0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0"
    with pytest.raises(fxpipe.ScheduleError, match=r"holding \[2, 2\] stages: pass stages_per_rank=2"):
        resolve(text, 4, 1, 1)
