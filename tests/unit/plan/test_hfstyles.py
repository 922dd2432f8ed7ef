"""A Hugging Face model's own tp_plan (style names) resolves to PyTorch's styles; other names are refused."""

from __future__ import annotations

import pytest
import torch
import tpmodels as tm

import fxpipe
from fxpipe.errors import TensorParallelError
from fxpipe.plan.assign import annotate_graph
from fxpipe.plan.hfstyles import from_name
from fxpipe.plan.tensorparallel import plan_tensor_parallel
from fxpipe.plan.tpstyles import style_text

_NAMES = {"embed": "embedding_rowwise", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
          "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise", "blocks.*.mlp.fc1": "colwise",
          "blocks.*.mlp.fc2": "rowwise", "head": "colwise_gather_output",
          "blocks.*.ln1": "replicated_with_grad_allreduce"}


def _styles(plan):
    gm = fxpipe.trace(tm.TiedDecoder(), example_inputs=(torch.randint(0, 64, (2, 8)),))
    annotate_graph(gm, (torch.randint(0, 64, (2, 8)),), {})
    return {fqn: style_text(s) for fqn, s in plan_tensor_parallel(gm, 2, plan).styles.items()}


def test_a_plan_of_hugging_face_names_equals_the_written_styles():
    assert _styles(_NAMES) == _styles(tm.DECODER_PLAN)


def test_a_name_fxpipe_does_not_read_is_refused_naming_the_fix():
    with pytest.raises(TensorParallelError, match=r"tp_plan\['x'\] = 'local_colwise' is Hugging Face's notation.*"
                                                  r"PyTorch style object"):
        from_name("local_colwise", "x")
    assert from_name("replicated_with_grad_allreduce", "x") is None and from_name("replicate", "x") is None
    assert style_text(from_name("rowwise_split_input", "x")) == "RowwiseParallel(input_layouts=Replicate())"


def test_a_hugging_face_key_for_a_module_the_model_lacks_is_skipped_with_a_warning():
    # Qwen3-MoE's own plan keeps the dense MLP's keys though every layer is a mixture of experts: it was refused
    with pytest.warns(UserWarning, match=r"1 key\(s\) of the Hugging Face plan name no module .*'blocks\.\*\.mlp\."
                                         r"gate_proj'"):
        assert _styles({**_NAMES, "blocks.*.mlp.gate_proj": "colwise"}) == _styles(tm.DECODER_PLAN)
    with pytest.raises(TensorParallelError, match="matches no module of the model"):
        _styles({"blocks.*.mlp.gate_proj": "colwise"})  # nothing at all matches: a plan for another model
    written = {**tm.DECODER_PLAN, "blocks.*.mlp.gate_proj": tm.DECODER_PLAN["blocks.*.mlp.fc1"]}
    with pytest.raises(TensorParallelError, match="'blocks.\\*.mlp.gate_proj' matches no module"):
        _styles(written)  # a style object written by hand: a typo is refused
