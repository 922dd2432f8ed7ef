import copy
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.fx
from torch import nn

import fxpipe
from fxpipe import passes


class Contrastive(nn.Module):
    """Embed two views and score each row against every row of the batch, as CLIP's logits do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        u, v = self.a(x), self.b(y)
        return {"embeds": u, "logits": u @ v.t()}


class BatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h, h.mean(0)


class PerRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).reshape(-1, 2, 4)
        return self.b(h.flatten(1)), h.flatten(0, 1)  # (B, 8) and (2 B, 4): dim 0 follows the batch


def _annotated(model, *inputs):
    gm = torch.fx.symbolic_trace(model)
    passes.annotate(gm, inputs, {})
    return gm


def test_an_output_scoring_every_row_against_the_batch_is_named():
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    found = passes.batch_coupled_outputs(_annotated(Contrastive(), x, y), 6, 3)
    assert len(found) == 1 and found[0].startswith("['logits'] (node 'matmul'): shape (6, 6) for 6 rows but (3, 3)")
    assert "dim 1 follows the batch too" in found[0]


def test_an_output_reduced_over_the_batch_is_named():
    found = passes.batch_coupled_outputs(_annotated(BatchMean(), torch.randn(6, 8)), 6, 2)
    assert len(found) == 1 and "[1]" in found[0] and "dim 0 does not follow the batch" in found[0], found


def test_an_output_with_the_batch_on_dim_1_is_named_with_the_transpose():
    # it was said to "couple the rows", with chunks=1 as the fix
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x):
            return self.a(x).t()

    found = passes.batch_coupled_outputs(_annotated(Transposed(), torch.randn(6, 8)), 6, 2)
    assert len(found) == 1 and "the batch is on dim 1" in found[0] and ".transpose(0, 1)" in found[0], found


def test_a_cache_with_the_batch_on_dim_1_names_use_cache_false():
    # XLNet's mems (sequence-first) in eval mode: the fix named was to edit the model, not to turn the cache off
    class Mems(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x):
            h = self.a(x)
            return {"logits": h, "mems": h.t()}

    found = passes.batch_coupled_outputs(_annotated(Mems(), torch.randn(6, 8)), 6, 2)
    assert len(found) == 1 and "use_mems=False" in found[0] and "use_cache=False" in found[0], found


def test_outputs_that_follow_the_batch_row_by_row_are_not_named():
    gm = _annotated(PerRow(), torch.randn(6, 8))
    assert passes.batch_coupled_outputs(gm, 6, 2) == [] and passes.batch_coupled_outputs(gm, 6, 6) == []


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_coupled_output_is_warned_at_compile_and_refused_by_pipe_call(tracer):
    torch.manual_seed(0)
    model, x, y = Contrastive(), torch.randn(4, 8), torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"couples the rows of a batch: \['logits'\].*Use chunks=1"):
        pipe = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x, y), chunks=2, tracer=tracer)
    with pytest.raises(fxpipe.PipelineInputError, match=r"cannot be joined.*\['logits'\].*chunks=1"):
        pipe(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one micro-batch: nothing to warn of, and equal to eager
        whole = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x, y), chunks=1, tracer=tracer)
    torch.testing.assert_close(whole(x, y)["logits"], model(x, y)["logits"])


class WithLoss(nn.Module):
    """Return per-row values and a loss over the batch, as a Hugging Face model given labels= does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, labels):
        out = self.b(torch.tanh(self.a(x)))
        return {"logits": out, "loss": ((out - labels) ** 2).mean()}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_0_dim_output_is_refused_by_pipe_call_before_anything_runs(tracer, monkeypatch):
    model, x, y = WithLoss(), torch.randn(4, 8), torch.randn(4, 8)
    pipe = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x, y), chunks=2, tracer=tracer)
    assert passes.scalar_outputs(pipe._runtime.binding.gm) == ["['loss']"]
    monkeypatch.setattr(pipe._runtime, "run", lambda *a: pytest.fail("ran the stages"))
    with pytest.raises(fxpipe.PipelineInputError, match=r"0-dim tensor \(\['loss'\]\).*2 micro-batches.*out\.loss"):
        pipe(x, y)
    monkeypatch.undo()
    loss = pipe.step(x, y, target=None, loss_fn=lambda out, _: out["loss"])  # what pipe.step trains on
    torch.testing.assert_close(loss, model(x, y)["loss"])
    whole = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x, y), chunks=1, tracer=tracer)
    torch.testing.assert_close(whole(x, y)["loss"], model(x, y)["loss"])


class Sized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "batch": h.shape[0]}


def test_an_int_output_following_the_batch_size_is_warned_and_refused_by_pipe_call():
    # equal micro-batches returned the micro-batch's size (2 for a batch of 6), silently
    x = torch.randn(6, 8)
    with pytest.warns(UserWarning, match=r"\['batch'\] \(node 'getitem'\): 6 for 6 rows but 2 for 2: an int that "
                                         r"follows the batch size"):
        pipe = fxpipe.compile(Sized(), 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match="cannot be joined into it: .*an int that follows the batch"):
        pipe(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one micro-batch: the model's own value, nothing to warn of
        model = Sized()
        assert fxpipe.compile(model, 2, example_inputs=(x,), chunks=1, devices=["cpu"] * 2)(x)["batch"] == 6


class SeqFirst(nn.Module):
    def __init__(self, transpose: bool):
        super().__init__()
        self.transpose = transpose
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False, torch's default
        self.rnn = nn.GRU(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = x.transpose(0, 1) if self.transpose else x
        h = self.rnn(self.enc(h))[0]
        return self.head(h.transpose(0, 1) if self.transpose else h)


def test_sequence_first_modules_reading_the_split_dim_are_warned_of():
    # (seq, batch, dim) inputs were split on the sequence: each micro-batch attended over its slice, silently
    x = torch.randn(6, 3, 16)
    with pytest.warns(UserWarning, match=r"'enc' \(TransformerEncoderLayer, batch_first=False\) reads dim 0 of its "
                                         r"input \(6, 3, 16\) as the sequence; 'rnn' \(GRU, batch_first=False\)"):
        fxpipe.compile(SeqFirst(transpose=False).eval(), 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2)
    with warnings.catch_warnings():  # batch-first inputs transposed inside the model: the batch reaches dim 1
        warnings.simplefilter("error")
        model = SeqFirst(transpose=True).eval()
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2)
        with torch.no_grad():
            assert (pipe(x) - model(x)).abs().max() < 1e-5


class SeqFirstAttention(nn.Module):
    """Torch's attention modules on (seq, batch, dim) inputs, transposed from batch-first inside or not."""

    def __init__(self, transpose: bool):
        super().__init__()
        self.transpose = transpose
        self.attn, self.enc = nn.MultiheadAttention(16, 2), nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = x.transpose(0, 1) if self.transpose else x
        h = self.enc(self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.transpose(0, 1) if self.transpose else h)


def test_sequence_first_modules_an_exported_graph_inlined_are_warned_of():
    # torch.export keeps no call_module nodes, so nothing named them: the pipe differed from eager by 0.36, silently
    x = torch.randn(6, 3, 16)
    with pytest.warns(UserWarning, match=r"'attn' \(MultiheadAttention, batch_first=False\) reads dim 0 of its "
                                         r"input \(6, 3, 16\) as the sequence; 'enc' \(TransformerEncoderLayer"):
        fxpipe.compile(SeqFirstAttention(transpose=False).eval(), 2, example_inputs=(x,), chunks=3,
                       devices=["cpu"] * 2, tracer="export")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = SeqFirstAttention(transpose=True).eval()
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2, tracer="export")
        with torch.no_grad():
            assert (pipe(x) - model(x)).abs().max() < 1e-5


class _DenseGCN(nn.Module):
    """Kipf's GCN on one graph: a dense adjacency ``(N, N)`` beside the nodes' features ``(N, F)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 4)

    def forward(self, x, adj):
        return self.b(adj @ torch.relu(self.a(x)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_adjacency_split_by_rows_is_warned_of_and_a_square_feature_input_is_not(tracer):
    # before: compiled silently, then torch's "mat1 and mat2 shapes cannot be multiplied (6x12 and 6x12)" at the step
    x, adj = torch.randn(12, 12), torch.rand(12, 12)
    with pytest.warns(UserWarning, match=r"input\(s\) 'adj' \(12, 12\) pair the batch's rows with one another.*"
                                         r"Use chunks=1"):
        fxpipe.compile(_DenseGCN(), 2, example_inputs=(x, adj), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    with warnings.catch_warnings():  # x is (12, 12) too, but the model runs on its micro-batches' rows
        warnings.simplefilter("error")
        fxpipe.compile(_DenseGCN(), 2, example_inputs=(x, adj), chunks=1, devices=["cpu"] * 2, tracer=tracer)
        fxpipe.compile(nn.Sequential(nn.Linear(12, 12), nn.Linear(12, 2)), 2, example_inputs=(x,), chunks=2,
                       devices=["cpu"] * 2, tracer=tracer)


class _SimRecord(NamedTuple):
    emb: torch.Tensor
    sim: torch.Tensor
    rows: int


class _RecordContrastive(nn.Module):
    """Return a NamedTuple holding an (B, B) score matrix and the batch's row count, built in the traced code."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.enc(x)
        return _SimRecord(h, h @ h.t(), x.shape[0])


def test_an_output_record_built_in_fx_code_is_looked_into():
    # torch.fx returns the record as one node calling its class: no field was checked, and pipe(x) returned the
    # micro-batches' (2, 2) score blocks joined into (6, 2), and rows=2 for eager's 6, silently
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    with pytest.warns(UserWarning, match=r"couples the rows of a batch: \[1\]"):
        pipe = fxpipe.compile(_RecordContrastive(), 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match="cannot be joined"):
        pipe(x)
