"""Jagged batches: a per-row group vector warned of, one micro-batch splitting nothing and checking no sizes."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class PointSeg(nn.Module):
    """Flat points of several clouds, a per-point cloud index, a mean per cloud read back by each point."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 16), nn.Linear(32, 2)

    def forward(self, pos, batch):
        h = torch.relu(self.a(pos))
        total = h.new_zeros((4, h.shape[1])).index_add_(0, batch, h)
        count = h.new_zeros((4, 1)).index_add_(0, batch, torch.ones_like(h[:, :1]))
        return self.b(torch.cat([h, (total / count)[batch]], 1))


class Routed(nn.Module):
    """Top-1 routing by float scores into experts with index_add_: its indices are no input's."""

    def __init__(self):
        super().__init__()
        self.emb, self.router = nn.Embedding(20, 8), nn.Linear(8, 2)
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, ids):
        h = self.emb(ids).flatten(0, 1)
        top = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = torch.nonzero(top == k).squeeze(1)
            out = out.index_add(0, rows, expert(h[rows]))
        return out.view(ids.shape[0], ids.shape[1], -1).mean(1)


def _clouds():
    torch.manual_seed(0)
    return torch.randn(14, 3), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_per_row_group_vector_of_a_flat_batch_is_warned_of_and_one_chunk_equals_eager(tracer):
    # before: chunks=2 cut cloud 1 in two, each half pooled alone: outputs 0.20 off eager, silently
    pos, batch = _clouds()
    with pytest.warns(UserWarning, match=r"integer input\(s\) 'batch' \(node 'index_add_\w*'\) index the rows of a "
                                         r"reduction.*chunks=1"):
        fxpipe.compile(PointSeg(), 2, example_inputs=(pos, batch), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    model = PointSeg()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(pos, batch), chunks=1, devices=["cpu"] * 2, tracer=tracer)
    torch.testing.assert_close(pipe(pos, batch), eager(pos, batch))


class PutSeg(PointSeg):
    """PointSeg pooling with ``index_put_(..., accumulate=True)``, the same sum as ``index_add_``."""

    def forward(self, pos, batch):
        h = torch.relu(self.a(pos))
        total = h.new_zeros((4, h.shape[1])).index_put_((batch,), h, accumulate=True)
        count = h.new_zeros((4, 1)).index_put_((batch,), torch.ones_like(h[:, :1]), accumulate=True)
        return self.b(torch.cat([h, (total / count)[batch]], 1))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_group_vector_pooled_by_index_put_is_warned_of(tracer):
    # before: not warned of, outputs 0.26 off eager with chunks=2
    pos, batch = _clouds()
    with pytest.warns(UserWarning, match=r"integer input\(s\) 'batch' \(node 'index_put\w*'\) index the rows"):
        fxpipe.compile(PutSeg(), 2, example_inputs=(pos, batch), chunks=2, devices=["cpu"] * 2, tracer=tracer)


def test_routing_indices_made_from_scores_are_no_group_key():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fxpipe.compile(Routed(), 2, example_inputs=(torch.randint(0, 20, (4, 5)),), chunks=2, devices=["cpu"] * 2)


class Segments(nn.Module):
    """Flat rows and per-graph lengths (segment_reduce), a graph-level output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, data, lengths):
        return self.b(torch.segment_reduce(torch.relu(self.a(data)), "mean", lengths=lengths))


def test_one_micro_batch_checks_no_batch_sizes_and_trains_a_graph_level_target():
    # before: chunks=1 was refused ('batch sizes disagree ... or use chunks=1'), and a per-graph target with it
    torch.manual_seed(0)
    model, data, lengths, y = Segments(), torch.randn(14, 8), torch.tensor([4, 3, 5, 2]), torch.randint(0, 3, (4,))
    eager = copy.deepcopy(model)
    F.cross_entropy(eager(data, lengths), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(data, lengths), chunks=1, devices=["cpu"] * 2)
    pipe.step(data, lengths, target=y, loss_fn=F.cross_entropy)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with pytest.raises(fxpipe.PipelineInputError, match=r"batch sizes disagree.*If 'lengths' holds offsets, lengths "
                                                        r"or indices into rows.*chunks=1, which splits nothing"):
        fxpipe.compile(Segments(), 2, example_inputs=(data, lengths), chunks=2, devices=["cpu"] * 2)


def test_a_1_d_integer_input_given_whole_is_warned_of():
    pos, batch = _clouds()
    with pytest.warns(UserWarning, match=r"unbatched=\['lengths'\] gives 1-D integer input\(s\) whole"):
        fxpipe.compile(Segments(), 2, example_inputs=(torch.randn(14, 8), torch.tensor([4, 3, 5, 2])), chunks=2,
                       devices=["cpu"] * 2, unbatched=["lengths"])


class Timestep(nn.Module):
    """A diffusion model's timestep of shape (1,), broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, t):
        return self.a(x) * t.float()


def test_a_1_d_integer_input_of_one_value_given_whole_is_not_warned_of():
    # one value broadcasts: it cannot be offsets or indices (diffusers' UNet2DModel with torch.tensor([10]))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="unbatched=")
        fxpipe.compile(Timestep(), 2, example_inputs=(torch.randn(4, 8), torch.tensor([10])), chunks=2,
                       devices=["cpu"] * 2, unbatched=["t"])


class OneHot(nn.Module):
    """Label smoothing's one-hot of integer labels: a scatter along dim 1, each row to itself."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.a(x)
        return logits * logits.new_zeros(logits.shape).scatter_(1, labels.unsqueeze(1), 1.0)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_scatter_along_another_dim_than_the_rows_is_no_group_key(tracer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fxpipe.compile(OneHot(), 2, example_inputs=(torch.randn(8, 8), torch.randint(0, 5, (8,))), chunks=4,
                       devices=["cpu"] * 2, tracer=tracer)


class _BagOfWords(nn.Module):
    """Each row's own word counts: index_put over (its row, its ids); a plain write of each row's padding."""

    def __init__(self, accumulate=True):
        super().__init__()
        self.head, self.accumulate = nn.Linear(20, 2), accumulate

    def forward(self, x, ids):
        rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)
        bag = torch.zeros_like(x).index_put((rows, ids), torch.ones(()), accumulate=self.accumulate)
        return self.head(bag + x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_an_index_put_keeping_each_row_to_itself_is_no_group_key(tracer, accumulate):
    # warned of: the row index took in ids through expand_as(ids) (its shape only), and a plain write was a "sum"
    x, ids = torch.randn(8, 20), torch.randint(0, 20, (8, 3))
    model = _BagOfWords(accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxpipe.compile(model, 2, example_inputs=(x, ids), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, ids), model(x, ids))
