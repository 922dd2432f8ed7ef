"""Whole parameters beside a shard (Qwen3's per-head norms) are found; a whole activation there is refused."""

from __future__ import annotations

import pytest
import torch
import tpmodels as tm
from torch import nn

import fxpipe
from fxpipe.errors import TensorParallelError
from fxpipe.passes.tppartial import partial_params
from fxpipe.plan.assign import annotate_graph
from fxpipe.plan.tensorparallel import plan_tensor_parallel


def _planned(model, x, plan="auto"):
    gm = fxpipe.trace(model, example_inputs=(x,))
    annotate_graph(gm, (x,), {})
    plan_tensor_parallel(gm, 2, plan)
    return gm


def test_per_head_norm_weights_are_found_traced_through_and_as_a_module():
    torch.manual_seed(0)
    model = tm.TiedDecoder()
    for block in model.blocks:
        block.attn = tm.QKNormAttention()
    names = partial_params(_planned(model, torch.randint(0, 64, (2, 8))))
    for i in range(2):
        assert f"blocks.{i}.attn.q_norm.weight" in names  # get_attr beside the heads' shard
        assert f"blocks.{i}.attn.k_norm.weight" in names  # nn.RMSNorm called on the shard
    assert not any("ln1" in n or "ln2" in n or n == "norm.weight" for n in names)  # norms of whole values


def test_a_model_whose_whole_weights_meet_whole_values_only_has_none():
    assert partial_params(_planned(tm.TiedDecoder(), torch.randint(0, 64, (2, 8)))) == []


class _Gated(nn.Module):
    """A per-token gate computed from the residual stream scales the heads' shard."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.fc1(x) * torch.sigmoid(self.gate(x)))


def test_a_whole_activation_carrying_a_gradient_beside_a_shard_is_refused_in_a_written_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    with pytest.raises(TensorParallelError, match="gradient each rank would compute only in part"):
        _planned(_Gated(), torch.randn(2, 4, 16), plan)


class _Shared(nn.Module):
    """One scale multiplies the heads' shard and the whole input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4) * self.scale
        return self.o(q.reshape(b, t, 16)) + (x.view(b, t, 4, 4) * self.scale).reshape(b, t, 16)


def test_a_whole_weight_used_beside_a_shard_and_on_a_whole_value_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # the group's sum would count the whole use's gradient once per rank (111% off)
    with pytest.raises(TensorParallelError, match=r"'scale' is used beside a shard .* and on a whole value"):
        _planned(_Shared(), torch.randn(2, 4, 16), {"q": ColwiseParallel(), "o": RowwiseParallel()})


class _PerHeadScale(nn.Module):
    """Cohere's qk-norm: a weight with a row per head on the heads' shard."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(32, 32), nn.Linear(32, 32)
        self.scale = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        b, s, _ = x.shape
        return self.o((self.q(x).view(b, s, 4, 8) * self.scale.to(x.dtype)).reshape(b, s, 32))


def test_a_weight_per_head_beside_the_heads_shard_is_refused_naming_it_and_the_fix():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"q": ColwiseParallel(), "o": RowwiseParallel()}
    with pytest.raises(TensorParallelError, match=r"\(parameter 'scale', shape \(4, 8\), as large as the "
                                                  r"unsharded dim.*leave the linears that make this shard out of the plan"):
        _planned(_PerHeadScale(), torch.randn(2, 3, 32), plan)
