"""An exported torch.vmap stays whole in one stage, and no run leaves its functorch level open."""

import copy

import pytest
import torch
import torch.nn.functional as F
from checks import assert_step_equals_eager
from fxpipe.passes.nesting import is_nesting, levels_restored
from torch import nn

import fxpipe


class _MaskedByVmap(nn.Module):
    """Attention whose causal mask a torch.vmap builds (as flex_attention's create_block_mask does)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        pos = torch.arange(h.shape[1], device=h.device)
        mask = torch.vmap(lambda q: (q >= pos).float())(pos)
        h = torch.softmax(h @ h.transpose(1, 2) - 1e4 * (1 - mask), -1) @ h
        return self.c(torch.relu(self.b(h)))


@pytest.mark.parametrize("n_stages", [2, 3, 5])
def test_a_vmap_in_forward_runs_whole_in_one_stage_and_equals_eager(n_stages):
    # propagation failed ("Cannot access storage of BatchedTensorImpl") and left the process inside a vmap level,
    # so every later requires_grad_ and export failed; a cut inside the vmap would leave it open too
    torch.manual_seed(0)
    model = _MaskedByVmap()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 5, 16), torch.randn(6, 5, 4)
    pipe = fxpipe.compile(model, n_stages, example_inputs=(x,), chunks=3, tracer="export",
                          devices=["cpu"] * n_stages)
    ends = [[n.name for n in stage.graph.nodes if n.op == "call_function" and is_nesting(n)] for stage in pipe.stages]
    assert sorted(name for names in ends for name in names) == ["_vmap_decrement_nesting", "_vmap_increment_nesting"]
    assert sum(1 for names in ends if names) == 1, ends  # both ends in one stage
    assert_step_equals_eager(pipe, model, eager, x, y, F.mse_loss)
    assert torch._C._functorch.maybe_current_level() is None


def test_a_split_point_inside_a_vmap_is_refused_naming_its_ends():
    x = torch.randn(6, 5, 16)
    with pytest.raises(ValueError, match=r"split point 'le' \(node 'le'\) falls inside a torch.vmap, from node "
                                         r"'_vmap_increment_nesting' to '_vmap_decrement_nesting'"):
        fxpipe.compile(_MaskedByVmap(), 2, example_inputs=(x,), tracer="export", split_points=["le"],
                       devices=["cpu"] * 2)
    assert torch._C._functorch.maybe_current_level() is None


def test_a_run_stopping_inside_a_vmap_leaves_no_level_open():
    with pytest.raises(RuntimeError, match="stopped"), levels_restored():
        torch._C._functorch._vmap_increment_nesting(2, "error")
        raise RuntimeError("stopped")
    assert torch._C._functorch.maybe_current_level() is None
    nn.Linear(2, 2).requires_grad_(False)  # raised "inside of a function being transformed" with a level open
