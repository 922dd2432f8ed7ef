"""Tensor-parallel plans on the traced graph, in one process: auto pairing, the size rewrite, the refusals."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
import tpmodels as tm
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxpipe
from fxpipe.errors import TensorParallelError
from fxpipe.passes.tpops import reshape_dim
from fxpipe.passes.tpviews import rewrite_sizes
from fxpipe.plan.assign import annotate_graph
from fxpipe.plan.tensorparallel import plan_tensor_parallel
from fxpipe.plan.tpstyles import style_text


def _graph(model, x, tracer="fx"):
    gm = fxpipe.trace(model, tracer=tracer, example_inputs=(x,))
    annotate_graph(gm, (x,), {})
    return gm


def _styles(plan):
    return {fqn: style_text(s) for fqn, s in plan.styles.items()}


def _decoder():
    return _graph(tm.TiedDecoder(), torch.randint(0, 64, (2, 8)))


@pytest.mark.parametrize("name", ["mlp", "decoder", "llama"])
def test_auto_finds_the_written_plan(name):
    """Megatron's pairing from the graph: the same styles as the plans written by hand (torchtitan's way)."""
    if name == "llama":
        pytest.importorskip("transformers")
        gm, written = _graph(tm.llama(), torch.randint(0, 64, (2, 8)), "export"), tm.LLAMA_PLAN
    elif name == "decoder":
        gm, written = _decoder(), tm.DECODER_PLAN
    else:
        gm, written = _graph(tm.ResidualMLP(), torch.randn(4, 16)), tm.MLP_PLAN
    auto, hand = plan_tensor_parallel(gm, 2, "auto"), plan_tensor_parallel(gm, 2, written)
    assert _styles(auto) == _styles(hand)
    record = auto.record(1)
    left = {"mlp": ["inp", "head"], "decoder": ["pos"], "llama": ["lm_head"]}[name]
    assert record["replicated"] == left  # what it cannot pair stays whole


def test_decoder_plan_pairs_attention_and_ties_the_head():
    styles = _styles(plan_tensor_parallel(_decoder(), 2, "auto"))
    assert styles["blocks.0.attn.k"] == "ColwiseParallel()" and styles["blocks.0.attn.o"] == "RowwiseParallel()"
    assert styles["embed"] == "RowwiseParallel(input_layouts=Replicate())"  # vocabulary-parallel
    assert styles["head"] == "ColwiseParallel(output_layouts=Replicate())"  # tied to it: the same shard, gathered


class _ViewedIds(tm.TiedDecoder):
    """GPT-2's way in: the token ids viewed (``ids.view(-1, n)``) before the embedding reads them."""

    def forward(self, ids):
        return super().forward(ids.view(-1, ids.shape[-1]))


def test_an_embedding_reading_a_view_of_the_ids_is_made_vocabulary_parallel():
    # GPT-2's wte stayed whole (with its tied head): the embedding read a view, not the input itself
    styles = _styles(plan_tensor_parallel(_graph(_ViewedIds(), torch.randint(0, 64, (2, 8))), 2, "auto"))
    assert styles["embed"] == "RowwiseParallel(input_layouts=Replicate())"
    assert styles["head"] == "ColwiseParallel(output_layouts=Replicate())"


def test_hard_coded_head_counts_become_local():
    """view(b, s, 4, 8) after a column-wise projection is view(b, s, 2, 8) on each of 2 ranks."""
    gm = _decoder()
    plan_tensor_parallel(gm, 2, "auto")
    rewritten = rewrite_sizes(gm, 2)
    assert len(rewritten) == 8  # q, k, v views and the merge back, in each of 2 blocks
    assert ".view(getitem_1, getitem_2, 2, 8)" in gm.code and ".reshape(getitem_1, getitem_2, 16)" in gm.code


def test_grouped_query_expand_becomes_local():
    pytest.importorskip("transformers")
    gm = _graph(tm.llama(), torch.randint(0, 64, (2, 8)), "export")
    plan_tensor_parallel(gm, 2, "auto")
    rewrite_sizes(gm, 2)
    expands = [n for n in gm.graph.nodes if n.name.startswith("expand_") and len(n.args[1]) == 5]
    assert expands and all(list(n.args[1][1:3]) == [1, 2] for n in expands)  # 2 key/value heads: 1 per rank


class ComputedHeads(nn.Module):
    """Heads computed from a whole value's size: the rewrite divides it where it is used."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.q(x).view(b, s, x.size(-1) // 4, 4)
        return self.o(F.gelu(h).reshape(b, s, -1))


def test_a_size_computed_from_a_whole_value_is_divided():
    gm = _graph(ComputedHeads(), torch.randn(2, 3, 16))
    plan_tensor_parallel(gm, 2, "auto")
    assert rewrite_sizes(gm, 2) == ["view"]
    assert " // 2" in gm.code


@pytest.mark.parametrize("plan, match", [
    ({"blocks.*.attn.qq": ColwiseParallel()}, r"'blocks\.\*\.attn\.qq' matches no module .*nearest FQNs.*'blocks\.0\.attn\.q'"),
    ({"blocks.*.attn": ColwiseParallel()}, "names a module the trace went through"),
    ({"blocks.*.ln1": ColwiseParallel()}, r"ColwiseParallel\(\) on 'blocks\.0\.ln1' \(LayerNorm\): ColwiseParallel applies "
                                           "to nn.Linear and nn.Embedding only"),
    ({"embed": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())},
     r"RowwiseParallel reads an embedding's indices as Shard\(-1\).*input_layouts=Replicate\(\)"),
    ({"embed": RowwiseParallel(input_layouts=Replicate())}, "a weight tied between 'embed'.*'head' \\(not in the plan\\)"),
    ({"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.o": RowwiseParallel()},
     "cannot run node 'matmul' in module 'blocks.0.attn': it multiplies a shard of batch dim 1 with the whole"),
])
def test_written_plans_are_refused_naming_the_module(plan, match):
    with pytest.raises(TensorParallelError, match=match):
        plan_tensor_parallel(_decoder(), 2, plan)


def test_a_sharded_model_output_is_refused():
    gm = _graph(tm.ResidualMLP(), torch.randn(4, 16))
    with pytest.raises(TensorParallelError, match="the model returns 'head' as a shard of dim 1, not whole"):
        plan_tensor_parallel(gm, 2, {"head": ColwiseParallel()})


def test_a_dimension_t_does_not_divide_is_refused_with_the_sizes_that_fit():
    # under 'auto' the fix offered was "leave the linears in 'blocks.0' out of the plan", of a plan the user did
    # not write, naming the first block of eight alike
    with pytest.raises(TensorParallelError, match=r"tensor_parallel=3 does not divide the heads .* of "
                                                  r"'blocks\.0\.attn' \(4\) \(and 7 more region\(s\) it does not "
                                                  r"divide\); tp_plan='auto' then splits no region of the model: use a "
                                                  r"tensor_parallel that divides them all \(1, 2, 4\), or write "
                                                  r"tp_plan= yourself") as refused:
        plan_tensor_parallel(_decoder(), 3, "auto")
    assert "out of the plan" not in str(refused.value)
    # widths 75 and 35: it offered (1, 3, 5, 15, 25), the first region's sizes, which 35 takes none of but 5
    mixed = nn.Sequential(nn.Linear(16, 75), nn.ReLU(), nn.Linear(75, 16), nn.Linear(16, 35), nn.ReLU(),
                          nn.Linear(35, 16))
    with pytest.raises(TensorParallelError, match=r"use a tensor_parallel that divides them all \(1, 5\)"):
        plan_tensor_parallel(_graph(mixed, torch.randn(4, 16)), 2, "auto")
    with pytest.raises(TensorParallelError, match=r"does not divide the output features of 'blocks\.0\.attn\.q' "
                                                  r"\(32\).*\(1, 2, 4, 8, 16, 32\)"):
        plan_tensor_parallel(_decoder(), 3, {"blocks.*.attn.q": ColwiseParallel()})


def test_a_vocabulary_t_does_not_divide_stays_whole_under_auto_and_is_refused_in_a_written_plan():
    # GPT-2's vocabulary (50257) is prime: 'auto' refused the whole model, naming sizes its heads cannot take
    model = tm.TiedDecoder()
    model.embed = nn.Embedding(63, 32)
    model.head = nn.Linear(32, 63, bias=False)
    model.head.weight = model.embed.weight
    gm = _graph(model, torch.randint(0, 63, (2, 8)))
    plan = plan_tensor_parallel(gm, 2, "auto")
    assert "embed" not in plan.styles and "head" not in plan.styles
    assert any(k.startswith("blocks.") for k in plan.styles)  # the blocks are split all the same
    with pytest.raises(TensorParallelError, match=r"does not divide the .* of 'embed' \(63\).*\(1, 3, 7, 9, 21"):
        plan_tensor_parallel(_graph(model, torch.randint(0, 63, (2, 8))), 2, {"embed": RowwiseParallel(input_layouts=Replicate())})


def test_tensor_parallel_needs_ranks():
    with pytest.raises(ValueError, match="tensor_parallel=2 splits each stage's layers over 2 ranks; use "
                                         "runtime='distributed'"):
        fxpipe.compile(tm.ResidualMLP(), 2, example_inputs=(torch.randn(4, 16),), tensor_parallel=2)
    with pytest.raises(TypeError, match="tp_plan must be 'auto' or a dict"):
        fxpipe.compile(tm.ResidualMLP(), 2, example_inputs=(torch.randn(4, 16),), tp_plan=["fc1"])


def test_a_world_that_cannot_hold_the_layout_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")  # as torchrun sets it; refused before any process group starts
    with pytest.raises(ValueError, match="world 6 cannot hold 2 pipeline ranks x 1 replicas x 2 tensor-parallel "
                                         "ranks .*launch 4 processes"):
        fxpipe.compile(tm.ResidualMLP(), 2, example_inputs=(torch.randn(4, 16),), runtime="distributed",
                       tensor_parallel=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # it said "launch 6 processes, or launch a multiple of 6 processes"
    with pytest.raises(ValueError, match=r"world 4 cannot hold 2 pipeline ranks x 1 replicas x 3 tensor-parallel "
                                         r"ranks .*; launch 6 processes \(or a multiple of 6 with data_parallel=\), or "
                                         r"pass a tensor_parallel that 4 ranks hold with 2 pipeline ranks \(1, 2; "):
        fxpipe.compile(tm.ResidualMLP(), 2, example_inputs=(torch.randn(4, 16),), runtime="distributed",
                       tensor_parallel=3)


@pytest.mark.parametrize("before, after, dim, want", [
    ((2, 8, 32), (2, 8, 4, 8), 2, 2), ((2, 8, 4, 8), (2, 8, 32), 2, 2), ((2, 4, 8, 8), (2, 256), 1, 1),
    ((2, 8, 32), (2, 8, 1, 32), 2, 3),
])
def test_reshapes_carry_the_sharded_dim(before, after, dim, want):
    assert reshape_dim(before, after, dim, 2) == want


def test_a_reshape_that_splits_a_shard_unevenly_says_why():
    why, size = reshape_dim((2, 8, 24), (2, 8, 3, 8), 2, 2)
    assert size == 3 and "2 ranks do not divide" in why
    why, size = reshape_dim((2, 8, 32), (2, 256), 2, 2)
    assert size is None and "not the leading dim" in why


class _Conv1D(nn.Module):
    """A projection written as addmm on its own (in, out) weight, as transformers' GPT-2 Conv1D is."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def test_a_plan_key_naming_a_module_the_graph_does_not_call_says_so():
    # it said 'matches no module of the model', listing that very module among the nearest FQNs
    model = nn.Sequential(_Conv1D(16, 64), nn.ReLU(), _Conv1D(64, 16))
    with pytest.raises(TensorParallelError, match=r"tp_plan key '0' names \['0'\], which the graph holds as no module "
                                                  r"call.*Conv1D.*leave it out of the plan"):
        plan_tensor_parallel(_graph(model, torch.randn(4, 16), "export"), 2, {"0": ColwiseParallel()})


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_plan_that_splits_little_is_warned_of_naming_the_layers_left_whole(tracer):
    # GPT-2 under tensor_parallel=2 split nothing and said nothing: both ranks computed everything
    model = nn.Sequential(_Conv1D(16, 64), nn.ReLU(), _Conv1D(64, 16))
    with pytest.warns(UserWarning, match=r"tensor_parallel=2 with tp_plan='auto' splits 0% of the parameters: every "
                                         r"rank computes the rest whole, e.g. '0' \(5\d%\), '2' \(\d\d%\).*Conv1D"):
        plan_tensor_parallel(_graph(model, torch.randn(4, 16), tracer), 2, "auto")


class _TwoWidths(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 33), nn.Linear(33, 16)  # 33: two ranks do not divide it
        self.up2, self.down2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down2(torch.nn.functional.gelu(self.up2(torch.tanh(self.down(torch.nn.functional.gelu(
            self.up(x)))))))


def test_auto_leaves_a_region_t_does_not_divide_whole_and_splits_the_others():
    # auto refused the whole model naming 'up', and its fix ("leave 'up' out of the plan") has no plan to apply to
    with pytest.warns(UserWarning, match=r"tp_plan='auto' leaves a region whole: tensor_parallel=2 does not divide "
                                         r"the output features of 'up' \(33\)"):
        plan = plan_tensor_parallel(_graph(_TwoWidths(), torch.randn(4, 16)), 2, "auto")
    assert _styles(plan) == {"up2": "ColwiseParallel()", "down2": "RowwiseParallel()"}


def test_auto_warns_once_of_regions_left_whole_alike_in_every_layer():
    # Mistral at tensor_parallel=4 (2 key/value heads) warned once per reshape: 8 times per rank
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan_tensor_parallel(_graph(nn.Sequential(*(_TwoWidths() for _ in range(3))), torch.randn(4, 16)), 2, "auto")
    whole = [str(w.message) for w in seen if "leaves a region whole" in str(w.message)]
    assert len(whole) == 1 and "of '0.up' (33); and 2 more region(s) like it" in whole[0], whole


class _ResidualLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = x + self.a(x)  # each shard would meet the residual add whole: no column-then-row pair closes
        return x + self.b(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_linears_whose_pairing_does_not_close_are_named_as_such_not_as_other_layers(tracer):
    # the warning told the user to replace them by nn.Linear, which they are (under export always: its graph
    # keeps no modules, so Phi-3's fused qkv_proj was sent to nn.Linear)
    with pytest.warns(UserWarning, match=r"splits 0% of the parameters.*They are nn.Linear layers the automatic "
                                         r"plan could not pair column-wise then row-wise"):
        plan_tensor_parallel(_graph(_ResidualLinears(), torch.randn(4, 16), tracer), 2, "auto")


class _MultiQuery(nn.Module):
    """Multi-query attention (4 query heads, 1 key/value head) and an MLP, with residual adds."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(32, 32), nn.Linear(32, 32)
        self.k, self.v = nn.Linear(32, 8, bias=False), nn.Linear(32, 8)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 1, 8).transpose(1, 2).expand(b, 4, s, 8)
        v = self.v(x).view(b, s, 1, 8).transpose(1, 2).expand(b, 4, s, 8)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, 32))
        return x + self.down(F.gelu(self.up(x)))


def test_multi_query_attention_left_whole_is_warned_of():
    # one key/value head: the attention's linears stayed whole and nothing said so (the MLP split)
    with pytest.warns(UserWarning, match=r"leaves a region whole: the linears 'k', 'q', 'v' split together do not "
                                         r"close .* \(multi-query attention's one key\/value head\)"):
        plan = plan_tensor_parallel(_graph(_MultiQuery(), torch.randn(2, 6, 32)), 2, "auto")
    assert _styles(plan) == {"up": "ColwiseParallel()", "down": "RowwiseParallel()"}


class _PositionBiased(nn.Module):
    """Attention over 4 heads with a bias of every head made outside it (T5's cross-attention position bias)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(1, 4, 6, 6))  # (1, heads, s, s)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, 4, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, 32))
        return x + self.down(F.gelu(self.up(x)))


def test_attention_left_whole_for_a_bias_of_every_head_names_the_bias_not_the_head_count():
    # the warning blamed a head count tensor_parallel does not divide (multi-query attention) for T5's 4 heads at 2
    with pytest.warns(UserWarning, match=r"leaves a region whole: .*the whole of '.*'\); the value it names is whole "
                                         r"over every head \(a position bias") as seen:
        plan = plan_tensor_parallel(_graph(_PositionBiased(), torch.randn(2, 6, 32)), 2, "auto")
    assert not any("multi-query" in str(w.message) for w in seen)
    assert _styles(plan) == {"up": "ColwiseParallel()", "down": "RowwiseParallel()"}


def test_multi_query_attention_in_a_written_plan_names_the_heads():
    # the refusal named only the node where a shard met a whole value (rotary's mul in Llama)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    with pytest.raises(TensorParallelError, match=r"not all on one head dim \(with fewer key/value heads than "
                                                  r"tensor_parallel=2, as in multi-query attention"):
        plan_tensor_parallel(_graph(_MultiQuery(), torch.randn(2, 6, 32)), 2, plan)


class _ReshapedHead(nn.Module):
    """A head of 5 classes whose logits the model's own code reshapes (a loss computed in forward)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.down(F.gelu(self.up(x)))).view(-1, 5)


def test_a_size_left_whole_outside_any_module_names_the_region():
    # the warning named module 'None' ("reshapes of 'None' (5)"): the reshape is the model's own code
    with pytest.warns(UserWarning, match=r"leaves a region whole: tensor_parallel=2 does not divide the sharded dim "
                                         r"that node 'view' reshapes outside any module, in the region of 'head' "
                                         r"\(5\)"):
        plan = plan_tensor_parallel(_graph(_ReshapedHead(), torch.randn(4, 16)), 2, "auto")
    assert _styles(plan) == {"up": "ColwiseParallel()", "down": "RowwiseParallel()"}


def test_an_empty_plan_is_refused_not_read_as_auto():
    with pytest.raises(fxpipe.TensorParallelError, match=r"tp_plan=\{\} splits nothing.*pass tp_plan='auto'"):
        fxpipe.compile(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), 2, example_inputs=(torch.randn(4, 8),),
                       tensor_parallel=2, tp_plan={})


def test_a_region_refused_at_each_of_its_nodes_is_counted_once():
    # a 3-head Llama at tensor_parallel=2 said "and 11 more region(s)" for 4 layers: q, k and v's views each
    from fxpipe.passes.tpauto import _counted

    messages = [f"does not divide the heads that node '{v}' reshapes of 'layers.{i}.attn' (3)"
                for i in range(4) for v in (f"view_{3 * i}", f"view_{3 * i + 1}", f"view_{3 * i + 2}")]
    (told,) = _counted(messages)
    assert told.startswith("does not divide the heads that node 'view_0' reshapes of 'layers.0.attn'"), told
    assert told.endswith("; and 3 more region(s) like it"), told


class _GroupedQueryAttention(nn.Module):
    """Four query heads over two key/value heads of 8 (grouped-query attention, as Llama's)."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(32, 32), nn.Linear(32, 32)
        self.k, self.v = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, 32))


def test_the_sizes_offered_for_grouped_query_attention_divide_the_key_value_heads_too():
    # it offered (1, 2, 4) from the query heads alone: tensor_parallel=4 then left every attention whole
    model = nn.Sequential(OrderedDict(attn=_GroupedQueryAttention(), out=nn.Linear(32, 32)))
    with pytest.raises(TensorParallelError, match=r"tensor_parallel=3 does not divide the heads .* of 'attn' \(4\) "
                                                  r"nor its other heads \(2: grouped key/value heads\?\).*; .*use a "
                                                  r"tensor_parallel that divides them all \(1, 2\)"):
        plan_tensor_parallel(_graph(model, torch.randn(2, 8, 32)), 3, "auto")
